"""Faults, as a user meets them with `python -m mtjax.train` in a subprocess: SIGTERM saves and
exits cleanly, `kill -9` during an asynchronous save loses only the steps since the last
complete checkpoint, and a run that would discard checkpoints is refused."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_cli import TINY, snapshot, train_cli
from mtjax.training.checkpoint import existing_steps, verify

SMALL = ["model.hidden_size=64", "model.seq_len=64", "train.global_batch=8", "train.micro_batch=8",
         "train.log_interval=1", "train.eval_interval=0", "train.progress=false", "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def args_for(run_dir, cache, *extra):
    return ["--config", TINY, *SMALL, f"train.run_dir={run_dir}", f"data.cache_dir={cache}", *extra]


def start(args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen([sys.executable, "-m", "mtjax.train", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def read_until(proc, text, limit=120):
    """Lines of proc's stdout up to the first containing `text`."""
    deadline, lines = time.time() + limit, []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    proc.kill()
    raise AssertionError(f"{text!r} not seen: {lines}, {proc.stderr.read()}")


def logged_steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["step"] for line in f]


def test_sigterm_saves_and_exits_then_resume_continues(tmp_path, cache):
    run_dir = tmp_path / "run"
    proc = start(args_for(run_dir, cache, "train.steps=100000"), tmp_path)
    read_until(proc, "step 3 |")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM after step")]
    assert len(stopped) == 1, out
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    ckpt = os.path.join(run_dir, "checkpoints")
    assert existing_steps(ckpt) == [step] and verify(os.path.join(ckpt, str(step))) is None

    resumed = train_cli(args_for(run_dir, cache, f"train.steps={step + 2}"), tmp_path, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from checkpoint step {step}" in resumed.stdout
    assert logged_steps(run_dir) == list(range(1, step + 3))        # no step twice, none missing

    # resume=false over these checkpoints: refused in one line, nothing touched ...
    before = snapshot(tmp_path)
    refused = train_cli(args_for(run_dir, cache, "train.steps=2", "checkpoint.resume=false"), tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [refused.stderr.strip()]
    assert refused.stderr.startswith("error: checkpoint.resume:") and "checkpoint.overwrite=true" in refused.stderr
    assert snapshot(tmp_path) == before
    # ... unless overwrite=true: then it starts over.
    over = train_cli(args_for(run_dir, cache, "train.steps=2", "checkpoint.resume=false", "checkpoint.overwrite=true"),
                     tmp_path, timeout=120)
    assert over.returncode == 0 and "resumed" not in over.stdout, over.stderr
    assert existing_steps(ckpt) == [2] and logged_steps(run_dir) == [1, 2]


def test_kill_9_during_an_asynchronous_save_then_resume(tmp_path, cache):
    run_dir = tmp_path / "run"
    ckpt = os.path.join(run_dir, "checkpoints")
    proc = start(args_for(run_dir, cache, "train.steps=100000", "checkpoint.interval=1", "checkpoint.keep=3"), tmp_path)
    deadline, caught = time.time() + 180, None
    while time.time() < deadline and caught is None:
        saving = glob.glob(os.path.join(ckpt, "*.orbax-checkpoint-tmp*"))
        if saving and existing_steps(ckpt):
            proc.kill()                                               # SIGKILL, mid-save
            caught = int(os.path.basename(saving[0]).split(".")[0])
        time.sleep(0.002)
    proc.wait(timeout=60)
    assert caught is not None, "never saw a save in progress"
    assert proc.returncode == -signal.SIGKILL
    # Saves are one at a time, so step caught - 1 was sealed; step caught only if its rename
    # happened between the glob and the kill.
    expected = caught if os.path.isdir(os.path.join(ckpt, str(caught))) else caught - 1

    resumed = train_cli(args_for(run_dir, cache, f"train.steps={caught + 1}", "checkpoint.interval=1",
                                 "checkpoint.keep=3"), tmp_path, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    line = [x for x in resumed.stdout.splitlines() if x.startswith("resumed from checkpoint step")]
    assert len(line) == 1, resumed.stdout
    step = int(line[0].split("step ")[1].split(" ")[0])
    assert step == expected                               # the interrupted save was never used
    assert "unusable" not in resumed.stderr               # an unfinished save is invisible, not damaged
    assert not glob.glob(os.path.join(ckpt, "*.orbax-checkpoint-tmp*"))   # and is cleaned up
    assert existing_steps(ckpt)[-1] == caught + 1 and verify(os.path.join(ckpt, str(caught + 1))) is None

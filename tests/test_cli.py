"""End-to-end tests of `python -m mtjax.train` as a user runs it, in a subprocess.

Bad input must end in exit status 2 with exactly one stderr line `error: ...`
naming the key, no traceback, and nothing written: each case runs in a fresh
working directory inside tmp_path, with the run and cache directories pointed
there too, and tmp_path must be byte-for-byte unchanged afterwards.
Subprocesses start without the test suite's 8-device XLA flag; a case that
needs more devices asks for them with --cpu-devices.
"""

import glob
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def train_cli(args, cwd, timeout=60):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-m", "mtjax.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def snapshot(root):
    """Every path under root with its size and modification time."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out.append((os.path.relpath(path, root), st.st_size, st.st_mtime_ns))
    return sorted(out)


# (id, extra arguments, text the error line must contain, YAML written to {tmp}/c.yaml or None).
# Arguments follow `--config configs/tiny.yaml` unless they name their own --config.
CASES = [
    ("unknown_key", ["model.hiden_size=64"], "error: model.hiden_size:", None),
    ("unknown_key_in_file", ["--config", "{tmp}/c.yaml"], "error: train.stepz:", "train:\n  stepz: 3\n"),
    ("wrong_type_float_for_int", ["model.num_layers=2.5"], "error: model.num_layers:", None),
    ("wrong_type_int_for_bool", ["model.tie_embeddings=1"], "error: model.tie_embeddings:", None),
    ("out_of_range_dropout", ["model.dropout=-0.1"], "error: model.dropout:", None),
    ("unknown_precision", ["train.precision=fp8"], "error: train.precision:", None),
    ("negative_data_seed", ["data.seed=-1"], "error: data.seed:", None),
    ("hidden_vs_heads", ["model.num_heads=3"], "error: model.hidden_size:", None),
    ("heads_vs_tensor", ["--cpu-devices", "3", "parallel.tensor=3"], "error: model.num_heads:", None),
    ("kv_heads_vs_tensor", ["--cpu-devices", "6", "parallel.tensor=6", "model.num_heads=12",
                            "model.num_kv_heads=4", "model.hidden_size=96"], "error: model.num_kv_heads:", None),
    ("layers_vs_pipe_virtual", ["--cpu-devices", "2", "parallel.pipe=2", "parallel.virtual_stages=2",
                                "parallel.schedule=interleaved"], "error: model.num_layers:", None),
    ("global_batch_vs_micro_data", ["--cpu-devices", "4"], "error: train.global_batch:", None),
    ("mesh_vs_devices", ["--cpu-devices", "2", "parallel.data=4"], "error: parallel:", None),
    ("missing_data_file", ["data.path={tmp}/corpus"], "error: data.path:", None),
    ("missing_tokenizer", ["data.tokenizer={tmp}/tokenizer.json"], "error: data.tokenizer:", None),
    ("malformed_yaml", ["--config", "{tmp}/c.yaml"], "error: --config:", "model:\n  hidden_size: [64\n"),
    ("config_is_a_directory", ["--config", "{tmp}"], "error: --config:", None),
    ("missing_config_file", ["--config", "{tmp}/nope.yaml"], "error: --config:", None),
    ("bad_flag", ["--bogus"], "--bogus", None),
]


def run_case(tmp_path, args, yaml_text):
    """(CompletedProcess, snapshot before, snapshot after) of one bad-input run in its own tmp_path."""
    tmp = str(tmp_path)
    if yaml_text is not None:
        (tmp_path / "c.yaml").write_text(yaml_text, encoding="utf-8")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    args = [a.replace("{tmp}", tmp) for a in args]
    if "--config" not in args:
        args = ["--config", TINY, *args]
    args += [f"train.run_dir={tmp}/run", f"data.cache_dir={tmp}/cache"]
    before = snapshot(tmp)
    r = train_cli(args, cwd)
    return r, before, snapshot(tmp)


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """All CASES, run a few at a time (each subprocess mostly spends its second importing JAX)."""
    dirs = {name: tmp_path_factory.mktemp(name) for name, *_ in CASES}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(run_case, dirs[name], args, yaml_text) for name, args, _, yaml_text in CASES}
        return {name: (str(dirs[name]), *f.result()) for name, f in futures.items()}


@pytest.mark.parametrize("name,expect", [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(bad_runs, name, expect):
    tmp, r, before, after = bad_runs[name]
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and expect in lines[0], lines[0]
    assert r.stdout == ""
    assert after == before


def test_tiny_run_writes_metrics_and_tensorboard(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = train_cli(["--config", TINY, "train.steps=3", "train.log_interval=1", "train.eval_interval=0",
                   f"train.run_dir={run_dir}", f"data.cache_dir={cache}", "model.num_layers=1",
                   "model.hidden_size=32", "model.seq_len=32", "train.global_batch=4", "train.micro_batch=2"],
                  cwd, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert os.listdir(cwd) == []   # everything went where the config said

    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert isinstance(row["loss"], float) and math.isfinite(row["loss"])
    # A freshly initialised model predicts nearly uniformly over the 257 byte tokens
    # (padding rows excluded): the first loss is close to ln 257, not ln of the padded 384.
    assert abs(rows[0]["loss"] - math.log(257)) < 0.25
    events = glob.glob(str(run_dir / "tb" / "events.out.tfevents.*"))
    assert len(events) == 1 and os.path.getsize(events[0]) > 0

"""Several JAX processes make one job: 2 processes x 4 CPU devices train exactly like 1 x 8.

The multi-process runs go through scripts/launch_local.sh, as a user runs
them; the processes talk over localhost with gloo collectives. Subprocesses
get their own XLA flags (not the suite's 8-device flag): the same LLVM-only
`--xla_backend_optimization_level=0` as conftest.py, in both the reference
and the multi-process run, so both compile the same way.
"""
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

from mtjax.config import ConfigError, load_config
from mtjax.config.validate import validate_distributed
from mtjax.data import BatchLoader
from mtjax.distributed import CLUSTER, EXPLICIT, SINGLE, choose_mode, cluster_environment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
LAUNCH = os.path.join(REPO, "scripts", "launch_local.sh")
STEPS = 4
# (data, pipe, tensor) = (2, 2, 2): process 0 holds data rank 0, process 1 data rank 1,
# so `data` collectives cross processes while pipe and tensor stay inside one.
RUN = ["--config", TINY, "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "train.micro_batch=4",
       f"train.steps={STEPS}", "train.log_interval=1", f"train.eval_interval={STEPS}", "train.eval_batches=1",
       "train.progress=false"]


def env():
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith(("SLURM_", "OMPI_"))}
    # the suite's fast code generation (tests/conftest.py), the same in every process of both runs
    flags = f"--xla_backend_optimization_level=0 {os.environ.get('MTJAX_TEST_FAST_CODEGEN', '')}".strip()
    e.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHON=sys.executable)
    return e


# The command runs through a fresh Python that puts SIGINT and SIGTERM back to their defaults, then
# execs it (same PID): a pytest started in the background of a script, or after a test ran a command
# in-process, ignores both, ignored signals are inherited, and a launcher cannot trap a signal ignored
# on entry. (Not a preexec function: forking this multithreaded process to run Python can deadlock.)
DEFAULT_SIGNALS = [sys.executable, "-c", "import os, signal, sys\n"
                   "for s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_DFL)\n"
                   "os.execvp(sys.argv[1], sys.argv[1:])"]


def run(cmd, cwd, timeout=180, **extra_env):
    """CompletedProcess of `cmd`; on a timeout its whole process group (the launcher's children too) is killed."""
    with subprocess.Popen([*DEFAULT_SIGNALS, *cmd], cwd=cwd, env={**env(), **extra_env}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            kill_launched(cwd)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_launched(path):
    """The launcher's processes run in sessions of their own (a terminal's Ctrl-C reaches only the
    launcher): after a test gave up on it, kill them by the test directory in their arguments."""
    try:
        subprocess.run(["pkill", "-KILL", "-f", str(path)], check=False)
    except FileNotFoundError:       # no pkill here: each left process ends at its step count
        pass


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process x 8 devices, two processes x 4 devices): results and the launcher's log dir.

    Each run has a fresh cache dir, so the two processes build the corpus and
    sample indices at the same time (the writes are atomic renames).
    """
    tmp = tmp_path_factory.mktemp("multihost")
    one = [sys.executable, "-m", "mtjax.train", *RUN, "--cpu-devices", "8",
           f"train.run_dir={tmp}/one", f"data.cache_dir={tmp}/cache-one"]
    two = [LAUNCH, "2", *RUN, "--cpu-devices", "4", f"train.run_dir={tmp}/two", f"data.cache_dir={tmp}/cache-two"]
    logs = tmp / "logs"
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(run, one, tmp)
        b = pool.submit(run, two, tmp, MTJAX_LOG_DIR=str(logs))
        one_res, two_res = a.result(), b.result()
    assert one_res.returncode == 0, one_res.stderr[-3000:]
    assert two_res.returncode == 0, two_res.stderr[-3000:] + open(logs / "process-1.log").read()[-3000:]
    return tmp, one_res, two_res, logs


def test_two_processes_train_like_one(runs):
    """Same losses, gradient norms and validation loss, to 1e-6 relative.

    In practice they are bitwise equal; the tolerance allows gloo to order a sum
    over more than two terms (say, the gradient norm over all devices) differently
    from the in-process all-reduce, which can move the last bits, while a wrong
    batch split or a missed collective moves the loss by far more.
    """
    tmp = runs[0]
    one, two = metrics(tmp / "one"), metrics(tmp / "two")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in two], [r[key] for r in one], rtol=1e-6, atol=0, err_msg=key)
    np.testing.assert_allclose(two[-1]["val_loss"], one[-1]["val_loss"], rtol=1e-6, atol=0)
    assert "(2, 2, 2) on 8 cpu devices" in runs[2].stdout


def test_only_process_zero_writes(runs):
    """One metrics row per step (one writer), and process 1 prints no run summary or metrics."""
    tmp, _, two, logs = runs
    assert sorted(os.listdir(tmp / "two")) == ["checkpoints", "config.json", "metrics.jsonl", "tb"]
    assert len(metrics(tmp / "two")) == STEPS
    assert sum(line.startswith("step ") for line in two.stdout.splitlines()) == STEPS
    other = open(logs / "process-1.log").read()
    assert "mesh (" not in other and "step 1/" not in other and "loss" not in other


def test_two_processes_save_one_sealed_checkpoint_that_one_process_restores(runs):
    """The two-process run's final checkpoint (each process wrote its own shards) is sealed,
    and restores in this single process onto (1, 1, 4) with the same parameters as the
    one-process run's checkpoint."""
    import jax
    from mtjax.config import load_config
    from mtjax.mesh import make_mesh
    from mtjax.checkpoint import Checkpointer, verify
    from mtjax.training.trainer import Trainer
    tmp = runs[0]
    states = []
    for name in ("one", "two"):
        cfg = load_config(TINY, [*RUN[2:], f"train.run_dir={tmp}/{name}", "parallel.data=1", "parallel.pipe=1",
                                 "parallel.tensor=4", "train.micro_batch=8"])
        ck = Checkpointer(cfg)
        assert ck.steps() == [STEPS] and verify(os.path.join(ck.directory, str(STEPS))) is None
        trainer = Trainer(cfg, make_mesh(1, 1, 4, jax.devices()[:4]), 257)      # the byte vocabulary
        states.append(jax.device_get(ck.restore(STEPS, trainer).params))
        ck.close()
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_launcher_stops_the_others_when_one_fails(tmp_path):
    """Process 1 fails at once; process 0, waiting for its peer, is stopped; the exit status is 1's."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncase " $* " in *distributed.process_id=1*) exit 7;; esac\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    start = time.monotonic()
    res = run([LAUNCH, "2", "--config", TINY, f"train.run_dir={tmp_path}/run"], tmp_path, timeout=120,
              PYTHON=str(fake), MTJAX_LOG_DIR=str(tmp_path / "logs"))
    assert res.returncode == 7, res.stderr[-2000:]
    assert time.monotonic() - start < 60
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_ctrl_c_to_the_launch_stops_every_process_once_with_a_checkpoint(tmp_path):
    """Ctrl-C signals the terminal's whole process group: the launcher passes it on once (each
    process in its own session), so each finishes its step and saves, as one process does; a
    process signalled twice would stop at once, unsaved."""
    cmd = [LAUNCH, "2", "--config", TINY, "--cpu-devices", "2", "parallel.data=2", "parallel.tensor=2",
           "model.num_layers=1", "model.hidden_size=32", "model.seq_len=32", "train.steps=500",
           "train.log_interval=1", "train.eval_interval=0", "train.progress=false",
           f"train.run_dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"]
    with subprocess.Popen([*DEFAULT_SIGNALS, *cmd], cwd=tmp_path,
                          env={**env(), "MTJAX_LOG_DIR": str(tmp_path / "logs")}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            for line in proc.stdout:
                if line.startswith("step 3/"):
                    break
            os.killpg(proc.pid, signal.SIGINT)          # what a terminal's Ctrl-C does
            out, err = proc.communicate(timeout=120)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            kill_launched(tmp_path)
            raise
    assert proc.returncode == 0, err[-2000:]
    assert "stopped by SIGINT after step" in out and "checkpoint saved" in out, out[-2000:] + err[-2000:]
    steps = [int(name) for name in os.listdir(tmp_path / "run" / "checkpoints") if name.isdigit()]
    assert len(steps) == 1 and steps[0] >= 3


def test_slurm_tasks_join_without_options(tmp_path):
    """Two processes with a simulated `srun` environment find each other through JAX's SLURM detection."""
    cmd = [sys.executable, "-m", "mtjax.train", "--config", TINY, "--cpu-devices", "2", "model.num_layers=1",
           "model.hidden_size=32", "model.seq_len=32", "train.global_batch=4", "train.micro_batch=1",
           "train.steps=1", "train.eval_interval=0", "train.progress=false", "checkpoint.enabled=false",
           f"train.run_dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"]
    slurm = dict(SLURM_JOB_ID=str(os.getpid()), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2")
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda i: run(cmd, tmp_path, timeout=120, SLURM_PROCID=str(i), SLURM_LOCALID=str(i),
                                              **slurm), range(2)))
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-2000:] + results[1].stderr[-2000:]
    assert "(4, 1, 1) on 4 cpu devices" in results[0].stdout and "mesh" not in results[1].stdout
    assert len(metrics(tmp_path / "run")) == 1


def test_processes_given_different_configs_refuse_in_one_line(tmp_path):
    """One process given another seed would train other weights in silence (another size: fail in
    a collective; more steps: wait forever): both refuse at once, naming the field, exit 2."""
    cmd = [sys.executable, "-m", "mtjax.train", "--config", TINY, "--cpu-devices", "1", "model.num_layers=1",
           "train.progress=false", f"train.run_dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"]
    slurm = dict(SLURM_JOB_ID=str(os.getpid()), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2")
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda i: run(cmd + [f"train.seed={7 * i}"], tmp_path, timeout=120,
                                              SLURM_PROCID=str(i), SLURM_LOCALID=str(i), **slurm), range(2)))
    for res in results:
        assert res.returncode == 2, res.stderr[-2000:]
        assert res.stderr.strip().splitlines() == [
            "error: train.seed: differs between the processes of this job (process 0's is not process 1's): "
            "give every process the same config"], res.stderr[-2000:]
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("overrides, key", [
    (["distributed.coordinator=localhost:1234"], "distributed.num_processes"),
    (["distributed.coordinator=localhost:1234", "distributed.num_processes=2"], "distributed.process_id"),
    (["distributed.coordinator=localhost:1234", "distributed.num_processes=2", "distributed.process_id=2"],
     "distributed.process_id"),
    (["distributed.coordinator=localhost", "distributed.num_processes=2", "distributed.process_id=0"],
     "distributed.coordinator"),
    (["distributed.num_processes=-1"], "distributed.num_processes"),
    (["distributed.heartbeat_timeout_s=0"], "distributed.heartbeat_timeout_s"),
    (["distributed.shutdown_timeout_s=-5"], "distributed.shutdown_timeout_s"),
])
def test_bad_distributed_options_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        validate_distributed(load_config(TINY, overrides))


def test_bad_distributed_options_are_one_line_exit_2(tmp_path):
    """Through the CLI: refused before JAX starts, nothing written; also no coordinator for 2 processes."""
    cases = [(["distributed.coordinator=localhost:1234"], "error: distributed.num_processes:"),
             (["distributed.num_processes=2"], "error: distributed.coordinator:")]
    cmd = [sys.executable, "-m", "mtjax.train", "--config", TINY, f"train.run_dir={tmp_path}/run",
           f"data.cache_dir={tmp_path}/cache"]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: run(cmd + c[0], tmp_path, timeout=60), cases))
    for (_, expected), res in zip(cases, results):
        assert res.returncode == 2, res.stderr[-2000:]
        assert res.stderr.splitlines() == [res.stderr.strip()] and res.stderr.startswith(expected), res.stderr
    assert os.listdir(tmp_path) == []


def test_modes_from_options_and_environment():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}
    ompi = {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:4000", "OMPI_COMM_WORLD_SIZE": "4"}
    assert cluster_environment(slurm) == "slurm" and cluster_environment(ompi) == "openmpi"
    assert cluster_environment({**slurm, "SLURM_NTASKS": "1"}) is None      # one task: an salloc shell
    assert cluster_environment({k: v for k, v in slurm.items() if k != "SLURM_PROCID"}) is None
    assert cluster_environment({}) is None
    explicit = load_config(TINY, ["distributed.coordinator=h:1", "distributed.num_processes=2",
                                  "distributed.process_id=0"])
    assert choose_mode(explicit, slurm) == EXPLICIT
    assert choose_mode(load_config(TINY, []), slurm) == CLUSTER
    assert choose_mode(load_config(TINY, []), {}) == SINGLE
    assert choose_mode(load_config(TINY, ["distributed.num_processes=1"]), {}) == SINGLE


class _Samples:
    """Sample i is the row [i, i, i]."""

    def __getitem__(self, i):
        return np.full(3, i, np.int32)


def test_loader_rows_read_part_of_each_batch_and_count_global_samples():
    full, part = BatchLoader(_Samples(), 8, position=16), BatchLoader(_Samples(), 8, position=16, rows=[4, 5, 6, 7])
    for _ in range(2):
        np.testing.assert_array_equal(part.next_batch(), full.next_batch()[4:])
    assert part.position == full.position == 32
    with pytest.raises(ValueError):
        BatchLoader(_Samples(), 8, rows=[8])


def test_put_batch_takes_the_global_batch_or_this_process_rows():
    """One process: local_rows is every row, and put_batch places the batch unchanged."""
    from mtjax.mesh import make_mesh
    from mtjax.training.trainer import Trainer
    cfg = load_config(TINY, ["parallel.data=2", "parallel.tensor=4", "train.micro_batch=8"])
    trainer = Trainer(cfg, make_mesh(2, 1, 4, jax.devices()[:8]), 257)
    np.testing.assert_array_equal(trainer.local_rows, np.arange(16))
    batch = np.arange(16 * 129, dtype=np.int32).reshape(16, 129)
    placed = trainer.put_batch(batch)
    np.testing.assert_array_equal(np.asarray(placed), batch)
    assert placed.sharding.spec == jax.sharding.PartitionSpec("data", None)
    with pytest.raises(ValueError):
        trainer.put_batch(batch[:8])


def test_the_stop_flag_is_agreed_one_step_late_without_waiting(monkeypatch):
    """The several-process path of StopRequest, run in this one process: each call returns what
    the maximum started by the previous call found, so every process stops at the same step."""
    import signal as signals_

    from mtjax.training import signals
    monkeypatch.setattr(signals, "_multi_process", lambda: True)
    with signals.StopRequest() as stop:
        assert stop.requested() is None          # nothing agreed yet; a maximum of 0 started
        stop._handle(signals_.SIGTERM, None)     # as the handler would on a signal
        assert stop.requested() is None          # the maximum started before the signal
        assert stop.requested() == "SIGTERM"     # the one started after it
        assert stop.requested() == "SIGTERM"


def test_a_passed_deadline_is_agreed_as_a_signal_is(monkeypatch):
    """train.exit_duration_min through the same agreement: a deadline passed is a flag above every
    signal's, named `time limit` one call later; a deadline ahead is no flag."""
    import time as clock

    from mtjax.training import signals
    monkeypatch.setattr(signals, "_multi_process", lambda: True)
    with signals.StopRequest(deadline=clock.monotonic() + 3600) as stop:
        assert stop.requested() is None and stop.requested() is None
    with signals.StopRequest(deadline=clock.monotonic() - 1) as stop:
        stop._handle(signal.SIGTERM, None)       # a signal too: the time limit's flag is the larger
        assert stop.requested() is None
        assert stop.requested() == "time limit"


def test_an_unreachable_coordinator_is_one_line_after_the_join_timeout(tmp_path):
    """Process 1 alone, its coordinator not listening: one line naming distributed.coordinator once
    distributed.join_timeout_s has passed (JAX's own join would abort with a stack trace after 300 s)."""
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]          # free, and nobody listens on it
    cmd = [sys.executable, "-m", "mtjax.train", "--config", TINY, f"distributed.coordinator=localhost:{port}",
           "distributed.num_processes=2", "distributed.process_id=1", "distributed.join_timeout_s=2",
           f"train.run_dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"]
    start = time.monotonic()
    res = run(cmd, tmp_path, timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.startswith(f"error: distributed.coordinator: localhost:{port} did not answer within "
                                 f"distributed.join_timeout_s=2 s") and res.stderr.count("\n") == 1, res.stderr
    assert time.monotonic() - start < 30 and os.listdir(tmp_path) == []


SAVE_FAILS = """
import errno, runpy, sys
import orbax.checkpoint as ocp
def full_disk(self, step, *args, **kwargs):      # this process's disk is full (its peer's is not)
    raise OSError(errno.ENOSPC, "No space left on device")
ocp.CheckpointManager.save = full_disk
sys.argv = ["mtjax.train"] + sys.argv[1:]
runpy.run_module("mtjax.train", run_name="__main__")
"""

# From its first save on, this process cannot make a file grow (RLIMIT_FSIZE 0): its writes fail with
# EFBIG, "File too large", a real file-system error, in orbax's background thread (process 1 writes
# its shards and their metadata there; the metadata the main thread writes is process 0's).
WRITE_FAILS = """
import resource, runpy, sys
from mtjax.checkpoint import checkpointer
start = checkpointer.Checkpointer._start
def start_unwritable(self, *args, **kwargs):
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
    return start(self, *args, **kwargs)
checkpointer.Checkpointer._start = start_unwritable
sys.argv = ["mtjax.train"] + sys.argv[1:]
runpy.run_module("mtjax.train", run_name="__main__")
"""


def one_fails(tmp_path, failing, hook, overrides=()):
    """Two processes (SLURM-style, one CPU device each) of a one-step run; process `failing` runs
    `hook` (a script that then runs mtjax.train). Their CompletedProcesses."""
    (tmp_path / "hook.py").write_text(hook, encoding="utf-8")
    args = ["--config", TINY, "--cpu-devices", "1", "model.num_layers=1", "model.hidden_size=32", "model.seq_len=32",
            "train.global_batch=2", "train.micro_batch=1", "train.steps=1", "train.eval_interval=0",
            "train.progress=false", f"train.run_dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache", *overrides]
    slurm = dict(SLURM_JOB_ID=str(os.getpid()), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2")
    head = lambda i: [sys.executable, str(tmp_path / "hook.py")] if i == failing else [sys.executable, "-m",
                                                                                        "mtjax.train"]
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda i: run(head(i) + args, tmp_path, timeout=90, SLURM_PROCID=str(i),
                                           SLURM_LOCALID=str(i), **slurm), range(2)))


def assert_ended_in_one_line(results, failing, fault):
    """Each process exited with the fault's status 1 and one line: the failing one its own, the
    other naming it; `fault(text)` checks the failing one's text."""
    texts = []
    for i, res in enumerate(results):
        assert res.returncode == 1, res.stderr[-2000:]
        lines = res.stderr.strip().splitlines()
        said = "error: " if i == failing else f"error: process {failing} of this job failed, so this one stops: "
        assert len(lines) == 1 and lines[0].startswith(said), res.stderr[-2000:]
        texts.append(lines[0][len(said):])
    assert texts[0] == texts[1] and fault(texts[0]), texts


def test_a_fault_in_one_process_ends_every_process_in_one_line(tmp_path):
    """Process 0 (the one hosting JAX's coordination service, so the last to leave) cannot write its
    checkpoint: it printed its line and then waited at exit in JAX's shutdown barrier, its peer in
    orbax's save barrier, 5 minutes each. Now both end at once,
    each with one line and the fault's status 1, the peer's naming the process that failed."""
    results = one_fails(tmp_path, 0, SAVE_FAILS)
    fault = f"checkpoint step 1 could not be written to {tmp_path}/run/checkpoints: [Errno 28] No space left on device"
    assert_ended_in_one_line(results, 0, lambda text: text.startswith(fault))


def test_a_write_failing_in_the_background_in_one_process_ends_every_process_in_one_line(tmp_path):
    """Process 1's files fail to grow once its save at step 12 has started, in orbax's background
    thread. Its finalize thread then waited at one of orbax's barriers for process 0, whose save thread
    waited at another for process 1's files: both processes for 20 minutes (orbax's async timeout),
    and only once the training reached its next save. Now process 1 goes past the barrier, its
    training loop reports the write in one line at its next step and process 0 ends with it, well
    before step 24. The layout splits the weights over the processes, so process 1 writes shards."""
    results = one_fails(tmp_path, 1, WRITE_FAILS, ["parallel.tensor=2", "train.steps=24", "checkpoint.interval=12",
                                                   "train.log_interval=1"])
    head = f"checkpoint step 12 could not be written to {tmp_path}/run/checkpoints: "
    assert_ended_in_one_line(results, 1, lambda text: text.startswith(head) and "File too large" in text
                             and text.endswith("; no earlier checkpoint exists"))
    logged = [int(line.split()[1].split("/")[0]) for line in results[0].stdout.splitlines() if line.startswith("step ")]
    assert 12 <= logged[-1] < 20, logged
    assert not os.path.exists(tmp_path / "run" / "checkpoints" / "12")


class FakeClient:
    """JAX's coordination client as `mtjax.distributed` uses it: a key-value store whose keys are set once."""

    def __init__(self):
        self.store = {}

    def key_value_set(self, key, value):
        if key in self.store:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.store[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.store:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        return self.store[key]


class Exited(Exception):
    pass


@pytest.fixture
def process_zero_of_a_job(monkeypatch):
    """This process as process 0 of a job with its fault watcher on, in-process: a fake client, and
    os._exit raising Exited(status)."""
    from mtjax import job_faults

    def leave(status):
        raise Exited(status)
    client = FakeClient()
    monkeypatch.setattr(job_faults, "_client", lambda: client)
    monkeypatch.setattr(job_faults, "_watching", True)
    monkeypatch.setattr(job_faults, "_ending", [])
    monkeypatch.setattr(job_faults, "_EXIT_GRACE_S", 0.0, raising=False)
    monkeypatch.setattr(os, "_exit", leave)
    monkeypatch.setattr(job_faults, "_quiet_stderr", lambda: None)    # not the test process's stderr
    return client


def test_a_fault_line_stderr_cannot_take_still_reaches_the_peers(process_zero_of_a_job, monkeypatch):
    """launch_local.sh writes the output of processes 1.. to log files: a fault that filled their disk
    made printing its line fail, so the process never posted it, and its peers waited for it. Now the
    line is posted and the process leaves, printed or not."""
    from mtjax import cli

    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass
    monkeypatch.setattr(sys, "stderr", Full())
    with pytest.raises(Exited) as left:
        cli._say("error: checkpoint step 4 could not be written", 1)
    assert left.value.args == (1,)
    assert process_zero_of_a_job.store["mtjax/fault"] == "1|0|checkpoint step 4 could not be written"


def test_a_process_ending_on_a_peers_fault_prints_that_line_only(process_zero_of_a_job, capsys):
    """The watcher printed the peer's line and began to leave; the main thread, its collective's peer
    gone, then failed too, and printed (and posted) a second line. Now the first thread to take the
    exit on prints the one line, and every thread leaves with its status."""
    import threading

    from mtjax import cli, job_faults
    process_zero_of_a_job.store["mtjax/fault"] = "2|1|data/c.bin: Input/output error"
    with pytest.raises(Exited) as watcher:
        job_faults._watch(process_zero_of_a_job, 0, 2, threading.Event())
    with pytest.raises(Exited) as main:
        cli._say("error: Gloo AllGather failed: Connection reset by peer", 1)
    assert watcher.value.args == main.value.args == (2,)
    said = "error: process 1 of this job failed, so this one stops: data/c.bin: Input/output error"
    assert capsys.readouterr().err == said + "\n"
    assert process_zero_of_a_job.store["mtjax/fault"] == "2|1|data/c.bin: Input/output error"


def test_the_timeouts_go_to_jax(monkeypatch):
    """distributed.join_timeout_s, heartbeat_timeout_s and shutdown_timeout_s are JAX's
    initialization, heartbeat and shutdown timeouts, in explicit and cluster mode."""
    import socket

    from mtjax import distributed
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(distributed, "_enable_cpu_collectives", lambda: None)
    monkeypatch.setattr(distributed, "check_same_config", lambda cfg: None)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    timeouts = ["distributed.join_timeout_s=7", "distributed.heartbeat_timeout_s=20",
                "distributed.shutdown_timeout_s=9"]
    explicit = load_config(TINY, [f"distributed.coordinator=localhost:{port}", "distributed.num_processes=2",
                                  "distributed.process_id=0", *timeouts])
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0"}
    assert distributed.initialize(explicit, environ={}) == EXPLICIT
    assert distributed.initialize(load_config(TINY, timeouts), environ=slurm) == CLUSTER
    assert len(calls) == 2
    for kwargs in calls:
        assert (kwargs["initialization_timeout"], kwargs["heartbeat_timeout_seconds"],
                kwargs["shutdown_timeout_seconds"]) == (7, 20, 9), kwargs


def test_a_second_process_zero_is_one_line_before_joining():
    """Two processes given process_id=0 (the second's coordinator port already taken): every process
    of the job ended in JAX's C++ abort; now the second is refused in one line before JAX joins."""
    import socket

    from mtjax import distributed
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_config(TINY, [f"distributed.coordinator=localhost:{port}", "distributed.num_processes=2",
                                 "distributed.process_id=0"])
        with pytest.raises(ConfigError, match=f"^distributed.process_id: 0 is this process, but port {port} "):
            distributed.initialize(cfg, environ={})
    assert not jax.distributed.is_initialized()

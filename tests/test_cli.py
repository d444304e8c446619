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

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def child_env(**extra):
    """The environment of a command's subprocess: this one's without the suite's 8-device flag (a
    case that needs more devices asks for them with --cpu-devices) but with its other XLA flags
    (conftest.py: LLVM at -O0). The commands here run a few steps, so compiling is most of their
    time: a cold start of a 2-step tiny run takes 15 s of CPU rather than 26 s at XLA's default."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu", **extra}


def train_cli(args, cwd, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "mtjax.train", *args], cwd=cwd, env=env or child_env(),
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
    ("global_batch_vs_micro_data", ["--cpu-devices", "8"], "error: train.global_batch:", None),
    ("mesh_vs_devices", ["--cpu-devices", "2", "parallel.data=4"], "error: parallel:", None),
    ("missing_data_file", ["data.path={tmp}/corpus"], "error: data.path:", None),
    ("missing_tokenizer", ["data.tokenizer={tmp}/tokenizer.json"], "error: data.tokenizer:", None),
    ("malformed_yaml", ["--config", "{tmp}/c.yaml"], "error: --config:", "model:\n  hidden_size: [64\n"),
    ("config_is_a_directory", ["--config", "{tmp}"], "error: --config:", None),
    ("missing_config_file", ["--config", "{tmp}/nope.yaml"], "error: --config:", None),
    ("bad_flag", ["--bogus"], "--bogus", None),
    # values validation once let through, and the run died on
    ("infinite_lr", ["optim.lr=.inf"], "error: optim.lr:", None),
    ("nan_in_file", ["--config", "{tmp}/c.yaml"], "error: optim.min_lr:", "optim:\n  min_lr: .nan\n"),
    ("empty_run_dir", ["train.run_dir="], "error: train.run_dir:", None),
    ("run_dir_is_a_file", ["train.run_dir={tmp}/c.yaml"], "error: train.run_dir:", "x: 1\n"),
    ("run_dir_under_a_file", ["train.run_dir={tmp}/c.yaml/run"], "error: train.run_dir:", "x: 1\n"),
    ("cache_dir_is_a_file", ["data.cache_dir={tmp}/c.yaml"], "error: data.cache_dir:", "x: 1\n"),
    ("checkpoint_dir_is_a_file", ["checkpoint.dir={tmp}/c.yaml"], "error: checkpoint.dir:", "x: 1\n"),
    ("zero_cpu_devices", ["--cpu-devices=0"], "error: --cpu-devices:", None),
    ("step_does_not_fit_in_memory", ["model.seq_len=65536", "data.valid_fraction=0"], "error: memory:", None),
    # YAML and arguments taken silently before
    ("duplicate_key", ["--config", "{tmp}/c.yaml"], "error: --config:", "train:\n  steps: 2\n  steps: 3\n"),
    ("duplicate_group", ["--config", "{tmp}/c.yaml"], "error: --config:", "train:\n  steps: 2\ntrain:\n  seed: 3\n"),
    ("argument_prefix", ["--cpu-device", "2"], "--cpu-device", None),
    ("config_given_twice", ["--config", TINY, "--config", TINY], "error: --config: is given twice", None),
    ("empty_config_path", ["--config", ""], "error: --config: must name a file", None),
    ("deeply_nested_yaml", ["--config", "{tmp}/c.yaml"], "error: --config:", "model: " + "[" * 5000 + "\n"),
    # values found by a sweep of every key: out of int32, not representable in fp32, absurd sizes,
    # settings that would train nothing, a setting that would be dropped silently
    ("int_beyond_int32", ["optim.warmup_steps=2147483648"], "error: optim.warmup_steps:", None),
    ("float_beyond_fp32", ["optim.clip_grad=1e300"], "error: optim.clip_grad:", None),
    ("float_flushing_to_zero", ["optim.eps=1e-300"], "error: optim.eps:", None),
    ("norm_eps_at_least_one", ["model.norm_eps=1e30"], "error: model.norm_eps:", None),
    ("absurd_hidden_size", ["model.hidden_size=1000000000", "model.num_heads=1"], "error: model.hidden_size:", None),
    ("unknown_decay_style", ["optim.decay_style=wsd2"], "error: optim.decay_style:", None),
    ("wsd_decay_past_the_decay", ["optim.decay_style=wsd", "optim.wsd_decay_steps=100000"],
     "error: optim.wsd_decay_steps:", None),
    ("virtual_stages_without_pipe", ["parallel.schedule=interleaved", "parallel.virtual_stages=2"],
     "error: parallel.virtual_stages:", None),
    ("too_many_cpu_devices", ["--cpu-devices=100000"], "error: --cpu-devices:", None),
    ("metrics_file_is_a_directory", ["train.run_dir={tmp}/r"], "error: train.run_dir:", "x: 1\n"),
    # the 2d / 2.5d tensor grid: t must be q^2 (q^2 d), the depth must divide t, the micro-batch d q
    ("grid_tensor_not_square", ["--cpu-devices", "8", "parallel.tensor=8", "parallel.tensor_grid=2d"],
     "error: parallel.tensor:", None),
    ("grid_depth_not_dividing", ["--cpu-devices", "8", "parallel.tensor=8", "parallel.tensor_grid=2.5d",
                                 "parallel.tensor_depth=3"], "error: parallel.tensor_depth:", None),
    ("grid_batch_not_divisible", ["--cpu-devices", "8", "parallel.tensor=8", "parallel.tensor_grid=2.5d",
                                  "parallel.tensor_depth=2", "train.micro_batch=2"], "error: train.micro_batch:", None),
    ("grid_with_sequence_parallel", ["--cpu-devices", "4", "parallel.tensor=4", "parallel.tensor_grid=2d",
                                     "parallel.sequence_parallel=true"], "error: parallel.sequence_parallel:", None),
    # the no-effect rule, and too few devices naming the flag and the count (issue 39)
    ("sequence_parallel_at_tensor_1", ["parallel.sequence_parallel=true"], "error: parallel.sequence_parallel:", None),
    ("cpu_devices_forgotten", ["parallel.tensor=2"], "use --cpu-devices 2 to simulate 2 devices", None),
    # found by a probe of every field: a YAML key that is a list, and sizes within int32 whose step
    # traced into an OverflowError (int32 indexing) or whose host batch exhausted the memory
    ("yaml_key_is_a_list", ["--config", "{tmp}/c.yaml"], "error: --config: malformed YAML", "? [1, 2]\n: 3\n"),
    ("vocab_past_int32", ["model.vocab_size=2147483647"], "error: model.vocab_size:", None),
    ("expert_slots_past_int32", ["model.num_experts=16777216"], "error: model.num_experts:", None),
    ("global_batch_past_the_host", ["train.global_batch=2147483647", "train.micro_batch=1"],
     "error: train.global_batch:", None),
]


# Runs `python -m MODULE ARGV` for each job: runpy runs the module as __main__, as `-m` does,
# in a process forked from one interpreter that had imported JAX and mtjax.cli (the backend not
# started, so --cpu-devices still applies), and the exit is the interpreter's: SystemExit's code,
# a traceback and 1 on an exception, the atexit handlers, then the streams flushed. A bad-input
# case is mostly that import (1 s of its 1.1 s); the tiny run and the other tests here start the
# command itself.
FORKED = r"""
import atexit, json, os, runpy, sys, traceback
import jax, mtjax.cli
def case(cwd, module, argv, out, err):
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["-m", *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else (print(e.code, file=sys.stderr) or 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
jobs, running, codes = json.load(sys.stdin), {}, {}
for i, job in enumerate(jobs):
    while len(running) >= 4:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    pid = os.fork()
    if pid == 0:
        case(*job)
    running[pid] = i
while running:
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps([codes[i] for i in range(len(jobs))]))
"""


def cli_forked(jobs, out_dir, timeout=300, env=None):
    """[CompletedProcess] of `python -m MODULE ARGS` run in CWD, for each (args, cwd) or
    (args, cwd, module) of jobs (the module mtjax.train by default)."""
    jobs = [(*job, "mtjax.train")[:3] for job in jobs]
    files = [(os.path.join(out_dir, f"{i}.out"), os.path.join(out_dir, f"{i}.err")) for i in range(len(jobs))]
    spec = [[str(cwd), module, [str(a) for a in args], out, err] for (args, cwd, module), (out, err) in zip(jobs, files)]
    r = subprocess.run([sys.executable, "-c", FORKED], input=json.dumps(spec), env=env or child_env(),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return [subprocess.CompletedProcess([module, *args], code, open(out).read(), open(err).read())
            for (args, _, module), (out, err), code in zip(jobs, files, json.loads(r.stdout))]


def case_args(tmp_path, args, yaml_text):
    """(arguments, working directory) of one bad-input run in its own tmp_path, which it prepares."""
    tmp = str(tmp_path)
    if yaml_text is not None:
        (tmp_path / "c.yaml").write_text(yaml_text, encoding="utf-8")
    (tmp_path / "r" / "metrics.jsonl").mkdir(parents=True)        # a run directory with a bad entry
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    # the case's own values come last, so they override these
    args = [f"train.run_dir={tmp}/run", f"data.cache_dir={tmp}/cache", *(a.replace("{tmp}", tmp) for a in args)]
    if "--config" not in args:
        args = ["--config", TINY, *args]
    return args, cwd


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """{name: (tmp, CompletedProcess, snapshot before, snapshot after)} of all CASES."""
    dirs = {name: tmp_path_factory.mktemp(name) for name, *_ in CASES}
    jobs = [case_args(dirs[name], args, yaml_text) for name, args, _, yaml_text in CASES]
    before = {name: snapshot(str(dirs[name])) for name in dirs}
    results = cli_forked(jobs, str(tmp_path_factory.mktemp("streams")))
    return {name: (str(dirs[name]), r, before[name], snapshot(str(dirs[name]))) for name, r in zip(dirs, results)}


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
    assert len(events) == 1
    written = read_events(events[0])
    assert written[0].file_version == "brain.Event:2"
    assert written[1].session_log.status == written[1].session_log.START and written[1].step == 1
    scalars = {(e.step, v.tag): v.simple_value for e in written[2:] for v in e.summary.value}
    assert [step for step, tag in scalars if tag == "loss"] == [1, 2, 3]
    assert all(abs(scalars[row["step"], "loss"] - row["loss"]) <= 1e-6 * abs(row["loss"]) for row in rows)


def read_events(path):
    """The Event records of a TensorBoard file (TFRecord framing: length, its CRC, data, its CRC)."""
    import struct
    from tensorboardX.proto.event_pb2 import Event
    out, data = [], open(path, "rb").read()
    at = 0
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        event = Event()
        event.ParseFromString(data[at + 12:at + 12 + n])
        out.append(event)
        at += 12 + n + 4
    assert at == len(data)
    return out


def test_a_reader_gone_from_stdout_does_not_end_the_run(tmp_path):
    """`python -m mtjax.train ... | head -1`: the run trains on, printing nowhere, saves and exits 0
    (it ended in `error: Broken pipe`, unsaved)."""
    cmd = [sys.executable, "-m", "mtjax.train", "--config", TINY, "train.steps=4", "train.log_interval=1",
           "train.eval_interval=0", "train.progress=false", f"train.run_dir={tmp_path}/run",
           f"data.cache_dir={tmp_path}/cache", "model.num_layers=1", "model.hidden_size=32", "model.seq_len=32",
           "train.global_batch=4", "train.micro_batch=2"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    with subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        proc.stdout.readline()                   # the start-up line, then the reader leaves
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=180)
    assert proc.returncode == 0 and err == "", err
    with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]
    assert "4" in os.listdir(tmp_path / "run" / "checkpoints")


def test_a_metrics_write_that_fails_names_its_file(tmp_path):
    """A full disk under the run directory: the fault names metrics.jsonl or tb/, and no thread
    of a TensorBoard writer is left to print after the error line."""
    import errno
    import threading
    from mtjax.training.metrics import MetricsWriter
    before = threading.active_count()
    writer = MetricsWriter(str(tmp_path), 3, progress=False)
    assert threading.active_count() == before
    writer.log(1, {"loss": 1.0})

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)
    writer._file = Full(writer._file)
    with pytest.raises(OSError) as e:
        writer.log(2, {"loss": 1.0})
    assert e.value.filename == str(tmp_path / "metrics.jsonl") and e.value.errno == errno.ENOSPC
    writer._file = writer._file.f
    writer.close()


def test_the_memory_refusal_names_the_figures(bad_runs):
    line = bad_runs["step_does_not_fit_in_memory"][1].stderr.strip()
    assert "GiB per device" in line and "temporaries" in line and "model.seq_len" in line, line


# ----------------------------------------------------------------- data that must not train

def write_corpus(prefix, high=256, docs=40, length=200, seed=0):
    """PREFIX.bin/.idx of random documents with ids in [0, high), recorded as byte-tokenized."""
    import numpy as np
    from mtjax.data.indexed import IndexedWriter, dtype_for_vocab
    from mtjax.data.tokenizer import ByteTokenizer, record
    rng = np.random.default_rng(seed)
    with IndexedWriter(str(prefix), dtype_for_vocab(max(high, 257)), record(ByteTokenizer(), False)) as writer:
        for _ in range(docs):
            writer.add_document(rng.integers(0, high, length))
    return str(prefix)


def flip_bit(path, offset):
    data = bytearray(open(path, "rb").read())
    data[offset % len(data)] ^= 0x10
    open(path, "wb").write(bytes(data))


# (id, how the corpus is made and damaged, the file the one line must name, and a phrase of it)
DATA_CASES = [
    ("ids_beyond_the_vocabulary", lambda p: write_corpus(p, high=1000), ".idx", "token ids go up to 999"),
    ("flipped_offset_in_idx", lambda p: flip_bit(write_corpus(p) + ".idx", -12), ".idx", "corrupted"),
    ("flipped_bin_crc_field_in_idx", lambda p: flip_bit(write_corpus(p) + ".idx", 32), ".idx", "corrupted"),
    ("flipped_token_in_bin", lambda p: flip_bit(write_corpus(p) + ".bin", 101), ".bin", "corrupted"),
    ("truncated_idx", lambda p: _truncate(write_corpus(p) + ".idx", 8), ".idx", ""),
]


def _truncate(path, drop):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - drop)


@pytest.mark.parametrize("name,make,culprit,phrase", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data_is_refused_before_it_trains(tmp_path, name, make, culprit, phrase):
    make(tmp_path / "corpus")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    before = snapshot(tmp_path)
    r = train_cli(["--config", TINY, f"data.path={tmp_path}/corpus", f"train.run_dir={tmp_path}/run",
                   f"data.cache_dir={tmp_path}/cache", "train.steps=2"], cwd)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path}/corpus{culprit}:"), lines
    assert phrase in lines[0], lines[0]
    assert snapshot(tmp_path) == before                   # no run directory, no sample-index cache


def test_pipeline_show_refuses_a_table_too_large_to_print(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "mtjax.pipeline", "show", "--stages", "2", "--micro-batches",
                        "1000000000"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert "--micro-batches" in r.stderr and os.listdir(tmp_path) == []


def test_a_run_directory_name_that_is_not_utf8_is_refused(tmp_path):
    env = child_env()
    r = subprocess.run([sys.executable, "-m", "mtjax.train", "--config", TINY, b"train.run_dir=" + bytes(tmp_path) + b"/\xff",
                        f"data.cache_dir={tmp_path}/cache"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: train.run_dir:") and len(r.stderr.splitlines()) == 1
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv,words", [
    (["--config", ""], "--config: must name a file"),
    (["--config", TINY, "parallel.data=64", "parallel.tensor=128"], "parallel: data*pipe*context*tensor = 8192 GPUs"),
])
def test_inspect_target_refuses_what_it_cannot_compile_for(monkeypatch, argv, words):
    """`--target` reads the config itself (its GPUs are not this machine's devices): an empty
    --config is no file, as without --target, and a layout of more GPUs than --gpus allows is one
    line, not a topology of 8192 compile-only devices. (The plugin check is patched away: these
    refusals come before any GPU is made.)"""
    from mtjax import compile_only
    from mtjax import inspect as inspect_command
    from mtjax.config import ConfigError
    monkeypatch.setattr(compile_only, "why_unavailable", lambda: None)
    monkeypatch.setattr(compile_only, "prepare_environment", lambda: None)
    monkeypatch.setattr(compile_only, "gpu_devices", lambda *a: pytest.fail("GPUs made before the refusal"))
    with pytest.raises(ConfigError) as e:
        inspect_command.main([*argv, "--target", "h100"])
    assert str(e.value).startswith(words)


@pytest.mark.parametrize("argv", [["mtjax.config"], ["mtjax.config", "train.steps"],
                                  ["mtjax.pipeline", "show", "--schedule", "1f1b", "--stages", "4",
                                   "--micro-batches", "16", "--json"]])
def test_a_reader_that_leaves_ends_a_command_without_a_line(argv):
    """`python -m mtjax.config | head`: the reader has what it wanted; no `error: Broken pipe`,
    and the status a shell gives a Unix tool that SIGPIPE ended (128 + 13)."""
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()                 # the reader leaves before the command writes
    assert proc.wait(timeout=60) == 141 and proc.stderr.read() == b""

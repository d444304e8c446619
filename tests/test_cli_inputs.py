"""Every command line's input goes through one set of rules (`mtjax.cli_checks`), and every
result is written all or nothing (`mtjax.staging`).

Each bad input must end in exit status 2 with exactly one stderr line `error: ...` naming the
flag, file or key, no traceback, and nothing written: the working directory, the output's
parent and the source are byte-for-byte as before. A fault (a full disk, a read-only file
system) is one line and status 1, with nothing left either. The commands run in-process through
`cli.report`, the function their `__main__` exits with; only the signal tests need a process
of their own.
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtjax import cli, staging
from mtjax import generate as generate_cli
from mtjax import inspect as inspect_cli
from mtjax import train as train_cli
from mtjax.commands import convert as convert_cli
from mtjax.commands import pipeline as pipeline_cli
from mtjax.commands import preprocess as preprocess_cli

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny.yaml")
HF = REPO / "tests" / "fixtures" / "hf"
MAINS = {"train": train_cli.main, "inspect": inspect_cli.main, "generate": generate_cli.main,
         "convert": convert_cli.main, "preprocess": preprocess_cli._main, "pipeline": pipeline_cli._main}


def snapshot(*roots):
    """Every path under the roots with its size, modification time and content hash."""
    def entry(path):
        st = os.lstat(path)
        data = open(path, "rb").read() if os.path.isfile(path) else b""
        return path, st.st_size, st.st_mtime_ns, hash(data)
    out = [entry(str(root)) for root in roots if os.path.isfile(root)]
    for root in map(str, roots):
        out += [entry(os.path.join(d, n)) for d, dirs, files in os.walk(root) for n in dirs + files]
    return sorted(out)


def run(command, argv, capsys):
    """(exit status, stderr lines, stdout) of `python -m mtjax.<command> ARGV`, in-process."""
    status = cli.report(MAINS[command], argv)
    captured = capsys.readouterr()
    return status, captured.err.strip().splitlines(), captured.out


def assert_one_line(status, err, expect_status, *names):
    assert status == expect_status, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "Traceback" not in err[0]
    for name in names:
        assert name in err[0], (name, err)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A from-hf run directory of the llama fixture (the source of to-hf and generate)."""
    out = tmp_path_factory.mktemp("src") / "run"
    from mtjax.commands.convert_hf import from_hf
    from_hf(str(HF / "llama_plain"), str(out))
    return out


@pytest.fixture
def place(tmp_path, monkeypatch):
    """A fresh working directory `cwd` (the current directory) with `in.jsonl`, a file `file`
    and a non-empty directory `full`; returns tmp_path."""
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "in.jsonl").write_text(json.dumps({"text": "some text"}) + "\n")
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("mine")
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


# (id, command, argv with {t} the tmp root, {run} the source run and {hf} the fixture, what the line names)
BAD = [
    # integers beyond int32, and each flag's own domain
    ("seq_len_beyond_int32", "convert", ["from-hf", "--hf-dir", "{hf}", "--out", "{t}/o", "--seq-len", "4294967296"],
     "--seq-len"),
    ("seq_len_zero", "convert", ["from-hf", "--hf-dir", "{hf}", "--out", "{t}/o", "--seq-len", "0"], "--seq-len"),
    ("top_k_beyond_int32", "generate", ["--checkpoint", "{run}", "--prompt-ids", "1", "--top-k", "5000000000"],
     "--top-k"),
    ("top_k_zero", "generate", ["--checkpoint", "{run}", "--prompt-ids", "1", "--top-k", "0"], "--top-k"),
    ("new_tokens_beyond_int32", "generate", ["--checkpoint", "{run}", "--prompt-ids", "1", "--max-new-tokens",
                                             "-2147483649"], "--max-new-tokens"),
    ("seed_beyond_int32", "generate", ["--checkpoint", "{run}", "--prompt-ids", "1", "--seed", "2147483648"], "--seed"),
    ("cpu_devices_beyond_int32_train", "train", ["--config", TINY, "--cpu-devices", "9999999999"], "--cpu-devices"),
    ("cpu_devices_beyond_int32_inspect", "inspect", ["--config", TINY, "--cpu-devices", "2147483648"],
     "--cpu-devices"),
    ("stages_beyond_int32", "pipeline", ["show", "--stages", "2147483648", "--micro-batches", "4"], "--stages"),
    ("virtual_stages_below_int32", "pipeline", ["show", "--stages", "2", "--micro-batches", "4",
                                                "--virtual-stages", "-2147483648"], "--virtual-stages"),
    ("ids_beyond_int32", "generate", ["--checkpoint", "{run}", "--prompt-ids", "1,4294967296"], "--prompt-ids"),
    # floats: finite
    ("temperature_nan", "generate", ["--checkpoint", "{run}", "--prompt-ids", "1", "--temperature", "nan"],
     "--temperature"),
    ("top_p_beyond_fp32", "generate", ["--checkpoint", "{run}", "--prompt-ids", "1", "--top-p", "1e400"], "--top-p"),
    # empty names
    ("from_hf_empty_out", "convert", ["from-hf", "--hf-dir", "{hf}", "--out", ""], "--out"),
    ("to_hf_empty_out", "convert", ["to-hf", "--checkpoint", "{run}", "--out", ""], "--out"),
    ("from_hf_blank_out", "convert", ["from-hf", "--hf-dir", "{hf}", "--out", " "], "--out"),
    ("empty_hf_dir", "convert", ["from-hf", "--hf-dir", "", "--out", "{t}/o"], "--hf-dir"),
    ("to_hf_empty_checkpoint", "convert", ["to-hf", "--checkpoint", "", "--out", "{t}/o"], "--checkpoint"),
    ("generate_empty_checkpoint", "generate", ["--checkpoint", "", "--prompt", "a"], "--checkpoint"),
    ("preprocess_empty_output", "preprocess", ["--input", "in.jsonl", "--output", ""], "output prefix is empty"),
    ("train_empty_config", "train", ["--config", ""], "--config"),
    # outputs that exist, or whose parent cannot take them
    ("from_hf_out_not_empty", "convert", ["from-hf", "--hf-dir", "{hf}", "--out", "{t}/full"], "--out"),
    ("to_hf_out_is_a_file", "convert", ["to-hf", "--checkpoint", "{run}", "--out", "{t}/file"], "--out"),
    ("from_hf_out_is_the_cwd", "convert", ["from-hf", "--hf-dir", "{hf}", "--out", "."], "--out"),
    ("to_hf_out_above_the_cwd", "convert", ["to-hf", "--checkpoint", "{run}", "--out", ".."], "--out"),
    ("from_hf_parent_missing", "convert", ["from-hf", "--hf-dir", "{hf}", "--out", "{t}/none/o"], "--out"),
    ("to_hf_parent_is_a_file", "convert", ["to-hf", "--checkpoint", "{run}", "--out", "{t}/file/o"], "--out"),
    ("preprocess_parent_is_a_file", "preprocess", ["--input", "in.jsonl", "--output", "{t}/file/o"], "{t}/file"),
    ("preprocess_output_exists", "preprocess", ["--input", "in.jsonl", "--output", "{t}/full/keep"], "--output"),
    # another run's checkpoints as this run's directory: files in a step fail its manifest (its next
    # resume moves it aside as damaged); a run directory holding steps is what mtjax.load reads as a run
    ("train_run_dir_is_checkpoints", "train", ["--config", TINY, "train.micro_batch=2",
                                               "train.run_dir={run}/checkpoints"],
     "train.run_dir: {run}/checkpoints holds checkpoint step 0: it is a run's checkpoints directory"),
    ("train_run_dir_in_a_step", "train", ["--config", TINY, "train.micro_batch=2",
                                          "train.run_dir={run}/checkpoints/0/mine"],
     "train.run_dir: {run}/checkpoints/0/mine is inside the checkpoint step {run}/checkpoints/0"),
    # a value option given twice (the second would replace the first), text that is not Unicode
    ("out_given_twice", "convert", ["to-hf", "--checkpoint", "{run}", "--out", "{t}/a", "--out", "{t}/b"],
     "--out: is given twice"),
    ("stages_given_twice", "pipeline", ["show", "--stages", "2", "--micro-batches", "4", "--stages", "4"],
     "--stages: is given twice"),
    ("cpu_devices_given_twice", "train", ["--config", TINY, "--cpu-devices", "2", "--cpu-devices=3"],
     "--cpu-devices: is given twice"),
    ("output_given_twice", "preprocess", ["--input", "in.jsonl", "--output", "{t}/a", "--output", "{t}/b"],
     "--output: is given twice"),
    ("prompt_not_unicode", "generate", ["--checkpoint", "{run}", "--prompt", "a\udcffb"], "--prompt"),
    ("out_not_unicode", "convert", ["from-hf", "--hf-dir", "{hf}", "--out", "{t}/\udcff"], "--out"),
]


@pytest.mark.parametrize("name,command,argv,names", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(place, run_dir, capsys, name, command, argv, names):
    argv = [a.format(t=place, run=run_dir, hf=HF / "llama_plain") for a in argv]
    if command == "preprocess" and argv[-2:] == ["--output", f"{place}/full/keep"]:
        (place / "full" / "keep.idx").write_text("an earlier output")
    before = snapshot(place, run_dir, HF / "llama_plain")
    status, err, out = run(command, argv, capsys)
    assert_one_line(status, err, 2, names.format(t=place, run=run_dir))
    assert out == ""
    assert snapshot(place, run_dir, HF / "llama_plain") == before


def test_the_current_directory_is_never_an_output_even_when_empty(tmp_path, run_dir, capsys, monkeypatch):
    """Renaming onto it would leave the shell in a deleted directory."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    for argv in (["from-hf", "--hf-dir", str(HF / "llama_plain"), "--out", "."],
                 ["to-hf", "--checkpoint", str(run_dir), "--out", str(tmp_path / "cwd")]):
        status, err, _ = run("convert", argv, capsys)
        assert_one_line(status, err, 2, "error: --out: ", "is the current directory")
        assert os.listdir(tmp_path) == ["cwd"] and os.listdir(tmp_path / "cwd") == []


def test_an_empty_output_directory_is_filled(tmp_path, run_dir, capsys):
    (tmp_path / "hf").mkdir()
    status, err, out = run("convert", ["to-hf", "--checkpoint", str(run_dir), "--out", str(tmp_path / "hf")], capsys)
    assert status == 0 and err == [], err
    assert sorted(os.listdir(tmp_path)) == ["hf"] and sorted(os.listdir(tmp_path / "hf")) == ["config.json",
                                                                                            "model.safetensors"]


def gpt2_with(tmp_path, **changes):
    """A copy of the GPT-2 fixture whose config.json has `changes`."""
    hf = tmp_path / "hf"
    shutil.copytree(HF / "gpt2", hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **changes}))
    return hf


@pytest.mark.parametrize("changes,key", [
    ({"n_positions": 4294967296}, "n_positions"),
    ({"n_embd": -2147483649}, "n_embd"),
    ({"n_head": 3}, "n_embd"),                      # 32 heads by 3: config.json's names, no mtjax hint
    ({"n_layer": 0}, "n_layer"),
    ({"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon"),
    ({"resid_pdrop": 1.5}, "resid_pdrop"),
    ({"vocab_size": 2.5}, "vocab_size"),
])
def test_config_json_values_go_through_the_config_rules(tmp_path, capsys, changes, key):
    hf = gpt2_with(tmp_path, **changes)
    before = snapshot(tmp_path)
    status, err, _ = run("convert", ["from-hf", "--hf-dir", str(hf), "--out", str(tmp_path / "o")], capsys)
    assert_one_line(status, err, 2, f"error: {hf}/config.json: {key}: ")
    assert "model." not in err[0] and "kv_channels" not in err[0] and "hidden_size" not in err[0], err
    assert snapshot(tmp_path) == before


def test_a_sequence_length_beyond_int32_is_refused_by_the_library_too(tmp_path):
    from mtjax.config.errors import ConfigError
    from mtjax.commands.convert_hf import from_hf
    with pytest.raises(ConfigError, match=r"--seq-len: 4294967296 is out of range"):
        from_hf(str(HF / "llama_plain"), str(tmp_path / "o"), seq_len=2 ** 32)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------- faults: one line, status 1

@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A small tmpfs at `path` (root only; skipped elsewhere, saying why)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a full or read-only disk) needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("command", ["from-hf", "to-hf", "preprocess"])
def test_a_full_disk_is_one_line_status_1_and_leaves_nothing(tmp_path, run_dir, capsys, command):
    """64 KiB hold the lock and the staging directory but not the weights (about 160 KiB)."""
    with tmpfs(tmp_path / "disk", "size=64k") as disk:
        source = {"from-hf": HF / "llama_plain", "to-hf": run_dir, "preprocess": tmp_path / "in.jsonl"}[command]
        if command == "preprocess":
            source.write_text("".join(json.dumps({"text": "x" * 1000}) + "\n" for _ in range(100)))
        argv = {"from-hf": ["from-hf", "--hf-dir", str(source), "--out", str(disk / "o")],
                "to-hf": ["to-hf", "--checkpoint", str(source), "--out", str(disk / "o")],
                "preprocess": ["--input", str(source), "--output", str(disk / "o")]}[command]
        before = snapshot(source)
        status, err, _ = run("preprocess" if command == "preprocess" else "convert", argv, capsys)
        assert_one_line(status, err, 1, str(disk / "o"))
        assert os.listdir(disk) == []
        assert snapshot(source) == before


@pytest.mark.parametrize("command", ["from-hf", "to-hf", "preprocess"])
def test_a_read_only_file_system_is_refused_before_any_work(tmp_path, run_dir, capsys, command):
    with tmpfs(tmp_path / "ro", "size=64k,ro") as ro:
        (tmp_path / "in.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
        argv = {"from-hf": ["from-hf", "--hf-dir", str(HF / "llama_plain"), "--out", str(ro / "o")],
                "to-hf": ["to-hf", "--checkpoint", str(run_dir), "--out", str(ro / "o")],
                "preprocess": ["--input", str(tmp_path / "in.jsonl"), "--output", str(ro / "o")]}[command]
        before = snapshot(tmp_path / "in.jsonl", run_dir, HF / "llama_plain")
        status, err, _ = run("preprocess" if command == "preprocess" else "convert", argv, capsys)
        assert_one_line(status, err, 2, "--out" if command != "preprocess" else "--output", "not writable")
        assert os.listdir(ro) == []
        assert snapshot(tmp_path / "in.jsonl", run_dir, HF / "llama_plain") == before


def _raised_from_os_error(path):
    try:
        raise OSError(5, "Input/output error", path)
    except OSError as e:
        raise RuntimeError("reading failed") from e


@pytest.mark.parametrize("fault,line", [
    (lambda path: OSError(5, "Input/output error", path), "model.safetensors: Input/output error"),   # numpy's
    (lambda path: ValueError(f"Error reading {path}: [OS error 5: Input/output error]"), "[OS error 5"),  # tensorstore's
    (_raised_from_os_error, "reading failed"),                                                     # a wrapped one
    # a collective's, a peer process of the job killed (jax.errors.JaxRuntimeError is a RuntimeError)
    (lambda path: RuntimeError("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
                               "Read error [127.0.0.1]:61056: Connection reset by peer"), "Gloo all-reduce failed"),
], ids=["oserror", "worded", "caused", "peer_gone"])
def test_a_fault_anywhere_in_a_command_is_one_line_status_1(tmp_path, capsys, monkeypatch, fault, line):
    """Caught where the CLI ends, whichever library raised it and however it wraps the system's error."""
    import mtjax.commands.convert_hf as commands

    def broken(hf_dir):
        error = fault(str(Path(hf_dir) / "model.safetensors"))
        if error is not None:
            raise error
    monkeypatch.setattr(commands, "read_tensors", broken)
    status, err, _ = run("convert", ["from-hf", "--hf-dir", str(HF / "llama_plain"), "--out", str(tmp_path / "o")],
                         capsys)
    assert_one_line(status, err, 1, line)
    assert os.listdir(tmp_path) == []


def test_a_bug_is_not_disguised_as_a_fault(tmp_path, monkeypatch):
    """An error that is neither bad input nor the machine's stays a traceback (a bug to report)."""
    import mtjax.commands.convert_hf as commands
    monkeypatch.setattr(commands, "read_tensors", lambda hf_dir: {}["missing"])
    with pytest.raises(KeyError):
        cli.report(MAINS["convert"], ["from-hf", "--hf-dir", str(HF / "llama_plain"), "--out", str(tmp_path / "o")])
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------- staging: all or nothing

def test_staging_commits_whole_or_leaves_nothing(tmp_path):
    target = str(tmp_path / "out")
    with pytest.raises(RuntimeError):
        with staging.staged(target, "--out") as tmp:
            Path(tmp, "half").write_text("written")
            raise RuntimeError("a failure halfway")
    assert os.listdir(tmp_path) == []
    (tmp_path / "out").mkdir()                   # an empty directory is filled
    with staging.staged(target, "--out") as tmp:
        Path(tmp, "whole").write_text("written")
    assert os.listdir(tmp_path) == ["out"] and os.listdir(target) == ["whole"]


# A from-hf that stops for good once its checkpoint is written, still inside the staging directory.
SLOW_FROM_HF = """
import sys, time
import mtjax.convert.checkpoints as checkpoints
from mtjax import cli
from mtjax.commands import convert
save = checkpoints.save_params
def save_then_wait(*args, **kwargs):
    save(*args, **kwargs)
    print("saved", flush=True)
    time.sleep(600)
checkpoints.save_params = save_then_wait
cli.run(convert.main, sys.argv[1:])
"""


def start_from_hf(out: Path, slow: bool):
    from test_cli import child_env
    env = child_env()
    env.update(PYTHONPATH=str(REPO))
    args = ["from-hf", "--hf-dir", str(HF / "llama_plain"), "--out", str(out)]
    program = ["-c", SLOW_FROM_HF] if slow else ["-m", "mtjax.convert"]
    return subprocess.Popen([sys.executable, *program, *args], env=env, cwd=out.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_sigterm_while_writing_leaves_nothing(tmp_path):
    proc = start_from_hf(tmp_path / "out", slow=True)
    assert proc.stdout.readline() == "saved\n", proc.stderr.read()
    assert [n for n in os.listdir(tmp_path) if n.endswith(staging.LOCK)]      # mid-write: staged, locked
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and err.splitlines() == ["error: interrupted by SIGTERM"], err
    assert os.listdir(tmp_path) == []


def test_sigterm_as_the_staging_appears_leaves_all_or_nothing(tmp_path):
    """The signal lands while orbax writes (or just after): the output is complete, or nothing is
    there, a moment later too (no writer recreates the staging directory after its removal)."""
    proc = start_from_hf(tmp_path / "out", slow=False)
    deadline = time.monotonic() + 60
    while not any(staging.MARK in n for n in os.listdir(tmp_path)) and proc.poll() is None:
        assert time.monotonic() < deadline
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    time.sleep(0.5)
    if proc.returncode == 0:
        assert os.listdir(tmp_path) == ["out"]
        assert sorted(os.listdir(tmp_path / "out")) == ["checkpoints", "config.yaml"]
    else:
        assert proc.returncode == 128 + signal.SIGTERM and len(err.splitlines()) == 1, err
        assert os.listdir(tmp_path) == []


def test_kill_9_leaves_a_staging_the_next_run_removes_and_a_live_one_is_kept(tmp_path, capsys):
    proc = start_from_hf(tmp_path / "out", slow=True)
    try:
        assert proc.stdout.readline() == "saved\n", proc.stderr.read()
        left = sorted(os.listdir(tmp_path))
        assert len(left) == 2 and left[1] == left[0] + staging.LOCK
        assert staging.sweep(str(tmp_path / "out")) == [] and sorted(os.listdir(tmp_path)) == left   # alive: kept
    finally:
        proc.kill()
        proc.communicate()
    assert sorted(os.listdir(tmp_path)) == left                                  # killed: nothing cleaned up
    status, err, _ = run("convert", ["from-hf", "--hf-dir", str(HF / "llama_plain"), "--out", str(tmp_path / "out")],
                         capsys)
    assert status == 0 and err == [], err
    assert os.listdir(tmp_path) == ["out"]


def test_preprocess_names_the_flag_given_not_the_default(tmp_path, capsys):
    """A tokenizer.json with no end-of-document token: the line names --tokenizer, which was given,
    not --eod-token, which was not; with --eod-token given, it names that."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    before = snapshot(tmp_path)
    base = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o"), "--tokenizer",
            str(tmp_path / "tok.json")]
    status, err, _ = run("preprocess", base, capsys)
    assert_one_line(status, err, 2, "error: --tokenizer: ", "no end-of-document token")
    status, err, _ = run("preprocess", [*base, "--eod-token", "<eot>"], capsys)
    assert_one_line(status, err, 2, "error: --eod-token: ", "<eot>")
    assert snapshot(tmp_path) == before


def test_preprocess_killed_outright_then_rerun_leaves_only_the_output(tmp_path, capsys):
    """kill -9 while preprocess writes (its input a pipe that stays open): the temporary files
    stay behind; the next run into the same place removes them and writes the output."""
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-m", "mtjax.data.preprocess", "--input", str(fifo), "--output",
                             str(tmp_path / "o")], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    deadline, fd = time.monotonic() + 60, None
    try:
        while fd is None:                        # opens once preprocess reads it: its temporaries exist by then
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            with contextlib.suppress(OSError):
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            time.sleep(0.01)
        os.write(fd, json.dumps({"text": "one document"}).encode() + b"\n")
        while not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.communicate()
        if fd is not None:
            os.close(fd)
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]              # left by the killed writer
    os.remove(fifo)
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "another document"}) + "\n")
    status, err, out = run("preprocess", ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o")],
                           capsys)
    assert status == 0 and err == [], err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "o.bin", "o.idx"]


@pytest.mark.parametrize("command", ["from-hf", "preprocess"])
def test_a_disk_already_full_is_a_fault_found_before_any_work(tmp_path, capsys, command):
    """No room for one more entry (its inodes used up): one line, status 1, the disk as it was."""
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with tmpfs(tmp_path / "disk", "size=64k,nr_inodes=3") as disk:
        for name in ("a", "b"):
            with contextlib.suppress(OSError):
                (disk / name).write_text("fill")
        before = snapshot(disk)
        argv = {"from-hf": ["from-hf", "--hf-dir", str(HF / "llama_plain"), "--out", str(disk / "o")],
                "preprocess": ["--input", str(tmp_path / "in.jsonl"), "--output", str(disk / "o")]}[command]
        status, err, _ = run("convert" if command == "from-hf" else "preprocess", argv, capsys)
        assert_one_line(status, err, 1, str(disk), "No space left on device")
        assert snapshot(disk) == before


def test_the_stderr_filter_drops_only_orbax_closed_loop_echoes():
    """`orbax_noise.EchoFilter`: a closed-loop traceback of asyncio's frames goes; any other
    traceback (one with our frames, or another error), and plain lines, pass whole and in order."""
    import io
    from mtjax.orbax_noise import EchoFilter
    loop = "/usr/lib/python3.11/asyncio/base_events.py"
    echo = (f'Traceback (most recent call last):\n  File "{loop}", line 806, in call_soon_threadsafe\n'
            f'    self._check_closed()\n  File "{loop}", line 519, in _check_closed\n'
            "    raise RuntimeError('Event loop is closed')\nRuntimeError: Event loop is closed\n")
    ours = echo.replace(loop, "/work/mtjax/train.py", 1)
    other = echo.replace("RuntimeError: Event loop is closed", "ValueError: bad")
    out = io.StringIO()
    stream = EchoFilter(out)
    for text in ("first line\n", echo, ours, "part", "ial\n", echo[:40], echo[40:], other, "Trace", "error"):
        stream.write(text)
    stream.flush()
    assert out.getvalue() == "first line\n" + ours + "partial\n" + other + "Traceerror"


def test_an_abandoned_writes_never_awaited_coroutines_are_not_echoed_at_exit():
    """Orbax's write coroutines left unstarted by a failed save are collected at exit with
    "RuntimeWarning: coroutine ... was never awaited" (two more lines after the error's one, seen
    in a fresh-clone run): the entry points drop that warning, and only it."""
    code = ("import warnings\nfrom mtjax.orbax_noise import quiet_orbax_echoes\nquiet_orbax_echoes()\n"
            "async def write_fragment():\n    pass\n"
            "pending = write_fragment()\ndel pending\nwarnings.warn('kept', RuntimeWarning)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and "never awaited" not in r.stderr and "RuntimeWarning: kept" in r.stderr, r.stderr


def test_orbax_coroutines_collected_with_an_error_are_not_echoed():
    """After a failed read of a damaged array, orbax's read coroutines of the other arrays are
    collected with the same error ("Exception ignored in: <coroutine object
    _read_array_index_and_device_put ...>", a traceback each: hundreds of lines after the error's
    one). The entry points drop those, and only orbax's: another coroutine's is reported."""
    source = ("import types\n@types.coroutine\ndef pause():\n    yield\n"
              "async def read(text):\n    try:\n        await pause()\n    finally:\n        raise Exception(text)\n")
    code = ("from mtjax.orbax_noise import quiet_orbax_echoes\nquiet_orbax_echoes()\n"
            f"for where, text in (('/site-packages/orbax/checkpoint/serialization.py', 'dropped'), ('/work/x.py', 'kept')):\n"
            f"    ns = {{}}\n    exec(compile({source!r}, where, 'exec'), ns)\n"
            "    c = ns['read'](text)\n    c.send(None)\n    del c           # collected suspended: its close raises\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and "dropped" not in r.stderr and "Exception: kept" in r.stderr, r.stderr

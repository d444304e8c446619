"""`mtjax.train(...)` makes the command's run, and what a run prints.

One tiny run of `python -m mtjax.train` (its `main`, in-process) and one of `mtjax.train(...)`
with the same config: the same metrics.jsonl up to the timing fields, the same lines printed.
The command's output holds the start-up line with the whole layout, log lines without the
fields that do not apply, and the summary line; every sample line in README.md has the same
fields in the same format as a line of that output (numbers, paths and times masked).
"""
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
import types

import pytest

import mtjax
from mtjax import cli
from mtjax import train as train_command
from mtjax.config import ConfigError
from mtjax.training.metrics import MetricsWriter, format_row, layout, not_applicable, summary_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
# 8 devices (conftest): d = 8, b = m = 1; validation at the last step
SMALL = ["train.steps=3", "train.log_interval=1", "train.eval_interval=3", "train.eval_batches=1",
         "model.num_layers=1", "model.hidden_size=32", "model.seq_len=32", "train.global_batch=8",
         "train.micro_batch=1", "train.progress=false"]
TIMING = {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu"}


HOUR = 3600.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(tmp, the command's stdout, mtjax.train's RunResult, its stdout, (initialisations, how
    many had run as each MetricsWriter was made)). In the second run `mtjax.run`'s clock jumps an
    hour at each parameter initialisation, which is no part of the training loop's time its
    summary line gives."""
    from mtjax import run
    from mtjax.training.trainer import Trainer
    tmp = tmp_path_factory.mktemp("runs")
    common = [*SMALL, f"data.cache_dir={tmp / 'cache'}"]
    command, api = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(command):
        status = cli.report(train_command.main, ["--config", TINY, *common, f"train.run_dir={tmp / 'cli'}"])
    assert status == 0
    jumps, init_state, writer_made, make_writer = [], Trainer.init_state, [], MetricsWriter.__init__

    def initialised(self, *args, **kwargs):
        jumps.append(HOUR)
        return init_state(self, *args, **kwargs)

    def writer(self, *args, **kwargs):      # (a progress bar's clock starts with its writer)
        writer_made.append(len(jumps))
        make_writer(self, *args, **kwargs)
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + sum(jumps))
    with contextlib.redirect_stdout(api), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "init_state", initialised)
        patch.setattr(MetricsWriter, "__init__", writer)
        patch.setattr(run, "time", clock)
        result = mtjax.train(TINY, overrides=[*common, f"train.run_dir={tmp / 'api'}"])
    assert jumps, "the fresh run initialised no parameters"
    return tmp, command.getvalue(), result, api.getvalue(), (len(jumps), writer_made)


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING}


def masked(line: str) -> str:
    """The line's fields and format: times, paths (anything with a '/') and numbers masked."""
    line = re.sub(r"\d+ h \d+ min|\d+ min \d+ s|\d+(\.\d+)? s\b", "TIME", line)
    line = re.sub(r"[^\s;,]*/[^\s;,]*", "PATH", line)
    line = re.sub(r"\bdevices?\b", "devices", line)
    line = re.sub(r"\blayers?\b", "layers", line)
    line = re.sub(r"\b[KMG]iB\b", "UNIT", line)
    return re.sub(r"-?\d+(,\d{3})*(\.\d+)?(e[+-]?\d+)?", "N", line)     # 409,600 is one number


def test_the_api_makes_the_commands_run(runs):
    tmp, command_out, result, api_out, _ = runs
    command, api = rows(tmp / "cli"), rows(tmp / "api")
    assert [r["step"] for r in api] == [1, 2, 3] and "val_loss" in api[-1]
    assert [untimed(r) for r in api] == [untimed(r) for r in command]
    assert untimed(result.metrics) == untimed(api[-1]) and result.rows[-1] == result.metrics
    assert (result.run_dir, result.step, result.stopped_by) == (str(tmp / "api"), 3, None)
    assert result.checkpoint_dir == str(tmp / "api" / "checkpoints") and "3" in os.listdir(result.checkpoint_dir)
    configs = [json.load(open(tmp / name / "config.json")) for name in ("cli", "api")]
    assert [c.pop("train").pop("run_dir") for c in configs] == [str(tmp / "cli"), str(tmp / "api")]
    assert configs[0] == configs[1]
    assert [masked(x) for x in api_out.splitlines()] == [masked(x) for x in command_out.splitlines()]


def test_the_output_says_what_the_run_is(runs):
    """The start-up line names the whole layout, the data and the run directory; the log lines
    leave out the fields that do not apply (fp32: no loss scale, no skipped steps; CPU: no MFU),
    which metrics.jsonl still holds; the last line is the summary."""
    tmp, out, _, _, _ = runs
    lines = out.splitlines()
    start = lines[0]
    for field in ("mesh (data, pipe, tensor) = (8, 1, 1) on 8 cpu devices", "sequence parallel off",
                  "schedule none (pipe 1)", "batch b x m x d = 1 x 1 x 8 = 8 sequences of 32 tokens",
                  "precision fp32", "ZeRO-1 off", "recompute none", "attention xla", "vocab 257 (padded 384)",
                  # l = 1, h = 32, V 384 tied, s 32: embedding 384*32 + positions 32*32 + the layer's 4h^2 + 8h^2
                  # weights and 13h biases and norms + the final norm's 2h
                  f"model gpt: 1 layer, hidden 32, 4 heads, {384 * 32 + 32 * 32 + 12 * 32 * 32 + 13 * 32 + 2 * 32:,} "
                  "parameters", "; memory per device ", " (XLA's estimate of the step); training to step 3; ",
                  f"data {tmp / 'cache'}/", f"run dir {tmp / 'cli'}"):
        assert field in start, (field, start)
    logged = [line for line in lines if line.startswith("step ")]
    assert len(logged) == 3 and "val_loss" in logged[-1]
    assert [line.split(" | ")[0] for line in logged] == ["step 1/3", "step 2/3", "step 3/3"]     # N/train.steps
    assert all(line.split(" | ")[1:4] == [f"{k} {rows(tmp / 'cli')[i][k]:.4g}" for k in ("loss", "lr", "grad_norm")]
               for i, line in enumerate(logged)), logged      # what a reader looks for first, first
    assert not any(k in line for line in logged for k in ("loss_scale", "skipped_steps", "mfu", "None"))
    assert {"loss_scale", "skipped_steps", "mfu"} <= set(rows(tmp / "cli")[-1])
    last = rows(tmp / "cli")[-1]
    assert type(last["skipped_steps"]) is int and type(last["loss"]) is float     # a counter stays a count
    assert lines[-1] == (f"done after step 3; checkpoint saved in {tmp / 'cli' / 'checkpoints'}; 3 steps "
                         f"(768 tokens) in {lines[-1].split(' in ')[-1].split(';')[0]}; "
                         f"loss {last['loss']:.4g}, val_loss {last['val_loss']:.4g}")
    assert len(lines) == 5


def test_the_summary_time_is_the_training_loops(runs):
    """The summary's time runs from the first step to the last save: a fresh run's parameter
    initialisation (its compile: seconds) is done before the clock starts, as a resumed run's
    restore is, so steps / time is the loop's pace (it used to count the initialisation); so is
    the writer made after it, whose progress bar times the run as well."""
    summary = runs[3].splitlines()[-1]
    took = summary.split(" tokens) in ")[1].split(";")[0]
    assert re.fullmatch(r"\d+\.\d s|\d+ min \d+ s", took), summary
    initialised, writers = runs[4]
    assert writers == [initialised], "the progress bar's clock started before the initialisation"


def readme_sample_lines() -> list[str]:
    """Lines of README.md's code blocks that show what a run prints."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    kinds = ("mesh (data, pipe, tensor) = ", "done after step ", "stopped by ")
    return [line for block in blocks for line in block.splitlines()
            if line.startswith(kinds) or re.match(r"step \d+/\d+ \| ", line)]


def test_the_readme_shows_what_a_run_prints(runs):
    samples = readme_sample_lines()
    assert any(s.startswith("mesh") for s in samples) and any(s.startswith("done") for s in samples)
    assert any(s.startswith("step") for s in samples)
    real = {masked(line) for line in runs[1].splitlines()}
    for sample in samples:
        assert masked(sample) in real, f"README.md's sample line does not match a real run's:\n{sample}\n{real}"


def test_mtjax_train_is_the_command_module_whichever_import_comes_first():
    code = ("import sys, mtjax; f = mtjax.train; import mtjax.train as m; from mtjax import train as g; "
            "assert f is m is g and callable(m) and m.main; assert 'jax' not in sys.modules; "
            "import inspect; print(inspect.signature(m))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0 and done.stdout.strip() == "(config, overrides=())", done.stderr
    assert mtjax.train is train_command


def test_bad_input_raises_what_the_command_prints(tmp_path):
    """The command's one line is the exception's text; nothing is written."""
    with pytest.raises(ConfigError, match="train.setps"):
        mtjax.train(TINY, [f"train.run_dir={tmp_path}/r", "train.setps=3"])
    with pytest.raises(TypeError, match="list of"):
        mtjax.train(TINY, "train.steps=3")
    assert os.listdir(tmp_path) == []


def test_a_config_file_is_named_as_the_argument(tmp_path):
    """From Python the file is the `config` argument: no `--config` flag was given."""
    (tmp_path / "twice.yaml").write_text("train:\n  steps: 1\n  steps: 2\n", encoding="utf-8")
    for path, problem in ((tmp_path / "none.yaml", "file not found"), (tmp_path / "twice.yaml", "twice")):
        with pytest.raises(ConfigError) as e:
            mtjax.train(path)
        assert str(e.value).startswith("config: ") and problem in str(e.value), e.value


def _config(**groups):
    import dataclasses

    from mtjax.config import Config
    cfg = Config()
    return cfg.replace(**{g: dataclasses.replace(getattr(cfg, g), **fields) for g, fields in groups.items()})


@pytest.mark.parametrize("config,overrides,error,words", [
    ("", (), ConfigError, "config: must name a file"),
    (lambda: _config(train={"steps": "10"}), (), ConfigError, "train.steps: expected int, got str"),
    (lambda: _config(train={"steps": 2.5}), (), ConfigError, "train.steps: expected int, got float"),
    (lambda: _config(train={"steps": 10 ** 30}), (), ConfigError, "train.steps: 1000000000000000000000000000000 is"),
    (lambda: _config(optim={"lr": float("inf")}), (), ConfigError, "optim.lr: must be a finite number"),
    # ("yes" is YAML 1.1's true, taken by a bool field as in a file)
    (lambda: _config(model={"tie_embeddings": "maybe"}), (), ConfigError, "model.tie_embeddings: expected bool"),
    (lambda: _config(train={"run_dir": None}), (), ConfigError, "train.run_dir: expected str"),
    (TINY, [5], TypeError, "overrides[0] is the int 5"),
    # a command's flag is named as one: '--config' once read 'config: override key must be group.field'
    (TINY, ["--config=other.yaml"], ConfigError, "--config: is a command's flag, not a group.field=value override"),
    (TINY, ["--cpu-devices=8"], ConfigError, "--cpu-devices: is a command's flag, not a group.field=value"),
    (TINY.replace("tiny", "none"), ["train.steps=x=y", "--config=a"], ConfigError, "--config: is a command's flag"),
    (TINY, {"train.steps": 3}, TypeError, "list of 'group.field=value' strings, got the dict"),
    (TINY, 5, TypeError, "list of 'group.field=value' strings, got the int"),
])
def test_bad_arguments_raise_one_clear_error(tmp_path, monkeypatch, config, overrides, error, words):
    """A Config built in Python has its fields' types checked as a file's are (ConfigError naming
    the field, not a TypeError from deep in validation); an empty path is no file; overrides that
    are not strings are named. Nothing is written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as e:
        mtjax.train(config() if callable(config) else config, overrides)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(tmp_path) == []


def test_a_resume_on_another_model_or_other_data_is_refused_before_the_trainer_is_built(runs, monkeypatch):
    """The newest checkpoint's model, data and train.seed are checked first: refused in seconds, not after
    the step's compile (no Trainer is built), and nothing in the run directory changes."""
    from mtjax.training import trainer
    tmp = runs[0]

    def built(*args, **kwargs):
        raise AssertionError("a Trainer was built before the refusal")
    monkeypatch.setattr(trainer.Trainer, "__init__", built)
    before = sorted(os.walk(tmp / "api"))
    common = [*SMALL, f"data.cache_dir={tmp / 'cache'}", f"train.run_dir={tmp / 'api'}", "train.steps=5"]
    with pytest.raises(ConfigError, match=r"^data.seed: checkpoint step 3 was trained on other data"):
        mtjax.train(TINY, [*common, "data.seed=7"])
    with pytest.raises(Exception, match=r"checkpoint step 3 was saved with model.hidden_size=32, the config says 64"):
        mtjax.train(TINY, [*common, "model.hidden_size=64"])
    # the checkpoint's RNG key is restored (as Megatron restores its RNG state): another seed would do nothing
    with pytest.raises(ConfigError, match=r"^train.seed: checkpoint step 3 was saved with train.seed=0, this run has"):
        mtjax.train(TINY, [*common, "train.seed=5"])
    assert sorted(os.walk(tmp / "api")) == before


def test_a_run_with_nothing_to_train_says_so_before_compiling(runs, monkeypatch, capsys):
    """Run again as it was, a finished run answers at once: no Trainer is built (no compile), the
    result is its last step's, and what it prints is that one line."""
    import shutil

    from mtjax.training import trainer
    tmp = runs[0]
    shutil.copytree(tmp / "api", tmp / "again")

    def built(*args, **kwargs):
        raise AssertionError("a Trainer was built for a run with nothing to do")
    monkeypatch.setattr(trainer.Trainer, "__init__", built)
    capsys.readouterr()
    result = mtjax.train(TINY, [*SMALL, f"data.cache_dir={tmp / 'cache'}", f"train.run_dir={tmp / 'again'}"])
    assert (result.step, result.metrics) == (3, rows(tmp / "api")[-1])
    assert capsys.readouterr().out == ("nothing to do: the checkpoint at step 3 has reached train.steps=3 "
                                       "(a larger train.steps trains on from it)\n")


def test_a_config_with_overrides():
    from mtjax.config import load_config
    from mtjax.run import resolve_config
    cfg = load_config(TINY, ["data.path=[{weight: 1, path: a}, {weight: 3, path: b}]"])
    assert resolve_config(cfg) is cfg
    assert resolve_config(cfg, ["train.steps=3"]) == load_config(TINY, ["data.path=[{weight: 1, path: a}, "
                                                                        "{weight: 3, path: b}]", "train.steps=3"])


def test_the_layout_names_each_choice():
    """A pipelined, tensor-parallel layout (no compile): SP, the schedule with v and its cap,
    b x m x d, precision, ZeRO-1, recomputation; and the tensor-parallel overlaps when asked for."""
    from layouts import build, tiny_config
    cfg = tiny_config(tensor=2, pipe=2, data=2, sp=True, micro_batch=1, extra=[
        "parallel.schedule=zb", "parallel.max_in_flight=2", "train.precision=bf16",
        "parallel.distributed_optimizer=true", "train.recompute=selective"])
    fields = layout(build(cfg, 2, 2, 2).plan, cfg, "8 cpu devices")
    assert fields == ["mesh (data, pipe, tensor) = (2, 2, 2) on 8 cpu devices", "sequence parallel on",
                      "schedule zb (v 1, cap 2)", "batch b x m x d = 1 x 4 x 2 = 8 sequences of 16 tokens",
                      "precision bf16", "ZeRO-1 on", "recompute selective", "attention xla"]
    cfg = tiny_config(tensor=2, sp=True, micro_batch=1, extra=[
        "parallel.half_batch_overlap=true", "parallel.half_batch_axis=sequence", "parallel.tensor_overlap=true"])
    fields = layout(build(cfg, 1, 1, 2).plan, cfg, "2 cpu devices")
    assert fields[1:4] == ["sequence parallel on", "tensor overlap on",
                           "half-batch overlap over the sequence (half_batch_group 4)"], fields


def test_fields_that_do_not_apply_are_left_out_of_the_line_only():
    row = {"step": 4, "loss": 2.0, "loss_scale": 1.0, "skipped_steps": 0.0, "mfu": None}
    assert format_row(row, not_applicable("fp32", "stop")) == "step 4 | loss 2"
    assert format_row(row, not_applicable("fp32", "skip")) == "step 4 | loss 2 | skipped_steps 0"
    assert format_row(row, not_applicable("fp16", "stop")) == "step 4 | loss 2 | loss_scale 1 | skipped_steps 0"
    moe = {"step": 4, "moe_aux_loss": 0.5, "moe_z_loss": 0.0, "moe_dropped": 0.0}
    assert format_row(moe, not_applicable("fp32", "stop")) == "step 4 | moe_dropped 0"
    assert format_row(moe, not_applicable("fp32", "stop", 0.01, 0.0)) == "step 4 | moe_aux_loss 0.5 | moe_dropped 0"
    assert format_row(moe, not_applicable("fp32", "stop", 0.0, 1e-3)) == "step 4 | moe_z_loss 0 | moe_dropped 0"
    line = summary_line([{"step": 7, "loss": 3.0}], 4, 7, 100, 75.0, "SIGTERM", None)
    assert line == "stopped by SIGTERM after step 7; no checkpoint (checkpoint.enabled=false); 3 steps (300 tokens) in 1 min 15 s; loss 3"


def test_the_bar_keeps_the_last_val_loss(tmp_path):
    class Bar:
        def set_postfix(self, fields):
            self.fields = dict(fields)

        def close(self):
            pass
    writer = MetricsWriter(str(tmp_path), 3, progress=False)
    writer._bar = bar = Bar()
    writer.log(1, {"loss": 3.0, "val_loss": 3.5, "lr": 0.1})
    writer.log(2, {"loss": 2.5, "lr": 0.1, "loss_scale": 1.0, "tokens_per_s": 17940.4})
    writer.close()
    assert bar.fields == {"loss": "2.5", "lr": "0.1", "val_loss": "3.5", "tokens_per_s": "17940"}


def test_a_run_started_from_another_thread_trains(runs):
    """Signal handlers can be installed from the main thread only: a run in a worker thread (a
    notebook's background job, a server) trains without a stop request instead of failing."""
    import threading
    tmp, out = runs[0], {}

    def work():     # (b given as train.micro_batches: the run directory's config.json records b = 1)
        try:
            small = [o for o in SMALL if not o.startswith("train.micro_batch=")]
            out["result"] = mtjax.train(TINY, [*small, "train.micro_batches=1", "train.steps=1",
                                               f"data.cache_dir={tmp / 'cache'}", f"train.run_dir={tmp / 'thread'}"])
        except BaseException as e:       # (re-raised below, in the test's thread)
            out["error"] = e
    worker = threading.Thread(target=work)
    worker.start()
    worker.join(timeout=300)
    if "error" in out:
        raise out["error"]
    assert out["result"].step == 1 and out["result"].stopped_by is None
    written = json.load(open(tmp / "thread" / "config.json"))["train"]
    assert (written["micro_batch"], written["micro_batches"]) == (1, 1)     # (the file's 4 went unused)


def test_a_time_limit_stops_the_run_as_a_signal_would(runs):
    """train.exit_duration_min: past it, the step running is the run's last, logged and saved, and
    the run says so; a limit that is not a finite count of minutes >= 0 is refused naming it."""
    tmp = runs[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = mtjax.train(TINY, [*SMALL, "train.log_interval=5", "train.exit_duration_min=1e-9",
                                    f"data.cache_dir={tmp / 'cache'}", f"train.run_dir={tmp / 'limit'}"])
    assert result.step == 1 and result.stopped_by == "time limit"
    assert [r["step"] for r in rows(tmp / "limit")] == [1] and "loss" in result.metrics   # logged as a last step
    assert os.path.isdir(os.path.join(result.checkpoint_dir, "1"))
    assert "stopped by time limit after step 1; checkpoint saved in" in out.getvalue()
    for value in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match=r"^train.exit_duration_min: must be a finite number"):
            mtjax.train(TINY, [*SMALL, f"train.exit_duration_min={value}", f"train.run_dir={tmp / 'bad'}"])
    assert not os.path.exists(tmp / "bad")


def test_a_profile_traces_the_chosen_steps(runs):
    """train.profile: JAX's profiler traces steps [start, end) into <run_dir>/profile, each step
    annotated with its number; the window's bounds are checked against each other and train.steps."""
    import gzip
    tmp = runs[0]
    with contextlib.redirect_stdout(io.StringIO()):
        mtjax.train(TINY, [*SMALL, "train.profile=true", "train.profile_step_start=2", "train.profile_step_end=3",
                           f"data.cache_dir={tmp / 'cache'}", f"train.run_dir={tmp / 'profiled'}"])
    found = {name: os.path.join(d, name) for d, _, names in os.walk(tmp / "profiled" / "profile") for name in names}
    assert any(name.endswith(".xplane.pb") for name in found), found
    trace = next(path for name, path in found.items() if name.endswith(".trace.json.gz"))
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = {e.get("args", {}).get("step_num") for e in events if e.get("name") == "train"}
    assert steps == {"2"}, steps
    for bad, words in [(["train.profile_step_start=3"], "needs train.profile=true"),
                       (["train.profile=true", "train.profile_step_start=4"], "past train.steps = 3"),
                       (["train.profile=true", "train.profile_step_end=2", "train.profile_step_start=2"], "must be >")]:
        with pytest.raises(ConfigError, match=words):
            mtjax.train(TINY, [*SMALL, *bad, f"train.run_dir={tmp / 'bad'}"])

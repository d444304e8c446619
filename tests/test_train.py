"""End-to-end training on the embedded corpus: the loss falls; one seed gives bitwise-equal runs."""
import json
import os

import jax
import numpy as np
import pytest

from mtjax.config import load_config, validate
from mtjax.mesh import make_mesh
from mtjax.training.data_setup import build_datasets
from mtjax.training.loop import train
from mtjax.training.metrics import MetricsWriter
from mtjax.training.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def run(tmp, cache, overrides, devices=1):
    cfg = load_config(TINY, [f"data.cache_dir={cache}", f"train.run_dir={tmp}", "train.progress=false",
                             *overrides])
    d, p, t = validate(cfg, devices)
    data = build_datasets(cfg)
    trainer = Trainer(cfg, make_mesh(d, p, t, jax.devices()[:devices]), data.vocab)
    writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, progress=False)
    try:
        rows = train(cfg, trainer, data, writer).rows
    finally:
        writer.close()
    return rows


def test_tiny_config_loss_falls_within_50_steps(tmp_path, cache_dir):
    """`python -m mtjax.train` on configs/tiny.yaml, in a subprocess: without the suite's XLA flags
    (LLVM at -O0 halves compile-bound tests' compile time but doubles this run's steps). 50 steps
    (the mean of the last 10 losses is about 2.3 below the first; 100 steps took 14 s more CPU)."""
    from test_cli import train_cli
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = train_cli(["--config", TINY, f"data.cache_dir={cache_dir}", f"train.run_dir={tmp_path}",
                   "train.progress=false", "checkpoint.enabled=false", "train.steps=50", "train.log_interval=1",
                   "train.eval_interval=50"], tmp_path, timeout=600,
                  env={**env, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 50
    first, last = losses[0], float(np.mean(losses[-10:]))
    assert abs(first - np.log(257)) < 0.3          # starts near uniform over the byte vocabulary
    assert last < first - 1.5, (first, last)       # and clearly learns
    assert rows[-1]["val_loss"] < first - 1.0
    assert [r["step"] for r in rows] == list(range(1, 51))
    assert all("loss" in r for r in rows)
    assert os.listdir(tmp_path / "tb")


def test_two_runs_with_one_seed_are_bitwise_equal(tmp_path, cache_dir):
    """With dropout on, on a data x tensor mesh with sequence parallelism."""
    overrides = ["train.steps=4", "train.log_interval=1", "train.eval_interval=0", "model.dropout=0.1",
                 "model.attention_dropout=0.1", "model.num_layers=1", "model.hidden_size=32",
                 "model.seq_len=32", "parallel.tensor=2", "parallel.sequence_parallel=true",
                 "train.global_batch=8", "train.micro_batch=2"]
    a = run(tmp_path / "a", cache_dir, overrides, devices=4)
    b = run(tmp_path / "b", cache_dir, overrides, devices=4)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    c = run(tmp_path / "c", cache_dir, overrides + ["train.seed=1"], devices=4)
    assert [r["loss"] for r in a] != [r["loss"] for r in c]


def read_events(path):
    """Events of one TensorBoard file (TFRecord: length u64, its CRC u32, data, the data's CRC u32)."""
    import struct

    from tensorboardX.proto import event_pb2
    events, raw = [], open(path, "rb").read()
    while raw:
        (n,) = struct.unpack("<Q", raw[:8])
        event = event_pb2.Event()
        event.ParseFromString(raw[12:12 + n])
        events.append(event)
        raw = raw[12 + n + 4:]
    return events


def test_a_resumed_writer_hides_the_redone_steps(tmp_path):
    """Resuming from step 2 after steps 1-4 were logged: metrics.jsonl keeps rows 1-2 and gets 3-4
    once more; the new TensorBoard file starts with TensorBoard's purge marker (a session START at
    step 3), which hides the first file's events from step 3 on. (Both writers open within the
    same second, which names tensorboardX's files: the second must not erase the first.)"""
    first = MetricsWriter(str(tmp_path), 4, progress=False)
    for step in range(1, 5):
        first.log(step, {"loss": float(step)})
    first.close()
    second = MetricsWriter(str(tmp_path), 4, progress=False, resume_step=2)
    for step in (3, 4):
        second.log(step, {"loss": 10.0 + step})
    second.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    files = sorted(os.listdir(tmp_path / "tb"))
    assert len(files) == 2
    starts = [(e.step, e.session_log.status) for e in read_events(tmp_path / "tb" / files[1])
              if e.HasField("session_log")]
    from tensorboardX.proto.event_pb2 import SessionLog
    assert starts == [(3, SessionLog.START)]


def test_a_run_with_nothing_to_do_drops_the_rows_past_its_checkpoint(tmp_path):
    """Resumed at step 2 with train.steps=2 after a crash had logged steps 3-4: as a resume that
    trains, it keeps rows 1-2 of metrics.jsonl (the result's metrics: step 2's) and hides step 3
    on in TensorBoard; a second such run adds no TensorBoard file. (No trainer: nothing is run.)"""
    import types

    from mtjax.run import train_from
    first = MetricsWriter(str(tmp_path), 4, progress=False)
    for step in range(1, 5):
        first.log(step, {"loss": float(step)})
    first.close()
    cfg = load_config(None, [f"train.run_dir={tmp_path}", "train.steps=2", "train.progress=false"])
    for _ in range(2):
        result = train_from(cfg, None, None, None, types.SimpleNamespace(step=2), True, str(tmp_path / "checkpoints"),
                            lambda *a, **k: None)
    assert result.step == 2 and result.metrics == {"step": 2, "loss": 2.0}
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0)]
    files = sorted(os.listdir(tmp_path / "tb"))
    assert len(files) == 2
    from tensorboardX.proto.event_pb2 import SessionLog
    assert [(e.step, e.session_log.status) for e in read_events(tmp_path / "tb" / files[1])
            if e.HasField("session_log")] == [(3, SessionLog.START)]


def test_a_resumed_runs_progress_bar_starts_at_its_step(tmp_path, monkeypatch):
    """A run resumed at step 2 of 4 advances its bar twice: it must start at 2 to end full (4/4)."""
    import io
    import sys
    terminal = io.StringIO()
    terminal.isatty = lambda: True
    monkeypatch.setattr(sys, "stderr", terminal)
    MetricsWriter(str(tmp_path), 4, progress=False).close()
    writer = MetricsWriter(str(tmp_path), 4, progress=True, resume_step=2)
    try:
        writer.advance()
        writer.advance()
        assert (writer._bar.n, writer._bar.total) == (4, 4)
    finally:
        writer.close()


def test_non_finite_values_reach_tensorboard(tmp_path):
    """metrics.jsonl writes a non-finite value as a string ("inf", "nan"); TensorBoard gets the
    same scalars, those included (an fp16 overflow's grad_norm, a loss gone nan), as floats."""
    writer = MetricsWriter(str(tmp_path), 1, progress=False)
    writer.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "lr": np.float32(0.5), "skipped_steps": 1})
    writer.close()
    row = json.loads(open(tmp_path / "metrics.jsonl").read())
    assert (row["loss"], row["grad_norm"], row["lr"], row["skipped_steps"]) == ("nan", "inf", 0.5, 1)
    (name,) = os.listdir(tmp_path / "tb")
    got = {v.tag: v.simple_value for e in read_events(tmp_path / "tb" / name) for v in e.summary.value}
    assert set(got) == {"loss", "grad_norm", "lr", "skipped_steps"}, got
    assert np.isnan(got["loss"]) and got["grad_norm"] == np.inf and got["lr"] == 0.5 and got["skipped_steps"] == 1


def test_throughput_leaves_out_checkpoint_saves_and_validation(tmp_path, monkeypatch):
    """A clock that only the steps (step k takes k s), the saves (100 s each, after steps 2 and 4)
    and the validation passes (50 s each, after steps 3 and 6) move: each logged step_time_s is
    the mean over the steps since the previous logged step (the first step left out), without the
    saves' and validations' time (Megatron's interval timer stops around both). A validation
    between two logged steps once restarted the window: step 4 reported 4 s, not (3 + 4) / 2."""
    import types

    import layouts
    from mtjax.training import loop
    clock = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = layouts.tiny_config(extra=["train.steps=6", "train.log_interval=2", "train.eval_interval=3",
                                     "checkpoint.interval=2"])
    trainer = layouts.build(cfg, 1, 1, 1)
    step = trainer.train_step

    def timed(state, batch):
        clock[0] += float(int(state.step) + 1)
        return step(state, batch)

    def slow_validation(*args):
        clock[0] += 50.0
        return {"val_loss": 1.0}
    monkeypatch.setattr(loop, "evaluate", slow_validation)

    class SlowSaves:
        def save(self, state, trainer, precheck=None, position=None):
            clock[0] += 100.0

        def wait(self):
            pass

        def check(self):
            pass

    trainer.train_step = timed
    rows = np.asarray(layouts.random_batch(0, batch=6 * layouts.BATCH))
    data = types.SimpleNamespace(train=list(rows), valid=())
    writer = MetricsWriter(str(tmp_path), cfg.train.steps, progress=False)
    try:
        logged = loop.train(cfg, trainer, data, writer, checkpointer=SlowSaves()).rows
    finally:
        writer.close()
    assert [(r["step"], r["step_time_s"]) for r in logged if "loss" in r] == [(2, 2.0), (4, 3.5), (6, 5.5)]
    assert [r["step"] for r in logged if "val_loss" in r] == [3, 6]
    tokens = cfg.train.global_batch * cfg.model.seq_len
    assert [r["tokens_per_s"] for r in logged if "loss" in r] == [tokens / 2.0, tokens / 3.5, tokens / 5.5]


def test_a_run_no_longer_than_its_warm_up_is_the_start_of_a_longer_run():
    """optim.warmup_steps >= train.steps is accepted: the run ends inside the warm-up (lr below its
    peak, no decay), and its learning rates are those of any longer run with the same warm-up,
    so raising train.steps on a resume continues the same curve (with optim.decay_steps=0 too:
    the decay then runs over the new train.steps - warmup_steps, as a run started with them)."""
    from mtjax.training.optimizer import learning_rate
    common = ["optim.warmup_steps=10", "optim.lr=1.0", "optim.min_lr=0.1"]
    short = learning_rate(load_config(None, ["train.steps=5", *common]))
    longer = learning_rate(load_config(None, ["train.steps=20", *common]))
    assert [float(short(i)) for i in range(5)] == [float(longer(i)) for i in range(5)] == \
        pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert float(longer(10)) == 1.0 and float(longer(19)) < 0.2       # peak, then the cosine decay


@pytest.mark.parametrize("kind,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                       ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("NVIDIA A10", 125.0),
                                       ("cpu", None)])
def test_mfu_peak_by_device_kind(kind, peak):
    """The longest known name in jax's device_kind decides: an L40S is not taken for an L4 (MFU 3x)."""
    from mtjax.training.flops import peak_tflops
    assert peak_tflops(kind, 0.0) == peak
    assert peak_tflops(kind, 50.0) == 50.0


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_reported_tflops_and_mfu_are_model_flops_without_recomputation(recompute, monkeypatch):
    """The run's tflops_per_device and mfu count the model's FLOPs, Narayanan et al.'s closed form
    for GPT (72 B s l h^2 (1 + s/(6h) + V/(12 l h))), in every recompute mode: the forward a mode
    repeats is not model work (Megatron's logged TFLOP/s, `inspect`'s predicted_mfu)."""
    import types

    from mtjax.training import loop
    from mtjax.training.flops import megatron_formula
    clock = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = load_config(None, ["model.num_layers=3", "model.hidden_size=64", "model.num_heads=4",
                             f"train.recompute={recompute}", "train.global_batch=8", "train.peak_tflops=2.0"])
    plan = types.SimpleNamespace(tokens_per_step=8 * cfg.model.seq_len, padded_vocab=320, global_batch=8,
                                 recompute=types.SimpleNamespace(mode=recompute), recomputed_layers=0)
    meter = loop.Throughput(types.SimpleNamespace(plan=plan, mesh=types.SimpleNamespace(size=2)), cfg)
    clock[0] += 4.0                                   # 5 steps in 4 s on 2 devices
    row = meter.report(5)
    want = megatron_formula(cfg.model, 320, 8) * 5 / 4.0 / 2 / 1e12
    assert row["tflops_per_device"] == pytest.approx(want, rel=1e-12)
    assert row["mfu"] == pytest.approx(want / 2.0, rel=1e-12)

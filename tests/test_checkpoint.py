"""Checkpoints (in-process): exact resume, restore on other layouts, damaged checkpoints, non-finite steps."""
import glob
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layouts import VOCAB, build, random_batch, tiny_config
from mtjax.data.errors import DataError
from mtjax.training import loop
from mtjax.config import load_config
from mtjax.checkpoint import Checkpointer, CheckpointError, CheckpointFault, check_same_model, plan_checkpoints, verify
from mtjax.checkpoint.policy import refuse_early
from mtjax.training.data_setup import Datasets
from mtjax.training.metrics import MetricsWriter


class RandomTokens:
    """A dataset of seeded random samples [s + 1]: sample k depends on k only."""

    def __init__(self, seq_len):
        self.seq_len = seq_len

    def __len__(self):
        return 1 << 20

    def __getitem__(self, k):
        return np.random.RandomState(k).randint(0, VOCAB, self.seq_len + 1).astype(np.int32)


OPEN = []


def Ckpt(cfg):
    """A Checkpointer closed after the test (an open one keeps orbax threads alive)."""
    ck = Checkpointer(cfg)
    OPEN.append(ck)
    return ck


@pytest.fixture(autouse=True)
def close_checkpointers():
    yield
    while OPEN:
        OPEN.pop().close()


def data_for(cfg):
    return Datasets(train=RandomTokens(cfg.model.seq_len), valid=None, vocab=VOCAB, prefix="random")


def config(tmp, steps, data, pipe, tensor, extra=()):
    return tiny_config("gpt", tensor, pipe, data, extra=[
        f"train.steps={steps}", "train.log_interval=1", "train.eval_interval=0", "train.progress=false",
        f"train.run_dir={tmp}", "checkpoint.interval=2", "model.dropout=0.1", "optim.warmup_steps=2", *extra])


def run(cfg, trainer, state=None, checkpointer=None):
    writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, progress=False, enabled=False)
    return loop.train(cfg, trainer, data_for(cfg), writer, state, checkpointer)


def losses(rows):
    return {r["step"]: r["loss"] for r in rows}


def test_interrupted_then_resumed_equals_uninterrupted_bitwise(tmp_path):
    layout, extra = (2, 1, 2), ["parallel.distributed_optimizer=true", "parallel.sequence_parallel=true"]
    whole = config(tmp_path / "whole", 6, *layout, extra)
    trainer = build(whole, *layout)
    straight = losses(run(whole, trainer).rows)

    first = config(tmp_path / "cut", 3, *layout, extra)            # stops after step 3, saved at 2 and 3
    ck = Ckpt(first)
    run(first, trainer, checkpointer=ck)
    ck.close()
    assert Ckpt(first).steps() == [2, 3]

    second = config(tmp_path / "cut", 6, *layout, extra)
    ck = Ckpt(second)
    step = ck.latest_valid()
    state = ck.restore(step, trainer)
    assert step == 3 and int(state.step) == 3 and int(state.data_position) == 3 * 8
    resumed = losses(run(second, trainer, state, ck).rows)
    ck.close()
    assert set(resumed) == {4, 5, 6}
    for k in resumed:
        assert resumed[k] == straight[k], (k, resumed[k], straight[k])   # bitwise


def vocab_rows(tree, vocab, padded=()):
    """Parameters with the vocabulary axis (the one sized like the padded vocabulary: one of
    `padded`, or by default a multiple of 128 at least V) cut to V."""
    def cut(x):
        x = np.asarray(x)
        for axis, n in enumerate(x.shape):
            if (n in padded) if padded else (n >= VOCAB and n % 128 == 0):
                return np.take(x, np.arange(vocab), axis=axis)
        return x
    return jax.tree.map(cut, tree)


RESTORE_ON = [((1, 1, 8), []), ((8, 1, 1), []), ((1, 4, 2), ["parallel.distributed_optimizer=false"]),
              ((1, 1, 1), ["parallel.distributed_optimizer=false"])]


def test_a_checkpoint_restores_on_every_layout(tmp_path):
    """Saved on (2, 2, 2) with the distributed optimizer and interleaving (v = 2); restored on four
    other layouts: equal parameters and optimizer state, and the same next-step loss."""
    base = ["model.num_layers=4", "parallel.distributed_optimizer=true", "train.micro_batch=1"]
    cfg = config(tmp_path, 2, 2, 2, 2, base + ["parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                               "model.dropout=0.0"])
    trainer = build(cfg, 2, 2, 2)
    ck = Ckpt(cfg)
    run(cfg, trainer, checkpointer=ck)
    ck.close()
    saved = Ckpt(cfg).restore(2, trainer)
    canonical = trainer.canonical(saved)   # interleaving stores layers in run order
    expected = vocab_rows(jax.device_get((canonical.params, canonical.opt_state)), VOCAB)
    batch, position = random_batch(7), int(saved.data_position)
    ref = float(trainer.eval_step(saved.params, trainer.put_batch(batch)))  # the next step's loss

    for (d, p, t), extra in RESTORE_ON:
        other_cfg = config(tmp_path, 2, d, p, t, base + ["model.dropout=0.0", *extra])
        other = build(other_cfg, d, p, t)
        state = Ckpt(other_cfg).restore(2, other)
        assert state.params["embed"]["embedding"].shape[0] == other.padded_vocab
        got = vocab_rows(jax.device_get((state.params, state.opt_state)), VOCAB)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(a, b)
        assert int(state.step) == 2 and int(state.data_position) == position
        loss = float(other.eval_step(state.params, other.put_batch(batch)))
        assert abs(loss - ref) <= 1e-5 * abs(ref), (d, p, t, loss, ref)


def largest_file(step_dir):
    files = [f for f in glob.glob(os.path.join(step_dir, "state", "**"), recursive=True) if os.path.isfile(f)]
    return max(files, key=os.path.getsize)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    cfg = config(tmp, 4, 2, 1, 1)
    trainer = build(cfg, 2, 1, 1)
    ck = Checkpointer(cfg)
    run(cfg, trainer, checkpointer=ck)
    ck.close()
    return cfg, trainer


def test_a_truncated_checkpoint_is_reported_and_the_previous_one_used(tmp_path, two_checkpoints):
    cfg, trainer = two_checkpoints
    ck = Ckpt(cfg)
    assert ck.steps() == [2, 4] and verify(os.path.join(ck.directory, "4")) is None
    victim = largest_file(os.path.join(ck.directory, "4"))
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    lines = []
    assert ck.latest_valid(report=lines.append) == 2
    assert len(lines) == 1 and "step 4" in lines[0] and "truncated" in lines[0] and "\n" not in lines[0]
    assert ck.steps() == [2]                                     # moved aside, not deleted
    assert glob.glob(os.path.join(ck.directory, "damaged-4-*"))
    state = ck.restore(2, trainer)
    assert int(state.step) == 2


def test_flipped_bits_and_a_missing_manifest_are_caught(tmp_path):
    cfg = config(tmp_path, 2, 1, 1, 1, ["checkpoint.async_save=false"])
    trainer = build(cfg, 1, 1, 1)
    ck = Ckpt(cfg)
    ck.save(trainer.init_state(), trainer)
    step_dir = os.path.join(ck.directory, "0")
    assert verify(step_dir) is None                   # a synchronous save returns sealed
    victim = largest_file(step_dir)
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(victim, "wb").write(bytes(data))
    assert "CRC-32" in verify(step_dir)
    os.remove(os.path.join(step_dir, "mtjax_manifest.json"))       # a crash between rename and seal
    assert "no manifest" in verify(step_dir)
    assert ck.latest_valid(report=lambda line: None) is None
    stray = os.path.join(ck.directory, "1")          # not a step orbax lists: its forced save removed it
    open(stray, "w").write("mine")
    with pytest.raises(CheckpointFault, match="step 1 already exists"):
        ck.save(trainer.init_state().replace(step=jnp.asarray(1, jnp.int32)), trainer)
    assert open(stray).read() == "mine"


def test_a_deleted_manifest_is_moved_aside_and_an_only_damaged_checkpoint_is_one_line(tmp_path, capsys):
    """A step directory exists only once its save finished: without its manifest it is damaged,
    moved aside (never deleted) and the previous step used. Readers (`find_checkpoint`: to-hf,
    generate, init_from) fall back past it with one warning line, and with no usable step raise
    one line naming the step, the file and what is wrong, with no warning before it."""
    from mtjax.checkpoint import find_checkpoint
    cfg = config(tmp_path, 2, 1, 1, 1, ["checkpoint.async_save=false", "checkpoint.keep=5"])
    trainer = build(cfg, 1, 1, 1)
    ck = Ckpt(cfg)
    state = trainer.init_state()
    for step in (0, 2):
        ck.save(state.replace(step=jnp.asarray(step, state.step.dtype)), trainer)
    os.remove(os.path.join(ck.directory, "2", "mtjax_manifest.json"))
    directory, step = find_checkpoint(str(tmp_path))                   # read-only: nothing moved
    warned = capsys.readouterr().err.strip().splitlines()
    assert (directory, step) == (ck.directory, 0) and len(warned) == 1, warned
    assert warned[0].startswith(f"warning: checkpoint step 2 in {ck.directory} is damaged: no manifest")
    assert warned[0].endswith("; using step 0") and os.path.isdir(os.path.join(ck.directory, "2"))

    lines = []
    assert ck.latest_valid(report=lines.append) == 0
    assert len(lines) == 1 and "step 2" in lines[0] and "no manifest" in lines[0] and "trying step 0" in lines[0]
    aside = glob.glob(os.path.join(ck.directory, "damaged-2-*"))
    assert len(aside) == 1 and os.listdir(os.path.join(aside[0], "state"))        # kept whole
    assert ck.steps() == [0] and int(ck.restore(0, trainer).step) == 0

    victim = largest_file(os.path.join(ck.directory, "0"))
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 3] ^= 0x01
    open(victim, "wb").write(bytes(data))
    with pytest.raises(DataError) as e:
        find_checkpoint(str(tmp_path))
    rel = os.path.relpath(victim, os.path.join(ck.directory, "0"))
    assert str(e.value) == (f"{tmp_path}: holds no complete mtjax checkpoint: checkpoint step 0 in {ck.directory} "
                            f"is damaged: {rel} fails its CRC-32 check (corrupted)")
    assert capsys.readouterr().err == ""                               # no "trying the previous one"
    from mtjax.config.errors import ConfigError
    from mtjax.checkpoint.init_from import find_source
    with pytest.raises(ConfigError) as e:                              # train.init_from: the same line, keyed
        find_source(config(tmp_path / "ft", 2, 1, 1, 1, [f"train.init_from={tmp_path}"]))
    assert str(e.value) == f"train.init_from: {tmp_path}: holds no complete mtjax checkpoint: checkpoint step 0 in " \
                           f"{ck.directory} is damaged: {rel} fails its CRC-32 check (corrupted)"
    assert capsys.readouterr().err == ""
    lines = []
    assert ck.latest_valid(report=lines.append) is None
    assert len(lines) == 1 and lines[0].endswith("no earlier checkpoint remains") and rel in lines[0]


def test_restoring_into_another_model_is_one_line(tmp_path, two_checkpoints):
    cfg, _ = two_checkpoints
    other_cfg = tiny_config("gpt", 1, 1, 2, extra=["model.hidden_size=64", f"checkpoint.dir={Ckpt(cfg).directory}"])
    other = build(other_cfg, 2, 1, 1)
    with pytest.raises(CheckpointError, match=r"model.hidden_size=32, the config says 64") as e:
        Ckpt(other_cfg).restore(2, other)
    assert isinstance(e.value, DataError) and "\n" not in str(e.value)


def test_arrays_that_disagree_with_a_resealed_config_are_one_line_before_any_read(tmp_path, two_checkpoints):
    """A saved config edited (8 heads -> 4) and resealed passes the config checks; the arrays'
    shapes, read from orbax's metadata, refuse it naming the leaf, for a resume and for the
    parameters alone, before orbax starts a read (whose threads would print after its error)."""
    from mtjax.checkpoint import manifest
    from mtjax.checkpoint.params import restore_params
    from mtjax.layout import resolve_layout
    cfg, _ = two_checkpoints
    copy = str(tmp_path / "copy")
    shutil.copytree(Ckpt(cfg).directory, copy)
    step_dir = os.path.join(copy, "2")
    meta_file = os.path.join(step_dir, "config", "metadata")
    text = open(meta_file).read()
    assert '"num_heads": 8' in text
    open(meta_file, "w").write(text.replace('"num_heads": 8', '"num_heads": 4'))
    manifest.write_manifest(step_dir)
    other_cfg = tiny_config("gpt", 1, 1, 2, extra=["model.num_heads=4", f"checkpoint.dir={copy}"])
    other = build(other_cfg, 2, 1, 1)
    shape = r"stores params\.layers\.attn\.\w+\.(kernel|bias) at shape \(.*\), this model's is \(.*\)"
    with pytest.raises(CheckpointError, match=shape) as e:
        Ckpt(other_cfg).restore(2, other)
    assert "\n" not in str(e.value)
    meta, _ = Ckpt(other_cfg).saved(2)
    with pytest.raises(CheckpointError, match=shape):
        restore_params(copy, 2, resolve_layout(other_cfg, other.mesh, VOCAB), meta)


def test_an_unreadable_array_in_a_resealed_checkpoint_is_one_line(tmp_path, two_checkpoints, capsys):
    """A resume whose arrays cannot be read (a file cut in half, then resealed) fails in orbax's
    reads with a bare Exception: one CheckpointError line naming the step and the array. (Orbax's
    other reads end after it in their own threads, printing to stderr, which only the entry points
    filter: they are let end inside this test's capture.)"""
    import gc
    import time
    from mtjax.checkpoint import manifest
    cfg, trainer = two_checkpoints
    copy = str(tmp_path / "copy")
    shutil.copytree(Ckpt(cfg).directory, copy)
    victim = largest_file(os.path.join(copy, "2"))
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    manifest.write_manifest(os.path.join(copy, "2"))
    other_cfg = cfg.replace(checkpoint=cfg.checkpoint.__class__(dir=copy))
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 in .* cannot be restored: \w+: Error") as e:
        Ckpt(other_cfg).restore(2, trainer)
    assert "\n" not in str(e.value) and "tensorstore_spec" not in str(e.value)
    time.sleep(0.5)
    gc.collect()
    capsys.readouterr()


def test_the_model_check_compares_the_models_not_the_spelling():
    """A field the checkpoint predates counts at its default, and an arch default left unset
    (tie_embeddings null, activation "") equals the value it resolves to; a kernel choice or a
    training setting is not the model."""
    cfg = load_config(None, ["model.arch=llama"])
    older = {k: v for k, v in cfg.to_dict()["model"].items() if k not in ("kv_channels", "activation", "qkv_bias")}
    check_same_model({**older, "tie_embeddings": False}, cfg, 3)
    check_same_model({**older, "activation": "swiglu"}, cfg, 3)
    with pytest.raises(CheckpointError, match=r"model.tie_embeddings=True, the config says False"):
        check_same_model({**older, "tie_embeddings": True}, cfg, 3)
    with pytest.raises(CheckpointError, match=r"model.kv_channels=0, the config says 16"):
        check_same_model(older, load_config(None, ["model.arch=llama", "model.kv_channels=16"]), 3)
    # the attention kernel, the initialisation and the routing's training settings may change
    check_same_model({**older, "attention": "dot_product", "init_std": 0.5, "moe_aux_loss_coeff": 0.1}, cfg, 3)
    with pytest.raises(CheckpointError, match=r"model.norm_eps=0.1, the config says 1e-05"):
        check_same_model({**older, "norm_eps": 0.1}, cfg, 3)


def test_resume_false_over_checkpoints_needs_overwrite(two_checkpoints):
    from mtjax.config.errors import ConfigError
    cfg, _ = two_checkpoints
    with pytest.raises(ConfigError, match="checkpoint.overwrite=true"):
        plan_checkpoints(cfg.replace(checkpoint=cfg.checkpoint.__class__(resume=False)))


def test_a_file_named_like_a_step_is_refused_before_the_run(tmp_path, two_checkpoints):
    """A file or a dangling link where step 7 would be saved: the run would fail at step 7's save,
    so the plan refuses it first, in one line naming checkpoint.dir and the path."""
    from mtjax.config.errors import ConfigError
    cfg, _ = two_checkpoints
    run = config(tmp_path, 8, 2, 1, 1)
    directory = os.path.join(tmp_path, "checkpoints")
    shutil.copytree(Ckpt(cfg).directory, directory)
    for make in (lambda p: open(p, "w").close(), lambda p: os.symlink(os.path.join(tmp_path, "gone"), p)):
        make(os.path.join(directory, "7"))
        with pytest.raises(ConfigError) as e:
            plan_checkpoints(run)
        assert str(e.value) == f"checkpoint.dir: {directory}/7 is not a directory, where a checkpoint step " \
                               f"would be saved: move it away"
        os.remove(os.path.join(directory, "7"))
    assert plan_checkpoints(run).existing[0] == 2


def test_starting_over_deletes_only_checkpoints_then_saves_the_same_steps(tmp_path, two_checkpoints):
    """checkpoint.overwrite=true: the steps, unfinished saves and damaged steps go, nothing else
    that shares the directory (a file named like a step, a user's 4.bak); the run then saves a
    step the old run had saved (its checkpointer's step list read again)."""
    from mtjax.checkpoint.policy import plan_checkpoints
    cfg, trainer = two_checkpoints
    fresh = config(tmp_path, 4, 2, 1, 1, ["checkpoint.resume=false", "checkpoint.overwrite=true"])
    directory = os.path.join(tmp_path, "checkpoints")
    shutil.copytree(Ckpt(cfg).directory, directory)
    for name in ("4.bak", "2024.notes", "3.orbax-checkpoint-tmp-17", "damaged-1-1700000000"):
        os.makedirs(os.path.join(directory, name))
    open(os.path.join(directory, "7.txt"), "w").close()
    plan = plan_checkpoints(fresh)
    ck = Ckpt(fresh)
    plan.clear_if_starting_over()
    ck.reload()
    assert sorted(os.listdir(directory)) == ["2024.notes", "4.bak", "7.txt"]
    state = trainer.init_state()
    ck.save(state.replace(step=jax.device_put(jnp.int32(2), state.step.sharding)), trainer)
    ck.close()
    assert Ckpt(fresh).steps() == [2]


def test_a_run_that_would_not_resume_its_checkpoints_is_refused(tmp_path, two_checkpoints):
    """checkpoint.enabled=false over a run's checkpoints would start over beside them (and
    rewrite its metrics): refused without overwrite; damaged steps alone: nothing to resume."""
    from mtjax.config.errors import ConfigError
    from mtjax.checkpoint.policy import plan_checkpoints
    cfg, _ = two_checkpoints
    off = cfg.replace(checkpoint=cfg.checkpoint.__class__(enabled=False))
    with pytest.raises(ConfigError, match="checkpoint.enabled: is false but .* holds this run's checkpoints"):
        plan_checkpoints(off)
    assert plan_checkpoints(cfg).existing[0] == 2         # (step 4 may have been damaged above)
    damaged = config(tmp_path, 4, 2, 1, 1)
    os.makedirs(os.path.join(tmp_path, "checkpoints", "damaged-4-1700000000"))
    with pytest.raises(ConfigError, match="holds damaged checkpoints only .*damaged-4-1700000000.*nothing to resume"):
        plan_checkpoints(damaged)
    start_over = config(tmp_path, 4, 2, 1, 1, ["checkpoint.resume=false", "checkpoint.overwrite=true"])
    assert plan_checkpoints(start_over).start_over


EXPLODING = {}


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_non_finite_loss_stops_or_skips_and_no_checkpoint_holds_non_finite_weights(tmp_path, policy):
    # lr = 1e30 makes step 1's update enormous (but finite) and the loss of step 2 non-finite.
    cfg = config(tmp_path, 4, 1, 1, 1, ["optim.lr=1e30", "optim.min_lr=1e30", "optim.warmup_steps=0",
                                         "optim.clip_grad=0", "checkpoint.interval=1",
                                         f"train.on_nonfinite={policy}"])
    # the step does not depend on the policy (the loop reads it), so both cases share one compile
    if "trainer" not in EXPLODING:
        EXPLODING["trainer"] = build(cfg, 1, 1, 1)
    trainer = EXPLODING["trainer"]
    ck = Ckpt(cfg)
    if policy == "stop":
        with pytest.raises(loop.NonFiniteLoss, match=r"non-finite loss .* at step 2"):
            run(cfg, trainer, checkpointer=ck)
    else:
        rows = run(cfg, trainer, checkpointer=ck).rows
        assert not np.isfinite(rows[-1]["loss"]) and rows[-1]["skipped_steps"] == 3
    ck.close()
    ck = Ckpt(cfg)
    assert ck.steps() == ([1] if policy == "stop" else [3, 4])
    for step in ck.steps():
        state = ck.restore(step, trainer)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state.params))


def test_saving_non_finite_weights_is_refused(tmp_path):
    cfg = config(tmp_path, 2, 1, 1, 1)
    trainer = build(cfg, 1, 1, 1)
    state = trainer.init_state()
    state = state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))
    with pytest.raises(loop.NonFiniteLoss, match="refusing to checkpoint non-finite weights"):
        loop.save(Ckpt(cfg), state, trainer)
    assert Ckpt(cfg).steps() == []


class SignalAt(RandomTokens):
    """Random samples that send `signum` to this process when sample `at` is read."""

    def __init__(self, seq_len, at, signum):
        super().__init__(seq_len)
        self.at, self.signum = at, signum

    def __getitem__(self, k):
        if k == self.at:
            os.kill(os.getpid(), self.signum)
        return super().__getitem__(k)


def test_sigint_finishes_the_step_saves_and_returns(tmp_path, two_checkpoints):
    import signal
    from mtjax.training.signals import StopRequest
    _, trainer = two_checkpoints
    # Python's own handler, whatever an earlier in-process test of this worker left (`cli.run` ignores
    # SIGINT once its command has returned)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cfg = config(tmp_path, 100, 2, 1, 1, ["checkpoint.interval=0"])
    data = Datasets(train=SignalAt(cfg.model.seq_len, at=2 * 8 + 3, signum=signal.SIGINT), valid=None,
                    vocab=VOCAB, prefix="random")                      # read while fetching step 3's batch
    ck = Ckpt(cfg)
    writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, progress=False, enabled=False)
    with StopRequest() as stop:
        outcome = loop.train(cfg, trainer, data, writer, None, ck, stop)
    assert outcome.stopped_by == "SIGINT" and outcome.step == 3
    assert ck.steps() == [3] and verify(os.path.join(ck.directory, "3")) is None   # saved and waited for
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler           # handlers restored
    ck.close()


def test_a_signal_ends_the_run_on_a_logged_step_with_its_training_metrics(tmp_path, two_checkpoints, monkeypatch):
    """The step a signal stops at is the run's last: logged with its training metrics whatever
    train.log_interval (and with the validation losses when it validates), as step train.steps
    is, so that `RunResult.metrics` (the last row) holds `loss` however the run ended. Once it
    held only the validation losses (a validation step that was not a log step), or a row from
    steps before."""
    import signal
    from mtjax.training.signals import StopRequest
    _, trainer = two_checkpoints
    signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(loop, "evaluate", lambda *args: {"val_loss": 1.5, "val_ppl": 4.5})
    cfg = config(tmp_path, 100, 2, 1, 1, ["train.log_interval=10", "train.eval_interval=3"])
    for stop_at, validated in ((3, True), (2, False)):           # a validation step, and a plain one
        data = Datasets(train=SignalAt(cfg.model.seq_len, at=(stop_at - 1) * 8 + 3, signum=signal.SIGINT),
                        valid=(), vocab=VOCAB, prefix="random")
        writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, progress=False, enabled=False)
        with StopRequest() as stop:
            outcome = loop.train(cfg, trainer, data, writer, None, None, stop)
        assert (outcome.stopped_by, outcome.step) == ("SIGINT", stop_at)
        assert [r["step"] for r in outcome.rows] == [stop_at]
        last = outcome.rows[-1]
        assert {"loss", "grad_norm", "lr"} <= set(last) and np.isfinite(last["loss"]), last
        assert list(last)[-2:] == ["val_loss", "val_ppl"] if validated else "val_loss" not in last


def test_a_signal_stop_without_checkpoints_checks_the_last_step_for_a_non_finite_loss(tmp_path):
    """checkpoint.enabled=false: the step a signal stops at is checked as the last step is (once
    only a save's check read it, and a nan at that step went unreported)."""
    import signal
    from mtjax.training.signals import StopRequest
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # lr = 1e30 makes the loss of step 2 non-finite (test_a_non_finite_loss_stops_or_skips_...)
    cfg = config(tmp_path, 4, 1, 1, 1, ["optim.lr=1e30", "optim.min_lr=1e30", "optim.warmup_steps=0",
                                         "optim.clip_grad=0", "checkpoint.enabled=false"])
    if "trainer" not in EXPLODING:
        EXPLODING["trainer"] = build(cfg, 1, 1, 1)
    data = Datasets(train=SignalAt(cfg.model.seq_len, at=8 + 3, signum=signal.SIGINT), valid=None,
                    vocab=VOCAB, prefix="random")                      # read while fetching step 2's batch
    writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, progress=False, enabled=False)
    with StopRequest() as stop:
        with pytest.raises(loop.NonFiniteLoss, match=r"non-finite loss .* at step 2"):
            loop.train(cfg, EXPLODING["trainer"], data, writer, None, None, stop)


def test_a_change_of_precision_restarts_the_loss_scaler(two_checkpoints):
    cfg, _ = two_checkpoints
    fp16 = cfg.replace(train=cfg.train.__class__(**{**cfg.train.__dict__, "precision": "fp16"}))
    trainer = build(fp16, 2, 1, 1)
    state = Ckpt(fp16).restore(2, trainer)           # (step 4 may have been damaged above)
    assert float(state.loss_scale.scale) == 2.0 ** 32 and int(state.loss_scale.skipped) == 0
    assert state.loss_scale.scale.sharding == trainer.state_shardings.loss_scale.scale


def test_a_zbv_checkpoint_restores_on_1f1b_and_back(tmp_path):
    """zbv stores stage i's layers as virtual stages i and 2p - 1 - i (run order [0, 3, 1, 2] at
    p = 2, one layer a chunk); checkpoints hold the canonical order, so a zbv checkpoint restores
    on 1f1b, and a 1f1b one on zbv, with every leaf equal in canonical order."""
    base = ["model.num_layers=4", "checkpoint.async_save=false", "train.micro_batch=1"]
    trainers = {s: build(config(tmp_path / s, 2, 1, 2, 1, [*base, f"parallel.schedule={s}"]), 1, 2, 1)
                for s in ("zbv", "1f1b")}
    assert list(trainers["zbv"]._layer_rows[0]) == [0, 3, 1, 2]
    for saver, restorer in (("zbv", "1f1b"), ("1f1b", "zbv")):
        src, dst = trainers[saver], trainers[restorer]
        ck = Ckpt(src.cfg)
        state = src.init_state()
        ck.save(state, src)
        ck.close()
        reader = Checkpointer(dst.cfg, directory=ck.directory)
        OPEN.append(reader)
        restored = reader.restore(0, dst)
        for a, b in zip(jax.tree.leaves(jax.device_get(dst.canonical(restored.params))),
                        jax.tree.leaves(jax.device_get(src.canonical(state.params)))):
            np.testing.assert_array_equal(a, b)


def test_a_file_named_as_a_checkpoint_is_said_to_be_a_file(tmp_path):
    from mtjax.checkpoint import find_checkpoint
    config = tmp_path / "tiny.yaml"
    config.write_text("model: {}\n")
    with pytest.raises(DataError, match=r"tiny\.yaml: a file, not a directory \(name a run"):
        find_checkpoint(str(config))
    with pytest.raises(DataError, match=r"nope: no such directory$"):
        find_checkpoint(str(tmp_path / "nope"))


def test_a_rotary_models_sequence_length_may_change_a_learned_tables_may_not():
    """llama (rotary positions) has no weight of shape s: init_from and generation take any
    seq_len; a resume of a trained step at another one needs data.allow_change (its data position
    counts samples of the saved length), a step-0 checkpoint (a conversion) does not. GPT's
    learned position table is [s, h]: refused everywhere."""
    from mtjax.config.errors import ConfigError
    llama = load_config(None, ["model.arch=llama", "model.seq_len=32"]).to_dict()["model"]
    longer = load_config(None, ["model.arch=llama", "model.seq_len=64"])
    check_same_model(llama, longer, 3)                          # init_from, generation
    check_same_model(llama, longer, 0, resumes=True)            # a conversion fine-tuned in place
    with pytest.raises(ConfigError, match=r"checkpoint step 3 was trained on samples of 32 tokens") as e:
        check_same_model(llama, longer, 3, resumes=True)
    assert e.value.key == "model.seq_len" and "data.allow_change=true" in str(e.value)
    check_same_model(llama, load_config(None, ["model.arch=llama", "model.seq_len=64", "data.allow_change=true"]),
                     3, resumes=True)
    gpt = load_config(None, ["model.seq_len=32"]).to_dict()["model"]
    for step, resumes in [(3, False), (0, True)]:
        with pytest.raises(CheckpointError, match=r"model.seq_len=32, the config says 64"):
            check_same_model(gpt, load_config(None, ["model.seq_len=64"]), step, resumes=resumes)


def test_a_newest_step_missing_its_config_is_moved_aside_not_a_fault(tmp_path, two_checkpoints):
    """A newest step whose config/metadata was deleted (orbax raises FileNotFoundError reading it)
    is damaged like any other: the check before compiling (`refuse_early`) leaves it to the resume,
    which moves it aside (the run ended with orbax's 'File ... not found.' and status 1)."""
    cfg, _ = two_checkpoints
    copy = str(tmp_path / "copy")
    shutil.copytree(Ckpt(cfg).directory, copy)
    older = max(int(n) for n in os.listdir(copy) if n.isdigit())       # earlier tests move steps aside
    shutil.copytree(os.path.join(copy, str(older)), os.path.join(copy, str(older + 1)))   # sealed, whole
    os.remove(os.path.join(copy, str(older + 1), "config", "metadata"))
    ck = Ckpt(config(tmp_path, 4, 2, 1, 1, [f"checkpoint.dir={copy}"]))
    refuse_early(ck, ck.cfg, VOCAB)
    lines = []
    assert ck.latest_valid(report=lines.append) == older
    assert len(lines) == 1 and "missing file config/metadata" in lines[0], lines


def test_a_refused_resume_past_a_damaged_newest_step_moves_nothing(tmp_path, two_checkpoints):
    """A damaged newest step and a config the older, intact one refuses (model.norm_eps): refused
    before the compile (`refuse_early` goes on to the step the resume would take) and at the resume
    itself (`run.restore` checks that step before moving the damaged one aside); the directory is
    as it was. Once the damaged step was moved aside first, then the run refused."""
    import types

    from mtjax import run as run_module
    cfg, _ = two_checkpoints
    copy = str(tmp_path / "copy")
    shutil.copytree(Ckpt(cfg).directory, copy)
    older = max(int(n) for n in os.listdir(copy) if n.isdigit())       # earlier tests move steps aside
    shutil.copytree(os.path.join(copy, str(older)), os.path.join(copy, str(older + 1)))
    victim = largest_file(os.path.join(copy, str(older + 1)))
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    other = config(tmp_path, 4, 2, 1, 1, [f"checkpoint.dir={copy}", "model.norm_eps=0.1"])
    before = sorted(os.walk(copy))
    ck = Ckpt(other)
    with pytest.raises(CheckpointError, match=rf"checkpoint step {older} was saved with model.norm_eps="):
        refuse_early(ck, other, VOCAB)
    trainer = types.SimpleNamespace(cfg=other, vocab=VOCAB)             # refused before any array is read
    lines = []
    with pytest.raises(CheckpointError, match=rf"checkpoint step {older} was saved with model.norm_eps="):
        run_module.restore(other, ck, trainer, None, lambda line, **k: lines.append(line))
    assert sorted(os.walk(copy)) == before and lines == []
    ok = Ckpt(config(tmp_path, 4, 2, 1, 1, [f"checkpoint.dir={copy}"]))
    refuse_early(ok, ok.cfg, VOCAB)
    assert ok.latest_valid(report=lines.append, check=lambda step: None) == older     # a resume then moves it
    assert len(lines) == 1 and f"trying step {older}" in lines[0] and ok.steps()[-1] == older


def test_the_data_position_stays_exact_past_two_to_the_31(tmp_path, two_checkpoints):
    """The state's int32 data position wraps after 2^31 samples; a checkpoint's meta keeps the
    loop's exact count, and a resume (`run.restore`) reads on from it, not from the wrapped one."""
    from mtjax import run as run_module
    from mtjax.checkpoint.compat import data_position
    _, trainer = two_checkpoints
    cfg = config(tmp_path, 2, 2, 1, 1)
    start = (1 << 31) - 8                                        # the second step's 8 samples cross 2^31
    state = trainer.init_state().replace(data_position=jnp.int32(start))
    ck = Ckpt(cfg)
    writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, progress=False, enabled=False)
    loop.train(cfg, trainer, data_for(cfg), writer, state, ck, position=start)
    ck.close()
    ck = Ckpt(cfg)
    state, resumed, position = run_module.restore(cfg, ck, trainer, None, lambda *a, **k: None)
    assert resumed and int(state.step) == 2 and position == start + 2 * 8
    assert int(state.data_position) == position - (1 << 32)      # what the state alone would say
    meta = ck.saved(2)[0]
    with pytest.raises(CheckpointError, match="data position"):
        data_position({**meta, "data_position": position + 8}, state, 2)
    assert data_position({k: v for k, v in meta.items() if k != "data_position"}, state, 2) == position  # unsigned


def test_yarn_settings_are_model_fields():
    """yarn's betas and attention factor change what the model computes: a checkpoint restores only
    into the same ones; one saved before the fields existed reads them at their defaults."""
    yarn = ["model.arch=llama", "model.rope_scaling=yarn", "model.rope_scaling_factor=4"]
    saved = load_config(None, yarn).to_dict()["model"]
    for field, value in (("rope_beta_fast", 16), ("rope_beta_slow", 2), ("rope_attention_factor", 1.5)):
        with pytest.raises(CheckpointError, match=rf"saved with model.{field}="):
            check_same_model(saved, load_config(None, [*yarn, f"model.{field}={value}"]), 3)
    older = {k: v for k, v in saved.items() if k not in ("rope_beta_fast", "rope_beta_slow", "rope_attention_factor")}
    check_same_model(older, load_config(None, yarn), 3)

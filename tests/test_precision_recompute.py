"""Mixed precision (fp16 dynamic loss scaling) and activation recomputation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layouts import build, leaf_errors, random_batch, tiny_config, ZERO_GRADIENT
from mtjax.training.loss_scale import LossScale, update_loss_scale


def scaler(scale, good=0, hysteresis=2):
    return LossScale(jnp.float32(scale), jnp.int32(good), jnp.int32(hysteresis), jnp.int32(0))


def test_loss_scale_follows_megatrons_rule():
    cfg = tiny_config(extra=["train.precision=fp16"])          # window 1000, hysteresis 2, min 1
    s = update_loss_scale(scaler(1024.0), jnp.bool_(False), cfg)
    assert float(s.scale) == 1024.0 and int(s.hysteresis) == 1 and int(s.skipped) == 1   # tolerated once
    s = update_loss_scale(s, jnp.bool_(False), cfg)
    assert float(s.scale) == 512.0 and int(s.skipped) == 2                                 # then halved
    s = update_loss_scale(scaler(1.0, hysteresis=0), jnp.bool_(False), cfg)
    assert float(s.scale) == 1.0                                                            # never below min
    s = update_loss_scale(scaler(8.0, good=999, hysteresis=0), jnp.bool_(True), cfg)
    assert float(s.scale) == 16.0 and int(s.good_steps) == 0 and int(s.hysteresis) == 2    # grows, refills


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    cfg = tiny_config(extra=["train.precision=fp16", "train.hysteresis=1", "train.initial_loss_scale=1e30"])
    trainer = build(cfg, 2, 1, 2)
    state = trainer.init_state()
    before = jax.device_get(state.params)
    state, metrics = trainer.train_step(state, trainer.put_batch(random_batch(0)))
    after = jax.device_get(state.params)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)                  # skipped: nothing moved
    assert float(metrics["loss_scale"]) == float(np.float32(1e30) / 2) and int(metrics["skipped_steps"]) == 1
    assert int(state.step) == 1

    # a sane scale takes the step, and gives fp32's update up to fp16 rounding
    ok = tiny_config(extra=["train.precision=fp16", "train.initial_loss_scale=1024"])
    fp16 = build(ok, 2, 1, 2)
    s16, m16 = fp16.train_step(fp16.init_state(), fp16.put_batch(random_batch(0)))
    fp32 = build(tiny_config(), 2, 1, 2)
    s32, m32 = fp32.train_step(fp32.init_state(), fp32.put_batch(random_batch(0)))
    assert int(m16["skipped_steps"]) == 0
    assert abs(float(m16["loss"]) - float(m32["loss"])) < 1e-2


@pytest.mark.parametrize("data,pipe,tensor,sp", [(1, 1, 2, True), (1, 2, 1, False)])
def test_every_recompute_mode_gives_the_gradients_of_none(data, pipe, tensor, sp):
    batch = random_batch(3)
    grads = {}
    for mode in ("none", "selective", "full"):
        cfg = tiny_config("llama", tensor, pipe, data, sp, micro_batch=2, extra=[f"train.recompute={mode}"])
        trainer = build(cfg, data, pipe, tensor)
        state = trainer.init_state()
        grads[mode], _ = trainer.grad_fn(state.params, trainer.put_batch(batch), state.rng)
    for mode in ("selective", "full"):
        errs = leaf_errors(jax.device_get(grads[mode]), jax.device_get(grads["none"]), skip=(ZERO_GRADIENT,))
        assert max(errs.values()) < 1e-6, (mode, errs)

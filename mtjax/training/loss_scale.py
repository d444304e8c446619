"""Dynamic loss scaling for fp16 (Megatron's DynamicGradScaler rule).

The loss is multiplied by S before differentiation and the gradients divided
by S after the reductions, so small fp16 gradients do not flush to zero.
After each step:
  * non-finite gradients: the step is skipped (parameters and optimizer
    state unchanged) and counted; the hysteresis counter drops by one, and
    once it has reached 0, S halves (never below `min_loss_scale`);
  * `loss_scale_window` finite steps in a row: S doubles and the hysteresis
    counter is refilled.
Megatron's defaults: S0 = 2^32, window 1000, hysteresis 2, minimum 1.
A static scale (`train.loss_scale` > 0, Megatron's --loss-scale and ConstantGradScaler) is S
at every step, whatever the state holds (a resumed run takes the config's); overflowing steps
are still skipped and counted.
Precisions other than fp16 keep S = 1 and never skip.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from mtjax.config.schema import Config


@flax.struct.dataclass
class LossScale:
    scale: jax.Array          # f32 S
    good_steps: jax.Array     # int32 finite steps since the last change
    hysteresis: jax.Array     # int32: S halves at the overflow that takes it to 0 (refilled when S grows)
    skipped: jax.Array        # int32 steps skipped so far


def init_loss_scale(cfg: Config) -> LossScale:
    fp16 = cfg.train.precision == "fp16"
    start = (cfg.train.loss_scale or cfg.train.initial_loss_scale) if fp16 else 1.0
    return LossScale(scale=jnp.float32(start),
                     good_steps=jnp.int32(0), hysteresis=jnp.int32(cfg.train.hysteresis),
                     skipped=jnp.int32(0))


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def step_scale(ls: LossScale, cfg: Config) -> jax.Array:
    """S for this step: the static scale, or the dynamic scaler's."""
    return jnp.float32(cfg.train.loss_scale) if cfg.train.loss_scale else ls.scale


def update_loss_scale(ls: LossScale, finite, cfg: Config) -> LossScale:
    """The scaler's state after a step whose gradients were `finite` (a traced bool)."""
    tr = cfg.train
    if tr.loss_scale:
        return ls.replace(scale=jnp.float32(tr.loss_scale),
                          skipped=ls.skipped + jnp.where(finite, 0, 1).astype(jnp.int32))
    hysteresis = jnp.where(finite, ls.hysteresis, ls.hysteresis - 1)
    backoff = jnp.maximum(ls.scale * 0.5, tr.min_loss_scale)
    good = jnp.where(finite, ls.good_steps + 1, 0)
    grow = finite & (good >= tr.loss_scale_window)
    scale = jnp.where(finite, jnp.where(grow, ls.scale * 2.0, ls.scale),
                      jnp.where(hysteresis <= 0, backoff, ls.scale))
    return LossScale(scale=scale, good_steps=jnp.where(grow, 0, good),
                     hysteresis=jnp.where(grow, tr.hysteresis, hysteresis),
                     skipped=ls.skipped + jnp.where(finite, 0, 1).astype(jnp.int32))

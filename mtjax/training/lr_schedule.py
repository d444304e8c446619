"""The learning-rate schedule: a linear warm-up, then one of Megatron's decay styles
(`--lr-decay-style`, `megatron/core/optimizer_param_scheduler.py`), as `optim.decay_style`.

n is the optimizer steps applied so far (optax's count; a skipped step does not count),
W = optim.warmup_steps, D = W + L the step the decay ends at, with L = optim.decay_steps
(train.steps - W when 0), r = (n - W) / L, lr_max = optim.lr, lr_min = optim.min_lr and
lr_0 = optim.lr_warmup_init (Megatron's --lr-warmup-init, its init_lr):

    n < W                 lr_0 + (lr_max - lr_0) * n / W                   (every style)
    cosine                lr_min + (lr_max - lr_min) * (1 + cos(pi r)) / 2
    linear                lr_min + (lr_max - lr_min) * (1 - r)
    constant              lr_max, for every n >= W (min_lr and the decay length unused)
    inverse_square_root   max(lr_min, lr_max * sqrt(max(W, 1) / max(n, 1)))
    wsd                   lr_max up to A = D - optim.wsd_decay_steps, then
                          lr_min + (lr_max - lr_min) * c(q), q = (n - A) / wsd_decay_steps, with c by
                          optim.wsd_decay_style: linear 1 - q, cosine (1 + cos(pi q)) / 2,
                          exponential 2 * 0.5^q - 1, minus_sqrt 1 - sqrt(q)
    n > D                 lr_min, every style but constant (inverse_square_root drops to its floor
                          there, as in Megatron, wherever its curve has got to)

Each style reaches lr_max at n = W, so the warm-up joins it without a step (Megatron takes n = W
into the warm-up: the same value); cosine, linear and
wsd end at lr_min at n = D (c(1) = 0 for every wsd shape).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import optax

from mtjax.config.schema import Config

# c(q) on q in [0, 1], from c(0) = 1 to c(1) = 0: the share of lr_max - lr_min left
CURVES = {
    "linear": lambda q: 1.0 - q,
    "cosine": lambda q: 0.5 * (1.0 + jnp.cos(jnp.pi * q)),
    "exponential": lambda q: 2.0 * jnp.power(0.5, q) - 1.0,
    "minus_sqrt": lambda q: 1.0 - jnp.sqrt(q),
}


def decay_length(cfg: Config) -> int:
    """L, the decay's steps after the warm-up: optim.decay_steps, or train.steps - W when 0 (at
    least 1: a run no longer than its warm-up ends before any decay, whatever L)."""
    return cfg.optim.decay_steps or max(1, cfg.train.steps - cfg.optim.warmup_steps)


def learning_rate(cfg: Config) -> optax.Schedule:
    """lr(n) of the module doc for optim.decay_style; a function of the int32 count, traceable."""
    op = cfg.optim
    warmup, length = op.warmup_steps, decay_length(cfg)
    start = op.lr_warmup_init
    if op.decay_style == "cosine":   # optax's own: the schedule mtjax had before the other styles
        return optax.warmup_cosine_decay_schedule(
            init_value=start, peak_value=op.lr, warmup_steps=warmup,
            decay_steps=warmup + length, end_value=op.min_lr)
    after = _after_warmup(cfg, warmup, length)

    def schedule(count):
        n = jnp.asarray(count, jnp.float32)
        # lr_0 = 0 (the default) adds 0.0 to (lr_max * n) / W: the values of the plain ramp, bit for bit
        return jnp.where(n < warmup, start + (op.lr - start) * n / max(warmup, 1), after(n))
    return schedule


def _after_warmup(cfg: Config, warmup: int, length: int):
    """lr(n) for n >= W (module doc), as a function of n in float32."""
    op = cfg.optim
    top, floor, end = op.lr, op.min_lr, warmup + length
    if op.decay_style == "constant":
        return lambda n: jnp.full_like(n, top)
    if op.decay_style == "inverse_square_root":
        def curve(n):
            return jnp.maximum(floor, top * math.sqrt(max(warmup, 1)) / jnp.sqrt(jnp.maximum(n, 1.0)))
    else:   # linear is wsd with the whole decay as its final phase and the linear shape
        final, shape = ((length, "linear") if op.decay_style == "linear"
                        else (op.wsd_decay_steps, op.wsd_decay_style))
        start = end - final

        def curve(n):
            # q clipped to [0, 1]: before the final phase c(0) = 1 holds lr_max (a final phase of
            # 0 steps, too); past D the floor below takes over
            q = jnp.clip((n - start) / max(final, 1), 0.0, 1.0)
            return floor + (top - floor) * CURVES[shape](q)
    return lambda n: jnp.where(n > end, floor, curve(n))

"""Dropout whose randomness follows Megatron's rule for tensor parallelism.

Inside a split region (attention heads, or [b, s/t, h] shards with sequence
parallelism) each tensor rank holds different activations, so it draws its
own mask (key folded with the tensor rank). Where activations are replicated
over `tensor`, every rank draws the same mask, so the model is the same
function for any tensor size.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.parallel.tensor_ops import tensor_rank


def dropout_key(module: nn.Module, t: int, split: bool):
    """The module's next dropout key, folded with the tensor rank inside a split region."""
    key = module.make_rng("dropout")
    return jax.random.fold_in(key, tensor_rank(t)) if split and t > 1 else key


def apply_dropout(key, x, rate: float):
    """Inverted dropout: keep with probability 1 - rate and scale by 1 / (1 - rate), in x's dtype.
    The backward keeps the mask, one byte per element (bool)."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def dropout(module: nn.Module, x, rate: float, deterministic: bool, t: int, split: bool):
    """`apply_dropout` with the module's key; x itself when deterministic or rate is 0."""
    if deterministic or rate == 0.0:
        return x
    return apply_dropout(dropout_key(module, t, split), x, rate)

"""Dropout whose randomness follows Megatron's rule for tensor parallelism.

Inside a split region (attention heads, or [b, s/t, h] shards with sequence
parallelism) each tensor rank holds different activations, so it draws its
own mask (key folded with the tensor rank). Where activations are replicated
over `tensor`, every rank draws the same mask, so the model is the same
function for any tensor size. Context ranks hold different tokens, so the hidden
dropout folds the context rank in too (`dropout`'s `context`); attention dropout
keeps one key over `context` and draws by true position (`attention_dropout.py`).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mtjax.parallel.context_ops import context_rank
from mtjax.parallel.tensor_ops import tensor_rank


def dropout_key(module: nn.Module, t: int, split: bool):
    """The module's next dropout key, folded with the tensor rank inside a split region."""
    key = module.make_rng("dropout")
    return jax.random.fold_in(key, tensor_rank(t)) if split and t > 1 else key


def keep_mask(key, shape, keep: float):
    """A Bernoulli(keep) mask of `shape` that depends on `key` and `shape` only: 32 random bits
    per element from XLA's Philox4x32-10 generator (RngBitGenerator), whose 128-bit state is drawn
    from `key` (threefry, 4 words), and an element is kept where its bits < keep 2^32.

    Not `jax.random.bernoulli`: its threefry bits cost about 250 integer operations an element
    as XLA expands them (20 rounds of 32-bit adds, rotations and xors for every pair), which made
    each dropout an ALU-bound kernel on an H100; Philox costs about 15 per 32 bits. The same
    (key, shape) gives the same mask on every backend, in every recompute mode (a recomputation
    draws again from the same key) and on every layout (the keys follow `dropout_key`'s rule)."""
    state = jax.random.bits(key, (4,), jnp.uint32)
    _, bits = lax.rng_bit_generator(state, shape, dtype=jnp.uint32, algorithm=lax.RandomAlgorithm.RNG_PHILOX)
    return bits < jnp.uint32(min(int(keep * 2 ** 32), 2 ** 32 - 1))


def apply_dropout(key, x, rate: float):
    """Inverted dropout: keep with probability 1 - rate and scale by 1 / (1 - rate), in x's dtype.
    The backward keeps the mask, one byte per element (bool)."""
    keep = keep_mask(key, x.shape, 1.0 - rate)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def dropout(module: nn.Module, x, rate: float, deterministic: bool, t: int, split: bool, context: int = 1):
    """`apply_dropout` with the module's key (folded with the context rank when `context` > 1: the
    ranks hold different tokens); x itself when deterministic or rate is 0."""
    if deterministic or rate == 0.0:
        return x
    key = dropout_key(module, t, split)
    return apply_dropout(jax.random.fold_in(key, context_rank(context)) if context > 1 else key, x, rate)

"""Choosing the next token from the logits: greedy, or sampled with temperature, top-k and top-p.

Shape legend: b rows, V the vocabulary (unpadded). With temperature T > 0 the token is drawn from
softmax(z / T) restricted, in this order (as transformers' warpers do), to
    top-k: the k largest logits (every logit equal to the k-th stays too),
    top-p: the smallest set of the largest that holds probability >= p (nucleus sampling,
           Holtzman et al. 2019), measured after top-k; the largest logit always stays.
T = 0 is greedy (argmax, the lowest id among equal maxima). The logits are scaled as
(z - max z) / T, the same distribution as z / T (softmax is shift-invariant), so that a tiny T
cannot overflow: z / T for T = 1e-38 made every positive logit +inf, and the draw then took the
lowest id among them, outside top-k and not the argmax; shifted, the maxima are 0 and the rest
-inf, which is greedy, the limit as T -> 0. The settings are traced values, so changing them
recompiles nothing; top-k = V and top-p = 1 switch the filters off.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def filter_logits(z, top_k, top_p):
    """z [b, V] with the logits outside top-k, then outside top-p, set to -inf."""
    ranked = jnp.sort(z, axis=-1)[:, ::-1]                                   # [b, V], descending
    k = jnp.clip(top_k, 1, z.shape[-1])
    kth = jax.lax.dynamic_index_in_dim(ranked, k - 1, axis=1)                # [b, 1]
    z = jnp.where(z >= kth, z, NEG_INF)
    ranked = jnp.where(ranked >= kth, ranked, NEG_INF)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs          # probability of the larger ones
    keep = (before < top_p) | (top_p >= 1.0)
    keep = keep.at[:, 0].set(True)                       # the largest, whatever p
    smallest = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)   # [b, 1]
    return jnp.where(z >= smallest, z, NEG_INF)


def next_tokens(logits, key, temperature, top_k, top_p, rows=None):
    """logits [b, V] (fp32) -> token ids [b] (int32): greedy when temperature == 0, else sampled
    from the filtered softmax(logits / temperature), row r with the key fold_in(key, rows[r])
    (rows default 0 .. b - 1), so a row's draw does not depend on the rows beside it."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    rows = jnp.arange(logits.shape[0]) if rows is None else rows
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)          # <= 0: no overflow (module doc)
    z = filter_logits(shifted / jnp.where(temperature > 0, temperature, 1.0), top_k, top_p)
    draw = lambda r, row: jax.random.categorical(jax.random.fold_in(key, r), row)   # noqa: E731
    sampled = jax.vmap(draw)(rows, z).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)

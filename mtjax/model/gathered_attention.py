"""The all_gather core's fused route: this rank's two query chunks against the gathered keys in
three block calls that hold only causal work, merged through their log-sum-exp.

Shape legend: b batch, c context size, L = s/2c a chunk, k_r kv heads, g query heads per kv
head, d head dim. Q [b, 2L, k_r, g, d]: rank r's chunks A = r and B = 2c-1-r; K, V [b, 2cL, k_r, d]
gathered rank-major, rank j's rows its chunks F_j = j then S_j = 2c-1-j (`context_ops`).

Chunk A reads chunks 0 .. r-1 whole and itself causally; B reads 0 .. 2c-2-r whole and itself
causally. Those are, with every shape static whatever r is:
    prefix    B x (F_0, ..., F_{c-1})      full, L x cL           (every F_j precedes B)
    diagonal  (A, B) x (F_r, S_r)          causal, a batch of 2   (each chunk against itself)
    rest      m = 0 .. c-2: A x F_m if m < r, else B x S_{m+1}    full, a batch of c-1 L x L
The rest is A against the first chunks of the ranks before r and B against the second chunks of
the ranks after it: c - 1 blocks whatever r is. Per rank that is c + 1 + (c - 1) = 2c L x L blocks
(the diagonal's two halves one), the causal work s^2/2c; the dense-mask call it replaces computed 4c.
Each block gives (O_i, lse_i); A's and B's rows merge over the blocks they read
(`attention_blocks.merge`; a rest block of the other chunk weighs 0). The backward runs each
block's backward with the merged O and lse (`attention_blocks.block_backward`) and sends dQ, dK,
dV back through the (linear) gathers that built the blocks' operands.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.model.attention_blocks import block_backward, block_forward, merge
from mtjax.parallel.context_ops import context_rank, gather_from_context_region

F32 = jnp.float32


def gathered_attention(q, k, v, c: int, kernel: str):
    """Causal attention of this rank's rows against every rank's K, V (module docstring): q
    [b, 2L, k_r, g, d], k/v [b, 2L, k_r, d] this rank's -> [b, 2L, k_r, g, d] in v's dtype.
    kernel: "cudnn" (cuDNN per block) or "xla" (einsums per block). K and V are all-gathered
    inside; the backward keeps Q, K, V (this rank's), O and the fp32 lse, as the ring does,
    gathers K, V again and reduce-scatters dK, dV."""
    return _attend(q, k, v, c, kernel)


def _query_side(x, r, c: int):
    """A [b, 2L, ...] tensor of this rank's rows -> its rows in the three blocks: prefix [b, L]
    (B), diagonal [2b, L] (A, B), rest [(c-1) b, L] (A for m < r, else B)."""
    b, two_l = x.shape[:2]
    a, bb = x[:, :two_l // 2], x[:, two_l // 2:]
    first = (jnp.arange(c - 1) < r).reshape(-1, *(1,) * a.ndim)                # [c-1, 1, ...]
    rest = jnp.where(first, a[None], bb[None])                                 # [c-1, b, L, ...]
    return bb, jnp.concatenate([a, bb]), rest.reshape(-1, *a.shape[1:])


def _key_side(x, r, c: int):
    """Gathered K or V [b, 2cL, k_r, d] -> the three blocks' keys: prefix [b, cL] (every F_j),
    diagonal [2b, L] (F_r, S_r), rest [(c-1) b, L] (F_m for m < r, else S_{m+1})."""
    b, s = x.shape[:2]
    chunks = x.reshape(b, c, 2, s // (2 * c), *x.shape[2:])                    # [b, c, 2, L, k_r, d]
    firsts, seconds = chunks[:, :, 0], chunks[:, :, 1]                         # [b, c, L, k_r, d]
    own = lax.dynamic_index_in_dim(chunks, r, axis=1, keepdims=False)          # [b, 2, L, k_r, d]
    first = (jnp.arange(c - 1) < r).reshape(1, -1, 1, 1, 1)
    rest = jnp.where(first, firsts[:, :-1], seconds[:, 1:])                    # [b, c-1, L, k_r, d]
    rest = jnp.moveaxis(rest, 1, 0).reshape(-1, *rest.shape[2:])               # [(c-1) b, L, k_r, d]
    return firsts.reshape(b, -1, *x.shape[2:]), jnp.concatenate([own[:, 0], own[:, 1]]), rest


CAUSAL = (False, True, False)                                                  # prefix, diagonal, rest


def _forward(q, k_local, v_local, c: int, kernel: str):
    r = context_rank(c)
    b, two_l = q.shape[:2]
    k, v = gather_from_context_region(k_local, c), gather_from_context_region(v_local, c)  # [b, 2L|2cL, ..]
    parts = [block_forward(qi, ki, vi, causal, kernel) for qi, ki, vi, causal in
             zip(_query_side(q, r, c), _key_side(k, r, c), _key_side(v, r, c), CAUSAL)]
    (o_p, lse_p), (o_d, lse_d), (o_r, lse_r) = parts
    first = (jnp.arange(c - 1) < r).reshape(-1, 1, 1, 1, 1)                    # [c-1, 1, 1, 1, 1]
    o_r = o_r.reshape(c - 1, b, *o_r.shape[1:])                                # [c-1, b, L, k_r, g, d]
    lse_r = lse_r.reshape(c - 1, b, *lse_r.shape[1:])                          # [c-1, b, L, k_r, g]
    rest_a = [(o_r[m], jnp.where(first[m], lse_r[m], -jnp.inf)) for m in range(c - 1)]
    rest_b = [(o_r[m], jnp.where(first[m], -jnp.inf, lse_r[m])) for m in range(c - 1)]
    out_a, lse_a = merge([(o_d[:b], lse_d[:b]), *rest_a])
    out_b, lse_b = merge([(o_p, lse_p), (o_d[b:], lse_d[b:]), *rest_b])
    out = jnp.concatenate([out_a, out_b], axis=1).astype(v.dtype)
    return out, (q, k_local, v_local, out, jnp.concatenate([lse_a, lse_b], axis=1))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attend(q, k, v, c: int, kernel: str):
    return _forward(q, k, v, c, kernel)[0]


def _backward(c: int, kernel: str, residuals, d_out):
    """Each block's backward from the merged rows; dQ, dK, dV through the operand gathers' transposes
    (summed in fp32), dK, dV then reduce-scattered over `context` (the all-gather's transpose)."""
    q, k_local, v_local, out, lse = residuals
    r = context_rank(c)
    k, pull_k = jax.vjp(lambda x: gather_from_context_region(x, c), k_local)   # [b, 2L -> 2cL, k_r, d]
    v, pull_v = jax.vjp(lambda x: gather_from_context_region(x, c), v_local)
    sides = [_query_side(q, r, c), _key_side(k, r, c), _key_side(v, r, c)]
    rows = zip(_query_side(d_out, r, c), _query_side(out, r, c), _query_side(lse, r, c))
    grads = [block_backward(qi, ki, vi, causal, kernel, row) for qi, ki, vi, causal, row in
             zip(*sides, CAUSAL, rows)]
    back = []                                     # the blocks' shares summed in fp32, then cast
    for x, side, part in zip((q, k, v), (_query_side, _key_side, _key_side), zip(*grads)):
        pull = jax.linear_transpose(lambda y, side=side: side(y, r, c), jax.ShapeDtypeStruct(x.shape, F32))
        back.append(pull(tuple(g.astype(F32) for g in part))[0].astype(x.dtype))
    dq, dk, dv = back
    return dq, pull_k(dk)[0], pull_v(dv)[0]


_attend.defvjp(_forward, _backward)

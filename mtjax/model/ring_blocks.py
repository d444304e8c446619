"""One block of ring attention (`context_attention.py`): a query chunk against one key/value
chunk, its partial softmax (o, lse), its backward from the merged lse, and its mask.

Shape legend: b micro-batch, s_l = s/c a context rank's rows, T query rows, S' key rows of the
block, k_r kv heads on this rank, g query heads per kv head, d head dim. A mask is [T, S'] (causal,
the same for every row), [b, T, S'] (packed rows: cut to one document, `model/documents.py`) or
None (the whole block). A block's attention dropout (`attention_dropout.AttentionDropout`, None: none) is placed at its
true positions; its backward draws the mask again (`attention_blocks.grads_from_scores`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.model.attention_blocks import grads_from_scores
from mtjax.model.attention_dropout import on
from mtjax.model.documents import same_document
from mtjax.parallel.context_ops import chunk_positions

F32 = jnp.float32
NEG = jnp.finfo(F32).min            # a masked score: exp(NEG - lse) = 0, and no inf - inf


def causal(rows: int, offset: int):
    """[rows, offset + rows]: query row i reads key j <= i + offset (a diagonal block after
    `offset` keys it reads whole)."""
    return jnp.arange(offset + rows)[None, :] <= jnp.arange(rows)[:, None] + offset


def cut_to_documents(static, docs, q_rows: slice, k_rows: slice):
    """A block's mask: `static` [T, S'] (None: the whole block) and, for packed rows (docs = the
    queries' and the keys' segment ids [b, s_l] each), same document at these rows -> [T, S'],
    [b, T, S'] or None."""
    if docs is None:
        return static
    same = same_document(docs[0][:, q_rows], docs[1][:, k_rows])
    return same if static is None else same & static[None]


def placed(drop, q, c: int, r, j):
    """The attention dropout (None: none) at rank r's query rows q [b, s_l, ...] against rank j's
    kv rows: batch rows [b], true positions [s_l] each (`context_ops.chunk_positions`)."""
    if drop is None:
        return None
    s = q.shape[1] * c
    return drop.at(jnp.arange(q.shape[0]), chunk_positions(s, c, r), chunk_positions(s, c, j))


def cut_dropout(drop, q_rows: slice, k_rows: slice):
    """A block's part of `placed`'s dropout (None: none)."""
    return None if drop is None else drop.cut(q_rows, k_rows)


def _scores(q, k, mask):
    """S = Q K^T / sqrt(d) in fp32: q [b, T, k_r, g, d], k [b, S', k_r, d] -> [b, k_r, g, T, S']."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=F32) / jnp.sqrt(F32(q.shape[-1]))
    if mask is None:
        return s
    return jnp.where(mask[None, None, None] if mask.ndim == 2 else mask[:, None, None], s, NEG)


def block(q, k, v, mask=None, drop=None):
    """One block: o = softmax(S) V over these keys [b, T, k_r, g, d] fp32 (P dropped by `drop`),
    lse = log sum_j e^S_j [b, T, k_r, g] fp32. A document mask ([b, T, S']) may leave a query row
    no key in the block: its o is 0 and its lse -inf (it merges as nothing)."""
    s = _scores(q, k, mask)                                                    # [b, k_r, g, T, S']
    lse = jax.nn.logsumexp(s, axis=-1)                                         # [b, k_r, g, T]
    p = jnp.exp(s - lse[..., None])
    if mask is not None and mask.ndim == 3:
        p = jnp.where(mask[:, None, None], p, 0.0)
        lse = jnp.where(jnp.any(mask, axis=-1)[:, None, None], lse, -jnp.inf)
    o = jnp.einsum("bkgqs,bskd->bqkgd", on(drop, p).astype(v.dtype), v, preferred_element_type=F32)
    return o, lse.transpose(0, 3, 1, 2)


def empty(q):
    """A block with no pair: o 0, lse -inf over q's rows."""
    return jnp.zeros(q.shape, F32), jnp.full(q.shape[:-1], -jnp.inf, F32)


def skippable_block(q, k, v, mask, drop=None):
    """`block`, skipped (`empty`) when a document mask holds no pair at all."""
    if mask is None or mask.ndim == 2:
        return block(q, k, v, mask, drop)
    return lax.cond(jnp.any(mask), block, lambda q, k, v, m, d: empty(q), q, k, v, mask, drop)


def block_grads(q, k, v, rows, mask=None, drop=None):
    """One block's backward from the global lse: rows = (dO [b, T, k_r, g, d], lse, D [b, T, k_r, g])
    -> dQ [b, T, k_r, g, d], dK, dV [b, S', k_r, d], all fp32 (the formulas in `context_attention`'s docstring)."""
    d_out, lse, delta = rows
    return grads_from_scores(q, k, v, _scores(q, k, mask), d_out, lse, delta, drop)   # S [b, k_r, g, T, S']


def skippable_grads(q, k, v, rows, mask, drop=None):
    """`block_grads`, skipped (all zeros) when a document mask holds no pair at all."""
    if mask is None or mask.ndim == 2:
        return block_grads(q, k, v, rows, mask, drop)

    def none(q, k, v, rows, mask, drop):
        return jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)
    return lax.cond(jnp.any(mask), block_grads, none, q, k, v, rows, mask, drop)


def merge(o, lse, o_i, lse_i):
    """Two partial softmaxes over disjoint keys -> the one over their union (lse_i = -inf: none)."""
    new = jnp.logaddexp(lse, lse_i)                                            # [b, T, k_r, g]
    return o * jnp.exp(lse - new)[..., None] + o_i * jnp.exp(lse_i - new)[..., None], new

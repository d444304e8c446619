"""Context attention for packed rows (`data.document_masking`): the causal mask cut to one document.

`context_attention.py` routes here when segment ids are given (`segments` [b, s], the whole row's,
`model/documents.py`); its own cores (the fused all_gather blocks, the ring's cuDNN or einsum
blocks) take no mask. Shape legend and the ring's layout as there: b micro-batch, s the row, c
context size, s_l = s/c this rank's rows, L = s/2c a chunk, k_r kv heads, g query heads per kv
head, d head dim.

all_gather_attention: K, V gathered along s (backward reduce-scatters dK, dV); every query reads
the gathered keys under "key position <= query position and same document", the keys' segment ids
read off the whole row at their true positions; "xla" the einsums (with dropout), "dot_product"
and "cudnn" `jax.nn.dot_product_attention` with that mask (cuDNN: a dense bias).

ring_attention: as the ring of `context_attention` (c steps, K/V passed on, flash attention's
merge and backward), its blocks the einsums of `ring_blocks.py` with every block's mask cut to
one document (the visiting rank j's rows read off the whole row, no extra send). A step's block
whose mask holds no same-document pair in any row is skipped by `lax.cond`, forward and
backward: exact, since such a block contributes o = 0, lse = -inf.

Attention dropout composes with both: the mask is drawn at the true (query, key) positions
(`attention_dropout.py`), the same bits as c = 1's, whatever the document cut; a skipped block
draws nothing and needs nothing.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.model.core_attention import einsum_attention, fused_attention, masked_attention
from mtjax.model.documents import same_document
from mtjax.model.ring_blocks import (F32, block, block_grads, causal, cut_dropout, cut_to_documents, merge,
                                     placed, skippable_block, skippable_grads)
from mtjax.parallel.context_ops import (all_positions, chunk_positions, context_positions, context_rank,
                                        gather_from_context_region, pass_to_next_rank, split_row)


def all_gather_attention(q, k, v, c: int, kernel: str, dropout_key, rate: float, segments):
    """O = softmax(Q K^T / sqrt(d) + causal mask) V with K, V gathered over `context`: q
    [b, s_l, k_r, g, d], k/v [b, s_l, k_r, d] -> [b, s_l, k_r, g, d]. kernel "xla" (the einsums,
    dropout on P with `dropout_key`, the same on every context rank: drawn at true positions), "dot_product"
    or "cudnn" (`jax.nn.dot_product_attention` with the mask; no dropout). Packed rows:
    `segments` [b, s], the whole row's (`model/documents.py`): the gathered keys' own segment
    ids (at their true positions) cut the mask to one document."""
    if c == 1:
        if kernel == "xla":
            return einsum_attention(q, k, v, dropout_key, rate, segments=segments)
        return fused_attention(q, k, v, kernel, segments)
    b, s_l, kv, g, d = q.shape
    k = gather_from_context_region(k, c)                  # [b, s_l, k_r, d] -> [b, s, k_r, d] rank-major
    v = gather_from_context_region(v, c)                  # (backward: reduce-scatter dK, dV)
    keys = all_positions(s_l * c, c).reshape(-1)          # [s] the gathered rows' true positions
    queries = context_positions(s_l, c)                                        # [s_l]
    mask = (keys[None, :] <= queries[:, None])[None]                           # [1, s_l, s]
    if segments is not None:
        mask = mask & same_document(split_row(segments, c), jnp.take(segments, keys, axis=1))   # [b, s_l, s]
    if kernel == "xla":
        return masked_attention(q, k, v, mask, dropout_key, rate, queries, keys)
    out = jax.nn.dot_product_attention(q.reshape(b, s_l, kv * g, d), k, v, mask=mask[:, None],
                                       implementation="cudnn" if kernel == "cudnn" else "xla")
    return out.reshape(b, s_l, kv, g, d)


def ring_attention(q, k, v, c: int, by_all_to_all: bool, segments, drop=None):
    """O = softmax(Q K^T / sqrt(d) + causal mask) V with K, V passed around the `context` ring
    (module docstring): q [b, s_l, k_r, g, d], k/v [b, s_l, k_r, d] -> [b, s_l, k_r, g, d] in v's
    dtype; softmax statistics and accumulation in fp32. `by_all_to_all`: each ring step as an
    all-to-all (`context_ops.pass_to_next_rank`: XLA:CPU inside a pipeline stage). Packed rows
    (`segments` [b, s], the whole row's): every block's mask is also cut to one document, and a
    step's block whose mask holds no (query, key) pair of one document at all, in any row of the
    micro-batch, is skipped (`lax.cond`; its contribution is exactly none). `drop`: attention
    dropout (`attention_dropout.AttentionDropout`, no block placed; None: none). c > 1
    (`context_attention.ring_attention` takes c = 1 to the plain core)."""
    return _ring(q, k, v, segments, drop, c, by_all_to_all)


# the three kinds of step: (q, kv [2, b, s_l, k_r, d], docs, drop) -> o, lse over all s_l rows ---
# docs: None, or the segment ids [b, s_l] of this rank's queries and of the kv's rows (packed rows);
# drop: None, or the attention dropout placed at the same rows (`ring_blocks.placed`)
ALL = slice(None)


def _halves(q):
    L = q.shape[1] // 2
    return slice(None, L), slice(L, None)


def _own(q, kv, docs=None, drop=None):
    """j = r: q chunk r x kv chunk r (causal); q chunk 2c-1-r x kv chunks r (full), 2c-1-r (causal)."""
    L = q.shape[1] // 2
    first, second = _halves(q)
    k, v = kv
    o0, lse0 = block(q[:, first], k[:, first], v[:, first], cut_to_documents(causal(L, 0), docs, first, first),
                     cut_dropout(drop, first, first))
    o1, lse1 = block(q[:, second], k, v, cut_to_documents(causal(L, L), docs, second, ALL),
                     cut_dropout(drop, second, ALL))                                          # [b, L, ...]
    return jnp.concatenate([o0, o1], axis=1), jnp.concatenate([lse0, lse1], axis=1)


def _earlier(q, kv, docs=None, drop=None):
    """j < r: both q chunks x kv chunk j (kv chunk 2c-1-j is later than both)."""
    first, _ = _halves(q)
    return skippable_block(q, kv[0, :, first], kv[1, :, first], cut_to_documents(None, docs, ALL, first),
                           cut_dropout(drop, ALL, first))


def _later(q, kv, docs=None, drop=None):
    """j > r: q chunk 2c-1-r x both kv chunks (q chunk r precedes both: lse -inf)."""
    _, second = _halves(q)
    o1, lse1 = skippable_block(q[:, second], kv[0], kv[1], cut_to_documents(None, docs, second, ALL),
                               cut_dropout(drop, second, ALL))                                # [b, L, ...]
    return (jnp.concatenate([jnp.zeros_like(o1), o1], axis=1),
            jnp.concatenate([jnp.full_like(lse1, -jnp.inf), lse1], axis=1))


def _docs(segments, c: int, j):
    """Packed rows: (this rank's query segment ids, rank j's kv rows' ones) [b, s_l] each, read
    off the whole row's `segments` [b, s] (no communication); None without."""
    if segments is None:
        return None
    return split_row(segments, c), jnp.take(segments, chunk_positions(segments.shape[1], c, j), axis=1)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, segments, drop, c: int, by_all_to_all: bool):
    return _ring_forward(q, k, v, segments, drop, c, by_all_to_all)[0]


def _ring_forward(q, k, v, segments, drop, c: int, by_all_to_all: bool):
    """c steps; the K/V pair moves one rank on between them (c - 1 collective-permutes)."""
    r = context_rank(c)
    kv = jnp.stack([k, v])                                                     # [2, b, s_l, k_r, d]
    o, lse = _own(q, kv, _docs(segments, c, r), placed(drop, q, c, r, r))     # [b, s_l, k_r, g, (d)]
    for i in range(1, c):
        kv = pass_to_next_rank(kv, c, 1, by_all_to_all)   # [2, b, s_l, k_r, d] now rank (r - i) mod c's
        j = (r - i) % c
        o_i, lse_i = lax.cond(j < r, _earlier, _later, q, kv, _docs(segments, c, j), placed(drop, q, c, r, j))
        o, lse = merge(o, lse, o_i, lse_i)
    out = o.astype(v.dtype)
    return out, (q, k, v, segments, drop, out, lse)


# the backward's three kinds of step: (q, rows, kv, docs) -> dQ [b, s_l, k_r, g, d], dKV [2, b, s_l, k_r, d]
def _own_grads(q, rows, kv, docs=None, drop=None):
    L = q.shape[1] // 2
    first, second = _halves(q)
    k, v = kv
    dq0, dk0, dv0 = block_grads(q[:, first], k[:, first], v[:, first], [x[:, first] for x in rows],
                                 cut_to_documents(causal(L, 0), docs, first, first), cut_dropout(drop, first, first))
    dq1, dk, dv = block_grads(q[:, second], k, v, [x[:, second] for x in rows],
                               cut_to_documents(causal(L, L), docs, second, ALL), cut_dropout(drop, second, ALL))
    dkv = jnp.stack([dk.at[:, :L].add(dk0), dv.at[:, :L].add(dv0)])
    return jnp.concatenate([dq0, dq1], axis=1), dkv


def _earlier_grads(q, rows, kv, docs=None, drop=None):
    first, _ = _halves(q)
    dq, dk0, dv0 = skippable_grads(q, kv[0, :, first], kv[1, :, first], rows,
                                    cut_to_documents(None, docs, ALL, first), cut_dropout(drop, ALL, first))
    dkv = jnp.stack([dk0, dv0])                                                # [2, b, L, k_r, d]
    return dq, jnp.concatenate([dkv, jnp.zeros_like(dkv)], axis=2)


def _later_grads(q, rows, kv, docs=None, drop=None):
    _, second = _halves(q)
    dq1, dk, dv = skippable_grads(q[:, second], kv[0], kv[1], [x[:, second] for x in rows],
                                   cut_to_documents(None, docs, second, ALL), cut_dropout(drop, second, ALL))
    return jnp.concatenate([jnp.zeros_like(dq1), dq1], axis=1), jnp.stack([dk, dv])


def _ring_backward(c: int, by_all_to_all: bool, residuals, d_out):
    """K/V go round again, the other way (sends unlike the forward's, which XLA could otherwise
    merge with them and so keep every received chunk until the backward), the dK/dV accumulator
    [2, b, s_l, k_r, d] fp32 travelling with them; one send after the last step takes it home
    (c - 1 + c permutes)."""
    q, k, v, segments, drop, out, lse = residuals
    r = context_rank(c)
    delta = jnp.sum(d_out.astype(F32) * out.astype(F32), axis=-1)             # D [b, s_l, k_r, g]
    rows = (d_out, lse, delta)
    kv = jnp.stack([k, v])                                                     # [2, b, s_l, k_r, d]
    dq, dkv = _own_grads(q, rows, kv, _docs(segments, c, r), placed(drop, q, c, r, r))
    for i in range(1, c):
        kv = pass_to_next_rank(kv, c, -1, by_all_to_all)    # [2, b, s_l, k_r, d] rank (r + i) mod c's
        dkv = pass_to_next_rank(dkv, c, -1, by_all_to_all)  # [2, b, s_l, k_r, d] fp32: that kv's dK, dV so far
        j = (r + i) % c
        dq_i, dkv_i = lax.cond(j < r, _earlier_grads, _later_grads, q, rows, kv, _docs(segments, c, j),
                               placed(drop, q, c, r, j))
        dq, dkv = dq + dq_i, dkv + dkv_i
    dkv = pass_to_next_rank(dkv, c, -1, by_all_to_all)  # [2, b, s_l, k_r, d]: rank r - 1's, sent home
    # segment ids and the dropout's seed and positions are integers: no cotangent
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None


_ring.defvjp(_ring_forward, _ring_backward)

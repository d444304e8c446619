"""Causal attention across the `context` axis: each rank's queries against the whole sequence.

Shape legend: b micro-batch, s the whole row, c context size, s_l = s/c this rank's rows,
L = s/2c a chunk, k_r kv heads on this rank, g query heads per kv head, d head dim.
Q [b, s_l, k_r, g, d], K and V [b, s_l, k_r, d] -> O [b, s_l, k_r, g, d]: the rank's two chunks,
r then 2c - 1 - r (`context_ops`); O is exactly causal attention over the whole row (true
positions) at these query rows. Both run inside `shard_map` with `context` manual
(`check_vma=False`); at c = 1 both are today's core (`core_attention`) with no collective.

all_gather_attention (Megatron's --cp-comm-type all_gather): K and V, the k_r kv heads and not the
a query heads, are all-gathered along s (`gather_from_context_region`: backward reduce-scatters dK,
dV) and every query reads the s keys under the mask key position <= query position (keys
rank-major, `all_positions`). The gather happens inside this function, so a caller that wraps it
in `saving_inputs_only` (selective recomputation) keeps only the local Q, K, V.

ring_attention (Megatron's p2p, ring attention): the K/V pair travels around the ring, c steps;
at step i rank r holds rank j = (r - i) mod c's chunks j and 2c - 1 - j, and only the blocks the
causal mask leaves non-empty are computed:
    j = r  (step 0)   q chunk r x kv chunk r (causal), q chunk 2c-1-r x both (full | causal)
    j < r             both q chunks x kv chunk j                    (two full L x L blocks)
    j > r             q chunk 2c-1-r x both kv chunks                (two full L x L blocks)
Each step gives a block result O_i (softmax over its own keys) and its log-sum-exp lse_i [fp32];
they merge as lse = log(e^lse_a + e^lse_i), O = e^(lse_a - lse) O_a + e^(lse_i - lse) O_i.
The backward (flash attention's) keeps Q, K, V, O, lse; K, V go round again (the other way) with
the dK, dV accumulators (home after c sends), and each block recomputes P = exp(S - lse):
    dV += P^T dO,  dP = dO V^T,  D = rowsum(dO * O),  dS = P (dP - D),
    dQ += dS K / sqrt(d),  dK += dS^T Q / sqrt(d).
The backward's ring turns the other way: its sends then differ from the forward's, which XLA
would otherwise merge with them when both sit in one program (XLA:CPU drops optimization
barriers before CSE), keeping every received chunk from the forward to the backward. The ring
keeps only what selective recomputation would keep (plus O and lse), so it needs no
`saving_inputs_only` around it (that would run the forward's ring a second time).

`jax.nn.dot_product_attention` in jax 0.10.2 (jax/_src/nn/functions.py, jax/_src/cudnn/):
  * mask: a bool array broadcastable to [B, N, T, S]; `implementation="xla"` applies it with
    `where`; "cudnn" turns it into an additive bias (0 / a large negative, `combine_bias_and_mask`)
    of that shape, so the kernel reads a dense T x S bias and skips nothing, and its backward
    always computes a dBias (`should_export_dbias` returns True). A bias in training needs T, S
    even. `is_causal` is cuDNN's CAUSAL mask type (top-left aligned, tiles above it skipped).
  * local_window_size (l, r): cuDNN takes only a left window (r = 0, or any r with is_causal), as
    `sliding_window_length` l + 1.  query_/key_value_seq_lengths: padding masks.
  * GQA: K, V with K < N heads, N a multiple of K (the layout check only asks kN == vN).
  * cuDNN: fp16/bf16 (fp8) only, d a multiple of 8 up to 128 (256 from Hopper).
  * return_residual=True returns (O, lse) [B, T, N]: cuDNN's fp32 softmax statistics, cast to O's
    dtype and transposed; the xla path returns `stop_gradient(lse)` in K's dtype. Its gradient
    cannot serve a ring: the cuDNN backward drops the lse cotangent (`grad_output[0]`) and the
    xla path stops it, while merging blocks through lse needs d lse. A cuDNN ring would call the
    forward per block for (O_i, lse_i) and write the backward by hand, calling cuDNN's backward
    primitive per block with the merged O and fp32 lse (TransformerEngine's way): private API
    (`_dot_product_attention_bwd_p_wrapper`), and the public lse comes back in 16 bits.
So the all_gather "dot_product"/"cudnn" kernels pass the mask (cuDNN: a bias), and the ring's
blocks are the einsums here (`ring_blocks.py`).

Packed rows (`segments`, the whole row's document ids, `model/documents.py`): all_gather ANDs its
mask with "same document" for the gathered keys' true rows; the ring cuts every block's mask the
same way (the visiting rank's rows read off the whole row, no extra send) and skips, forward and
backward, each step's block that holds no same-document pair in any row (`lax.cond`, exact). Attention dropout (all_gather "xla" only) draws its mask from the
caller's key over this rank's [b, k_r, g, s_l, s] probabilities: the key must differ per context
rank, or the ranks drop the same pattern.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.model.core_attention import einsum_attention, fused_attention, masked_attention
from mtjax.model.documents import same_document
from mtjax.model.ring_blocks import (F32, block, block_grads, causal, cut_to_documents, merge, skippable_block,
                                     skippable_grads)
from mtjax.parallel.context_ops import (all_positions, chunk_positions, context_positions, context_rank,
                                        gather_from_context_region, pass_to_next_rank, split_row)



def all_gather_attention(q, k, v, c: int, kernel: str = "xla", dropout_key=None, rate: float = 0.0,
                         segments=None):
    """O = softmax(Q K^T / sqrt(d) + causal mask) V with K, V gathered over `context`: q
    [b, s_l, k_r, g, d], k/v [b, s_l, k_r, d] -> [b, s_l, k_r, g, d]. kernel "xla" (the einsums,
    dropout on P with `dropout_key`: the caller folds the context rank into it), "dot_product"
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
    mask = (keys[None, :] <= context_positions(s_l, c)[:, None])[None]        # [1, s_l, s]
    if segments is not None:
        mask = mask & same_document(split_row(segments, c), jnp.take(segments, keys, axis=1))   # [b, s_l, s]
    if kernel == "xla":
        return masked_attention(q, k, v, mask, dropout_key, rate)
    out = jax.nn.dot_product_attention(q.reshape(b, s_l, kv * g, d), k, v, mask=mask[:, None],
                                       implementation="cudnn" if kernel == "cudnn" else "xla")
    return out.reshape(b, s_l, kv, g, d)


def ring_attention(q, k, v, c: int, by_all_to_all: bool = False, segments=None):
    """O = softmax(Q K^T / sqrt(d) + causal mask) V with K, V passed around the `context` ring
    (module docstring): q [b, s_l, k_r, g, d], k/v [b, s_l, k_r, d] -> [b, s_l, k_r, g, d] in v's
    dtype; softmax statistics and accumulation in fp32. `by_all_to_all`: each ring step as an
    all-to-all (`context_ops.pass_to_next_rank`: XLA:CPU inside a pipeline stage). Packed rows
    (`segments` [b, s], the whole row's): every block's mask is also cut to one document, and a
    step's block whose mask holds no (query, key) pair of one document at all, in any row of the
    micro-batch, is skipped (`lax.cond`; its contribution is exactly none)."""
    if c == 1:
        return einsum_attention(q, k, v, segments=segments)
    return _ring(q, k, v, segments, c, by_all_to_all)


# the three kinds of step: (q, kv [2, b, s_l, k_r, d], docs) -> o, lse over all s_l rows -------
# docs: None, or the segment ids [b, s_l] of this rank's queries and of the kv's rows (packed rows)
ALL = slice(None)


def _halves(q):
    L = q.shape[1] // 2
    return slice(None, L), slice(L, None)


def _own(q, kv, docs=None):
    """j = r: q chunk r x kv chunk r (causal); q chunk 2c-1-r x kv chunks r (full), 2c-1-r (causal)."""
    L = q.shape[1] // 2
    first, second = _halves(q)
    k, v = kv
    o0, lse0 = block(q[:, first], k[:, first], v[:, first], cut_to_documents(causal(L, 0), docs, first, first))
    o1, lse1 = block(q[:, second], k, v, cut_to_documents(causal(L, L), docs, second, ALL))     # [b, L, ...]
    return jnp.concatenate([o0, o1], axis=1), jnp.concatenate([lse0, lse1], axis=1)


def _earlier(q, kv, docs=None):
    """j < r: both q chunks x kv chunk j (kv chunk 2c-1-j is later than both)."""
    first, _ = _halves(q)
    return skippable_block(q, kv[0, :, first], kv[1, :, first], cut_to_documents(None, docs, ALL, first))


def _later(q, kv, docs=None):
    """j > r: q chunk 2c-1-r x both kv chunks (q chunk r precedes both: lse -inf)."""
    _, second = _halves(q)
    o1, lse1 = skippable_block(q[:, second], kv[0], kv[1], cut_to_documents(None, docs, second, ALL))   # [b, L, ...]
    return (jnp.concatenate([jnp.zeros_like(o1), o1], axis=1),
            jnp.concatenate([jnp.full_like(lse1, -jnp.inf), lse1], axis=1))


def _docs(segments, c: int, j):
    """Packed rows: (this rank's query segment ids, rank j's kv rows' ones) [b, s_l] each, read
    off the whole row's `segments` [b, s] (no communication); None without."""
    if segments is None:
        return None
    return split_row(segments, c), jnp.take(segments, chunk_positions(segments.shape[1], c, j), axis=1)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q, k, v, segments, c: int, by_all_to_all: bool):
    return _ring_forward(q, k, v, segments, c, by_all_to_all)[0]


def _ring_forward(q, k, v, segments, c: int, by_all_to_all: bool):
    """c steps; the K/V pair moves one rank on between them (c - 1 collective-permutes)."""
    r = context_rank(c)
    kv = jnp.stack([k, v])                                                     # [2, b, s_l, k_r, d]
    o, lse = _own(q, kv, _docs(segments, c, r))                                # [b, s_l, k_r, g, (d)]
    for i in range(1, c):
        kv = pass_to_next_rank(kv, c, 1, by_all_to_all)   # [2, b, s_l, k_r, d] now rank (r - i) mod c's
        j = (r - i) % c
        o_i, lse_i = lax.cond(j < r, _earlier, _later, q, kv, _docs(segments, c, j))
        o, lse = merge(o, lse, o_i, lse_i)
    out = o.astype(v.dtype)
    return out, (q, k, v, segments, out, lse)


# the backward's three kinds of step: (q, rows, kv, docs) -> dQ [b, s_l, k_r, g, d], dKV [2, b, s_l, k_r, d]
def _own_grads(q, rows, kv, docs=None):
    L = q.shape[1] // 2
    first, second = _halves(q)
    k, v = kv
    dq0, dk0, dv0 = block_grads(q[:, first], k[:, first], v[:, first], [x[:, first] for x in rows],
                                 cut_to_documents(causal(L, 0), docs, first, first))
    dq1, dk, dv = block_grads(q[:, second], k, v, [x[:, second] for x in rows],
                               cut_to_documents(causal(L, L), docs, second, ALL))           # dk, dv [b, s_l, ...]
    dkv = jnp.stack([dk.at[:, :L].add(dk0), dv.at[:, :L].add(dv0)])
    return jnp.concatenate([dq0, dq1], axis=1), dkv


def _earlier_grads(q, rows, kv, docs=None):
    first, _ = _halves(q)
    dq, dk0, dv0 = skippable_grads(q, kv[0, :, first], kv[1, :, first], rows,
                                    cut_to_documents(None, docs, ALL, first))               # dk0, dv0 [b, L, ...]
    dkv = jnp.stack([dk0, dv0])                                                # [2, b, L, k_r, d]
    return dq, jnp.concatenate([dkv, jnp.zeros_like(dkv)], axis=2)


def _later_grads(q, rows, kv, docs=None):
    _, second = _halves(q)
    dq1, dk, dv = skippable_grads(q[:, second], kv[0], kv[1], [x[:, second] for x in rows],
                                   cut_to_documents(None, docs, second, ALL))
    return jnp.concatenate([jnp.zeros_like(dq1), dq1], axis=1), jnp.stack([dk, dv])


def _ring_backward(c: int, by_all_to_all: bool, residuals, d_out):
    """K/V go round again, the other way (sends unlike the forward's, which XLA could otherwise
    merge with them and so keep every received chunk until the backward), the dK/dV accumulator
    [2, b, s_l, k_r, d] fp32 travelling with them; one send after the last step takes it home
    (c - 1 + c permutes)."""
    q, k, v, segments, out, lse = residuals
    r = context_rank(c)
    delta = jnp.sum(d_out.astype(F32) * out.astype(F32), axis=-1)             # D [b, s_l, k_r, g]
    rows = (d_out, lse, delta)
    kv = jnp.stack([k, v])                                                     # [2, b, s_l, k_r, d]
    dq, dkv = _own_grads(q, rows, kv, _docs(segments, c, r))
    for i in range(1, c):
        kv = pass_to_next_rank(kv, c, -1, by_all_to_all)    # [2, b, s_l, k_r, d] rank (r + i) mod c's
        dkv = pass_to_next_rank(dkv, c, -1, by_all_to_all)  # its dK, dV accumulated so far (fp32)
        j = (r + i) % c
        dq_i, dkv_i = lax.cond(j < r, _earlier_grads, _later_grads, q, rows, kv, _docs(segments, c, j))
        dq, dkv = dq + dq_i, dkv + dkv_i
    dkv = pass_to_next_rank(dkv, c, -1, by_all_to_all)  # rank r - 1's, home
    # segment ids are integers: no cotangent
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None


_ring.defvjp(_ring_forward, _ring_backward)

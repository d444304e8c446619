"""Causal attention across the `context` axis: each rank's queries against the whole sequence.

Shape legend: b micro-batch, s the whole row, c context size, s_l = s/c this rank's rows,
L = s/2c a chunk, k_r kv heads on this rank, g query heads per kv head, d head dim.
Q [b, s_l, k_r, g, d], K and V [b, s_l, k_r, d] -> O [b, s_l, k_r, g, d]: the rank's two chunks,
r then 2c - 1 - r (`context_ops`); O is exactly causal attention over the whole row (true
positions) at these query rows. Both run inside `shard_map` with `context` manual
(`check_vma=False`); at c = 1 both are today's core (`core_attention`) with no collective.

all_gather_attention (Megatron's --cp-comm-type all_gather): K and V, the k_r kv heads and not the
a query heads, are all-gathered along s (`gather_from_context_region`: backward reduce-scatters dK,
dV) and every query reads the s keys under key position <= query position (keys rank-major,
`all_positions`). Kernel "xla": the einsums under that mask (attention dropout). "dot_product" and
"cudnn": three block calls holding only the causal work (`gathered_attention`: 2c L x L blocks
per rank, where the mask over s_l x s is 4c), cuDNN per block with "cudnn", the einsum blocks
otherwise. The gather happens inside this function, so a caller that wraps it in
`saving_inputs_only` (selective recomputation) keeps only the local Q, K, V.

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

Each block (`attention_blocks`) is the einsums ("xla") or cuDNN's flash attention ("cudnn", where
`model.attention` resolves to it), full or top-left causal. Why not `jax.nn.dot_product_attention`
(jax 0.10.2 and 0.11.2, jax/_src/nn/functions.py, jax/_src/cudnn/):
  * mask: "cudnn" turns a boolean mask into a dense additive bias of [B, N, T, S] (0 / a large
    negative, `combine_bias_and_mask`): the kernel reads it and skips no tile. The mask types are
    NO_MASK, PADDING, CAUSAL (top-left), PADDING_CAUSAL, ALIBI: no bottom-right causal, and
    local_window_size takes only a left window. So the load-balanced mask cannot be one causal
    call; it is full blocks plus diagonal (top-left causal) blocks, merged through their lse.
  * return_residual=True returns the lse cast to O's dtype (16 bits), and the gradient ignores
    the lse cotangent (cuDNN) or stops it (xla), while the merge needs it. So the blocks call
    jax's cuDNN attention one level down for the fp32 lse, and write the merge's backward: each
    block's cuDNN backward with the merged O and lse (`attention_blocks`).
  * cuDNN: fp16/bf16 (fp8) only, d a multiple of 8 up to 128 (256 from Hopper); GQA by K < N heads.
Attention dropout (the "xla" kernel, both kinds): the caller's key is the same on every context
rank, and each block of P draws its part of c = 1's mask at its true (query, key) positions
(`attention_dropout.py`); the ring's backward draws each block's part again:
    O_i = (P_i * Z) V with Z = M / keep,  dV += (P * Z)^T dO,  dP = (dO V^T) * Z,  dS = P (dP - D),
where D = rowsum(dO * O) still holds (O being the dropped output). A block's dropped output merges
as any other: the merge weighs O_i linearly, and dropout scales P's entries elementwise.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from mtjax.model.attention_blocks import block_backward, block_forward, cudnn_blocks, merge
from mtjax.model.attention_dropout import attention_dropout
from mtjax.model.core_attention import einsum_attention, fused_attention, masked_attention
from mtjax.model import packed_context
from mtjax.model.gathered_attention import gathered_attention
from mtjax.model.ring_blocks import cut_dropout, placed
from mtjax.parallel.context_ops import (all_positions, context_positions, context_rank,
                                        gather_from_context_region, pass_to_next_rank)

F32 = jnp.float32


def all_gather_attention(q, k, v, c: int, kernel: str = "xla", dropout_key=None, rate: float = 0.0,
                         segments=None):
    """O = softmax(Q K^T / sqrt(d) + causal mask) V with K, V gathered over `context`: q
    [b, s_l, k_r, g, d], k/v [b, s_l, k_r, d] -> [b, s_l, k_r, g, d]. kernel "xla" (the einsums,
    dropout on P with `dropout_key`, the same on every context rank: the mask is drawn at the
    true positions), "dot_product" or "cudnn" (`gathered_attention`'s causal blocks; no
    dropout). Packed rows (`segments` [b, s], the whole row's): the mask cut to one document
    (`packed_context.py`)."""
    if c == 1:
        if kernel == "xla":
            return einsum_attention(q, k, v, dropout_key, rate, segments=segments)
        return fused_attention(q, k, v, kernel, segments)
    if segments is not None:
        return packed_context.all_gather_attention(q, k, v, c, kernel, dropout_key, rate, segments)
    if kernel != "xla" and (kernel == "dot_product" or cudnn_blocks() is not None):
        return gathered_attention(q, k, v, c, "cudnn" if kernel == "cudnn" else "xla")  # causal blocks
    b, s_l, kv, g, d = q.shape
    k = gather_from_context_region(k, c)                  # [b, s_l, k_r, d] -> [b, s, k_r, d] rank-major
    v = gather_from_context_region(v, c)                  # (backward: reduce-scatter dK, dV)
    keys = all_positions(s_l * c, c).reshape(-1)          # [s] the gathered rows' true positions
    queries = context_positions(s_l, c)                                        # [s_l]
    mask = keys[None, :] <= queries[:, None]                                   # [s_l, s]
    if kernel == "xla":
        return masked_attention(q, k, v, mask[None], dropout_key, rate, queries, keys)
    out = jax.nn.dot_product_attention(q.reshape(b, s_l, kv * g, d), k, v, mask=mask[None, None],
                                       implementation="cudnn")  # a jax without the block calls
    return out.reshape(b, s_l, kv, g, d)


def ring_attention(q, k, v, c: int, by_all_to_all: bool = False, kernel: str = "xla", segments=None,
                   dropout_key=None, rate: float = 0.0):
    """O = softmax(Q K^T / sqrt(d) + causal mask) V with K, V passed around the `context` ring
    (module docstring): q [b, s_l, k_r, g, d], k/v [b, s_l, k_r, d] -> [b, s_l, k_r, g, d] in v's
    dtype; softmax statistics and accumulation in fp32. `by_all_to_all`: each ring step as an
    all-to-all (`context_ops.pass_to_next_rank`: XLA:CPU inside a pipeline stage). kernel: the
    blocks' (`attention_blocks`): "xla" the einsums, "cudnn" cuDNN's flash attention (no dropout).
    Packed rows (`segments` [b, s], the whole row's): `packed_context.ring_attention`, einsum blocks
    cut to one document, the steps without a same-document pair skipped. Dropout on P with
    `dropout_key` (the same on every context rank; module docstring)."""
    if c == 1:
        return einsum_attention(q, k, v, dropout_key, rate, segments=segments)
    drop = attention_dropout(dropout_key, rate)
    if drop is not None and kernel != "xla":
        raise ValueError(f"attention dropout runs on the xla blocks, not {kernel}")
    if segments is not None:
        return packed_context.ring_attention(q, k, v, c, by_all_to_all, segments, drop)
    return _ring(q, k, v, drop, c, by_all_to_all, kernel)


# step 0 (j = r): q chunk r x kv chunk r (causal); q chunk 2c-1-r x kv chunks r (full), 2c-1-r (causal)
# drop: None, or the dropout placed at (this rank's queries, the kv's rows) [2L] each
def _own(q, kv, kernel, drop=None):
    """-> (O fp32, lse) over the rank's 2L rows from its own kv chunks."""
    L = q.shape[1] // 2
    k, v = kv
    a, b = slice(None, L), slice(L, None)
    o0, lse0 = block_forward(q[:, a], k[:, a], v[:, a], True, kernel, cut_dropout(drop, a, a))   # [b, L, ...]
    o1, lse1 = merge([block_forward(q[:, b], k[:, a], v[:, a], False, kernel, cut_dropout(drop, b, a)),
                      block_forward(q[:, b], k[:, b], v[:, b], True, kernel, cut_dropout(drop, b, b))])
    return jnp.concatenate([o0.astype(F32), o1], axis=1), jnp.concatenate([lse0, lse1], axis=1)


def _own_grads(q, rows, kv, kernel, drop=None):
    L = q.shape[1] // 2
    k, v = kv
    a, b = slice(None, L), slice(L, None)
    first = [x[:, a] for x in rows]
    second = [x[:, b] for x in rows]
    dq0, dk0, dv0 = _grads(q[:, a], k[:, a], v[:, a], True, kernel, first, cut_dropout(drop, a, a))
    dq1, dk1, dv1 = _grads(q[:, b], k[:, a], v[:, a], False, kernel, second, cut_dropout(drop, b, a))
    dq2, dk2, dv2 = _grads(q[:, b], k[:, b], v[:, b], True, kernel, second, cut_dropout(drop, b, b))
    dkv = jnp.stack([jnp.concatenate([dk0 + dk1, dk2], axis=1), jnp.concatenate([dv0 + dv1, dv2], axis=1)])
    return jnp.concatenate([dq0, dq1 + dq2], axis=1), dkv


# a step j != r: two full L x L blocks, one call (a batch of 2):
#     first  (A if j < r else B) x F_j        second  B x (F_j if j < r else S_j)
# A = q chunk r, B = q chunk 2c-1-r, F_j, S_j = kv chunks j, 2c-1-j (module docstring's table).
def _stacked(drop, earlier):
    """The step's dropout on its two stacked blocks: rows [2b], positions [2b, L] each."""
    if drop is None:
        return None
    L, b = drop.queries.shape[0] // 2, drop.rows.shape[0]
    (qa, qb), (f, s) = (drop.queries[:L], drop.queries[L:]), (drop.keys[:L], drop.keys[L:])
    both = lambda x, y: jnp.repeat(jnp.stack([x, y]), b, axis=0)              # noqa: E731  [2b, L]
    return drop.at(jnp.tile(drop.rows, 2), both(jnp.where(earlier, qa, qb), qb), both(f, jnp.where(earlier, f, s)))


def _step(q, kv, earlier, kernel, drop=None):
    """(O [b, 2L, k_r, g, d] fp32, lse [b, 2L, k_r, g]) of the step's blocks, at -inf where none."""
    L = q.shape[1] // 2
    a, bq = q[:, :L], q[:, L:]
    qs = jnp.concatenate([jnp.where(earlier, a, bq), bq])                     # [2b, L, k_r, g, d]
    f, s = kv[:, :, :L], kv[:, :, L:]                                          # [2, b, L, k_r, d]
    ks = jnp.concatenate([f, jnp.where(earlier, f, s)], axis=1)                # [2, 2b, L, k_r, d]
    o, lse = block_forward(qs, ks[0], ks[1], False, kernel, _stacked(drop, earlier))
    n = q.shape[0]
    o1, o2, lse1, lse2 = o[:n].astype(F32), o[n:].astype(F32), lse[:n], lse[n:]
    none = jnp.full_like(lse1, -jnp.inf)
    o_b, lse_b = merge([(o1, jnp.where(earlier, none, lse1)), (o2, lse2)])
    return (jnp.concatenate([o1, o_b], axis=1),
            jnp.concatenate([jnp.where(earlier, lse1, none), lse_b], axis=1))


def _step_grads(q, rows, kv, earlier, kernel, drop=None):
    """The step's dQ [b, 2L, k_r, g, d] and dKV [2, b, 2L, k_r, d] (fp32)."""
    L = q.shape[1] // 2
    pick = lambda x: jnp.concatenate([jnp.where(earlier, x[:, :L], x[:, L:]), x[:, L:]])  # noqa: E731
    f, s = kv[:, :, :L], kv[:, :, L:]
    ks = jnp.concatenate([f, jnp.where(earlier, f, s)], axis=1)                # [2, 2b, L, k_r, d]
    dq, dk, dv = _grads(pick(q), ks[0], ks[1], False, kernel, [pick(x) for x in rows], _stacked(drop, earlier))
    n = q.shape[0]
    zero = jnp.zeros_like(dq[:n])
    dq = jnp.concatenate([jnp.where(earlier, dq[:n], zero), jnp.where(earlier, zero, dq[:n]) + dq[n:]], axis=1)
    dkv = jnp.stack([dk, dv])                                                  # [2, 2b, L, k_r, d]
    d1, d2 = dkv[:, :n], dkv[:, n:]
    zero = jnp.zeros_like(d2)
    return dq, jnp.concatenate([d1 + jnp.where(earlier, d2, zero), jnp.where(earlier, zero, d2)], axis=2)


def _merge(o, lse, o_i, lse_i):
    """Two partial softmaxes over disjoint keys -> the one over their union (lse_i = -inf: none)."""
    new = jnp.logaddexp(lse, lse_i)                                            # [b, s_l, k_r, g]
    return o * jnp.exp(lse - new)[..., None] + o_i * jnp.exp(lse_i - new)[..., None], new


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, drop, c: int, by_all_to_all: bool, kernel: str):
    return _ring_forward(q, k, v, drop, c, by_all_to_all, kernel)[0]


def _ring_forward(q, k, v, drop, c: int, by_all_to_all: bool, kernel: str):
    """c steps; the K/V pair moves one rank on between them (c - 1 collective-permutes)."""
    r = context_rank(c)
    kv = jnp.stack([k, v])                                                     # [2, b, s_l, k_r, d]
    o, lse = _own(q, kv, kernel, placed(drop, q, c, r, r))                    # [b, s_l, k_r, g, (d)]
    for i in range(1, c):
        kv = pass_to_next_rank(kv, c, 1, by_all_to_all)   # [2, b, s_l, k_r, d] now rank (r - i) mod c's
        j = (r - i) % c
        o, lse = _merge(o, lse, *_step(q, kv, j < r, kernel, placed(drop, q, c, r, j)))
    out = o.astype(v.dtype)
    return out, (q, k, v, drop, out, lse)


def _grads(q, k, v, causal, kernel, rows, drop=None):
    """A block's dQ, dK, dV from rows = (dO, O, lse), fp32."""
    return [x.astype(F32) for x in block_backward(q, k, v, causal, kernel, rows, drop)]


def _ring_backward(c: int, by_all_to_all: bool, kernel: str, residuals, d_out):
    """K/V go round again, the other way (sends unlike the forward's, which XLA could otherwise
    merge with them and so keep every received chunk until the backward), the dK/dV accumulator
    [2, b, s_l, k_r, d] fp32 travelling with them; one send after the last step takes it home
    (c - 1 + c permutes). Each block draws its dropout mask again."""
    q, k, v, drop, out, lse = residuals
    r = context_rank(c)
    rows = (d_out, out, lse)
    kv = jnp.stack([k, v])                                                     # [2, b, s_l, k_r, d]
    dq, dkv = _own_grads(q, rows, kv, kernel, placed(drop, q, c, r, r))
    for i in range(1, c):
        kv = pass_to_next_rank(kv, c, -1, by_all_to_all)    # [2, b, s_l, k_r, d] rank (r + i) mod c's
        dkv = pass_to_next_rank(dkv, c, -1, by_all_to_all)  # [2, b, s_l, k_r, d] fp32: that kv's dK, dV so far
        j = (r + i) % c
        dq_i, dkv_i = _step_grads(q, rows, kv, j < r, kernel, placed(drop, q, c, r, j))
        dq, dkv = dq + dq_i, dkv + dkv_i
    dkv = pass_to_next_rank(dkv, c, -1, by_all_to_all)  # [2, b, s_l, k_r, d]: rank r - 1's, sent home
    # the dropout's seed and positions are integers: no cotangent
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None


_ring.defvjp(_ring_forward, _ring_backward)

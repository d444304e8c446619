"""Core attention, O = softmax(Q K^T / sqrt(d) + causal mask) V, in three implementations.

Shape legend: b micro-batch, s query positions, S key positions (s, or the cache's length when
decoding), k_r kv heads on this rank, g query heads per kv head, d head dim.
Q [b, s, k_r, g, d], K and V [b, S, k_r, d] -> O [b, s, k_r, g, d]; query head j of kv group r
is head r g + j, the order `jax.nn.dot_product_attention` groups heads in as well.

`model.attention` picks the implementation (`resolve_attention` turns it into a kernel name):
  xla          the einsums below: scores and softmax in fp32, the probabilities kept for the
               backward in the compute dtype; attention dropout (its mask a function of the
               true positions, `attention_dropout.py`); the KV-cache decode path
  dot_product  `jax.nn.dot_product_attention`: cuDNN's fused flash attention ("cudnn") on NVIDIA
               GPUs of compute capability >= 8.0 with 16-bit inputs and d a multiple of 8 up to
               128 (256 from 9.0), JAX's own XLA lowering ("dot_product") elsewhere. No dropout.
               Flash attention never forms the s x S scores: the backward keeps O and the fp32
               log-sum-exp per row ([b, a/t, s]) and recomputes the rest tile by tile.
  auto         "cudnn" where it applies and attention dropout is 0, "xla" everywhere else.
Decoding from a KV cache always takes the einsums (one query row per pass: bandwidth-bound).
Packed rows (`data.document_masking`, `segments` [b, s]): every implementation also cuts the mask to
one document; the fused ones take it as `mask` (cuDNN: a dense bias) beside `is_causal`.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from mtjax.model.attention_dropout import attention_dropout
from mtjax.model.documents import same_document

KERNELS = ("xla", "dot_product", "cudnn")               # what a model is built with


def cudnn_flash_applies(device, dtype, head_dim: int) -> bool:
    """Whether cuDNN's flash attention takes these inputs on `device`: a CUDA GPU of compute
    capability >= 8.0, fp16/bf16 Q, K, V, and d a multiple of 8, at most 128 (256 from 9.0)."""
    if device.platform != "gpu" or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    try:
        capability = tuple(int(x) for x in str(device.compute_capability).split("."))
    except (AttributeError, ValueError):
        return False                                     # not CUDA (ROCm reports no capability)
    limit = 256 if capability >= (9, 0) else 128
    return capability >= (8, 0) and head_dim % 8 == 0 and head_dim <= limit


def resolve_attention(choice: str, device, dtype, head_dim: int, attention_dropout: float) -> str:
    """`model.attention` on `device` for `dtype` compute -> a kernel of KERNELS."""
    flash = attention_dropout == 0 and cudnn_flash_applies(device, dtype, head_dim)
    if choice == "auto":
        return "cudnn" if flash else "xla"
    if choice == "dot_product":
        return "cudnn" if flash else "dot_product"
    return "xla"


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def softmax_keeping_output(scores, dtype):
    """P = softmax(scores) over the last axis, computed in fp32 and returned in `dtype`.

    The backward keeps only P in `dtype` (2 bytes per element in 16-bit, as Megatron's fused
    softmax; autodiff of an fp32 softmax would keep fp32 P) and computes
    dS = P * (dP - sum_j dP_j P_j) in fp32."""
    return jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dtype)


def _softmax_forward(scores, dtype):
    probs = softmax_keeping_output(scores, dtype)
    return probs, probs


def _softmax_backward(dtype, probs, d_probs):
    p, dp = probs.astype(jnp.float32), d_probs.astype(jnp.float32)
    return (p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True)),)


softmax_keeping_output.defvjp(_softmax_forward, _softmax_backward)


def einsum_attention(q, k, v, dropout_key=None, rate: float = 0.0, positions=None, segments=None):
    """The "xla" kernel: scores and softmax in fp32, P in v's dtype, dropout on P with
    `dropout_key` (None: none). Q [b, s, k_r, g, d], K/V [b, S, k_r, d] -> [b, s, k_r, g, d].
    Decoding: `positions` [b, s] of the queries; a query at position p sees keys 0 .. p.
    Packed rows: `segments` [b, s] (`model/documents.py`), the causal mask also cut to one
    document (block-diagonal). The two do not combine (decoding never sees packed rows)."""
    if positions is not None and segments is not None:
        raise ValueError("einsum_attention: positions (decoding) and segments (packed rows) do not combine")
    if positions is None:
        s = q.shape[1]
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))[None]                    # [1, s, S]
        if segments is not None:
            mask = mask & same_document(segments, segments)                     # [b, s, S]
    else:
        keys = jnp.arange(k.shape[1], dtype=positions.dtype)
        mask = keys[None, None, :] <= positions[:, :, None]                    # [b, s, S]
    return masked_attention(q, k, v, mask, dropout_key, rate, positions)


def masked_attention(q, k, v, mask, dropout_key=None, rate: float = 0.0, queries=None, keys=None):
    """`einsum_attention` with a boolean `mask` [b or 1, s, S]: query row i reads key j where
    mask[., i, j] (every row must read at least one key). Attention dropout's mask is drawn at
    the true positions of the queries ([s] or [b, s]; default 0 .. s-1) and keys ([S]; default
    0 .. S-1). With g = 1 (multi-head attention) the group axis is dropped first: XLA:CPU ran the
    4-d einsums' forward and backward 1.35x faster than the 5-d ones (b 2, s 512, a 8, d 64)."""
    drop = attention_dropout(dropout_key, rate)
    if drop is not None:
        b, s, S = q.shape[0], q.shape[1], k.shape[1]
        drop = drop.at(jnp.arange(b), jnp.arange(s) if queries is None else queries,
                       jnp.arange(S) if keys is None else keys)
    if q.shape[3] == 1:
        return _attention(q[:, :, :, 0], k, v, drop, mask, "bqkd,bskd->bkqs", "bkqs,bskd->bqkd")[:, :, :, None]
    return _attention(q, k, v, drop, mask, "bqkgd,bskd->bkgqs", "bkgqs,bskd->bqkgd")


def _attention(q, k, v, drop, mask, scores_eq: str, out_eq: str):
    """`masked_attention` with the score layout [b, k_r, (g,) s, S] that the equations give."""
    scores = jnp.einsum(scores_eq, q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))                     # [b, k_r, (g,) s, S]
    mask = mask.reshape(mask.shape[:1] + (1,) * (scores.ndim - 3) + mask.shape[1:])
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = softmax_keeping_output(scores, v.dtype)       # kept in the compute dtype (2 bytes in 16-bit)
    if drop is not None:
        probs = drop.apply(probs)                         # keeps the bool mask and its output, P V's input
    return jnp.einsum(out_eq, probs, v)


def fused_attention(q, k, v, kernel: str, segments=None):
    """The "dot_product" and "cudnn" kernels: `jax.nn.dot_product_attention` with a causal mask,
    grouped-query attention by its K < N heads. Q [b, s, k_r, g, d], K/V [b, s, k_r, d].
    Packed rows (`segments` [b, s]): the same-document mask [b, 1, s, s] goes in as `mask`, which
    both implementations apply with the causal one (cuDNN: as a dense additive bias, one for all
    heads, query heads and their shared kv heads alike; its causal tiles are still skipped)."""
    b, s, kv, g, d = q.shape
    mask = None if segments is None else same_document(segments, segments)[:, None]   # [b, 1, s, s]
    out = jax.nn.dot_product_attention(q.reshape(b, s, kv * g, d), k, v, mask=mask, is_causal=True,
                                       implementation="cudnn" if kernel == "cudnn" else "xla")
    return out.reshape(b, s, kv, g, d)

"""Attention blocks that merge: one block's softmax over its own keys with its log-sum-exp, and
its backward from the merged (global) softmax's output and log-sum-exp.

Shape legend: b batch, T query rows, S keys, k_r kv heads, g query heads per kv head, d head dim.
Q [b, T, k_r, g, d], K and V [b, S, k_r, d]. A block is full (every row reads every key) or
causal (T = S, row i reads keys 0 .. i: cuDNN's top-left CAUSAL, whose upper tiles are skipped).

    forward:  S = Q K^T / sqrt(d) (+ mask),  lse = log sum_j e^S_j  [b, T, k_r, g] fp32,
              O = softmax(S) V
    merge:    blocks over disjoint keys: lse = log sum_i e^lse_i, O = sum_i e^(lse_i - lse) O_i
    backward: from the merged O, lse and dO (flash attention's): P = exp(S - lse),
              D = rowsum(dO * O), dV = P^T dO, dS = P (dO V^T - D),
              dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d)
A block's backward run with the merged O and lse gives exactly its keys' share of the merged
softmax's gradient, so the blocks' dQ sum and each block's dK, dV are final.
Attention dropout ("xla" only; `attention_dropout.AttentionDropout` placed at the block's true
positions): O = (P * Z) V with Z = M / keep, and the backward draws the block's M again:
    dV = (P * Z)^T dO,  dS = P ((dO V^T) * Z - D)
(D = rowsum(dO * O) of the dropped O is still rowsum(P * dP): sum_j P_j Z_j (dO . V_j) = dO . O).

Kernels: "xla" the einsums (scores fp32 through memory; any platform, exact at fp32) and "cudnn"
cuDNN's flash attention (16-bit, a CUDA GPU). jax's public `jax.nn.dot_product_attention` cannot
serve: its lse comes back cast to the output's dtype and its gradient drops the lse cotangent. The
cudnn kernel calls jax's own cuDNN attention one level down (`jax._src.cudnn.
fused_attention_stablehlo`, checked in jax 0.10.2 and 0.11.2): `dot_product_attention(...,
return_residual=True)` for (O, fp32 lse), and its backward rule with the merged O and lse as the
residuals (the way TransformerEngine's context parallelism calls its kernels). `cudnn_blocks()` says
whether this jax has them; callers fall back when not.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mtjax.model.attention_dropout import on

F32 = jnp.float32


def cudnn_blocks():
    """jax's cuDNN attention module if it has what the cudnn kernel calls, else None."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:                                   # pragma: no cover (jax without it)
        return None
    needed = ("dot_product_attention", "_dot_product_attention_bwd_rule", "MaskType", "AttentionLayout")
    return fa if all(hasattr(fa, name) for name in needed) else None


def block_forward(q, k, v, causal: bool, kernel: str, drop=None):
    """One block: O = softmax(S) V over these keys [b, T, k_r, g, d] (fp32 from "xla", Q's dtype
    from "cudnn") and lse [b, T, k_r, g] fp32; `drop` (None: none) drops P's entries ("xla")."""
    if kernel == "cudnn":
        return _cudnn_forward(q, k, v, causal)
    s = _scores(q, k, causal)                                                  # [b, k_r, g, T, S]
    lse = jax.nn.logsumexp(s, axis=-1)                                         # [b, k_r, g, T]
    p = on(drop, jnp.exp(s - lse[..., None])).astype(v.dtype)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p, v, preferred_element_type=F32)
    return o, lse.transpose(0, 3, 1, 2)


def block_backward(q, k, v, causal: bool, kernel: str, rows, drop=None):
    """One block's dQ [b, T, k_r, g, d], dK, dV [b, S, k_r, d] from rows = (dO, O, lse) of the
    merged softmax at its query rows (fp32 from "xla", Q's dtype from "cudnn"); `drop` as the
    forward's."""
    if kernel == "cudnn":
        return _cudnn_backward(q, k, v, causal, rows)
    d_out, out, lse = rows
    delta = jnp.sum(d_out.astype(F32) * out.astype(F32), axis=-1)              # D [b, T, k_r, g]
    return grads_from_scores(q, k, v, _scores(q, k, causal), d_out, lse, delta, drop)


def grads_from_scores(q, k, v, s, d_out, lse, delta, drop=None):
    """dQ, dK, dV of one block (fp32) from its scores S [b, k_r, g, T, S] (masked entries -inf),
    dO [b, T, k_r, g, d], the merged lse and D = rowsum(dO * O) [b, T, k_r, g]:
    P = exp(S - lse), dV = P^T dO, dS = P * (dO V^T - D), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d);
    with dropout (`drop`, the forward's mask drawn again) P * Z in dV and (dO V^T) * Z in dS."""
    p = jnp.exp(s - lse.transpose(0, 2, 3, 1)[..., None])                      # P, fp32
    dv = jnp.einsum("bkgqs,bqkgd->bskd", on(drop, p).astype(v.dtype), d_out, preferred_element_type=F32)
    dp = on(drop, jnp.einsum("bqkgd,bskd->bkgqs", d_out, v, preferred_element_type=F32))
    ds = (p * (dp - delta.transpose(0, 2, 3, 1)[..., None])).astype(q.dtype)
    scale = 1.0 / jnp.sqrt(F32(q.shape[-1]))
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, k, preferred_element_type=F32) * scale
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q, preferred_element_type=F32) * scale
    return dq, dk, dv


def merge(parts):
    """[(O_i, lse_i)] over disjoint keys -> (O fp32, lse): the softmax over their union. An lse_i
    of -inf (a block these rows do not read) weighs 0; at least one lse_i must be finite."""
    top = parts[0][1]
    for _, lse in parts[1:]:
        top = jnp.maximum(top, lse)
    weights = [jnp.exp(lse - top) for _, lse in parts]                         # [b, T, k_r, g]
    total = sum(weights)
    out = sum(w[..., None] * o.astype(F32) for w, (o, _) in zip(weights, parts)) / total[..., None]
    return out, top + jnp.log(total)


def _scores(q, k, causal: bool):
    """S = Q K^T / sqrt(d) in fp32 [b, k_r, g, T, S], the causal block's upper triangle at the
    float minimum (exp(min - lse) = 0, and no inf - inf)."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=F32) / jnp.sqrt(F32(q.shape[-1]))
    if not causal:
        return s
    rows, keys = s.shape[-2:]
    return jnp.where(jnp.arange(keys)[None, :] <= jnp.arange(rows)[:, None], s, jnp.finfo(F32).min)


def _heads(x):
    """[b, T, k_r, g, d] -> [b, T, k_r g, d]: query head j of kv group r is head r g + j, the order
    cuDNN groups heads in."""
    return x.reshape(*x.shape[:2], -1, x.shape[-1])


def _cudnn_call(q, causal: bool):
    fa = cudnn_blocks()
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    return fa, mask, 1.0 / math.sqrt(q.shape[-1])


def _cudnn_forward(q, k, v, causal: bool):
    fa, mask, scale = _cudnn_call(q, causal)
    out, lse = fa.dot_product_attention(_heads(q), k, v, scale=scale, mask_type=mask, qkv_layout="BTNH",
                                        return_residual=True)                # [b, T, N, d], [b, N, T] fp32
    return out.reshape(q.shape), lse.transpose(0, 2, 1).reshape(q.shape[:-1])


def _cudnn_backward(q, k, v, causal: bool, rows):
    """cuDNN's backward with the merged O and lse as its residuals (it forms D = rowsum(dO * O)
    and P = exp(S - lse) itself)."""
    fa, mask, scale = _cudnn_call(q, causal)
    d_out, out, lse = rows
    b, t = q.shape[:2]
    stats = lse.reshape(b, t, -1).transpose(0, 2, 1).astype(F32)              # [b, N, T]
    unused = jnp.zeros(0, q.dtype)
    residuals = (_heads(q), k, v, *(unused,) * 7, stats, _heads(out.astype(q.dtype)))
    grads = fa._dot_product_attention_bwd_rule(            # (scale, seed, dropout, (bias, dbias), mask,
        scale, 42, 0.0, (False, False), mask,              #  layout, window, is_training (unused),
        fa.AttentionLayout.BTNH.value, None, 0, False,     #  return_residual), residuals, dO
        residuals, _heads(d_out.astype(q.dtype)))
    return grads[0].reshape(q.shape), grads[1], grads[2]

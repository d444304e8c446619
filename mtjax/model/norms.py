"""LayerNorm (GPT) and RMSNorm (Llama), computed in fp32, parameters replicated over `tensor`;
and the per-head RMSNorm of queries and keys (`model.qk_norm`, Qwen3).

Norms act on the residual stream, which sequence parallelism splits to [b, s/t, h]: their
parameters are declared `sequence_parallel` (their gradients are then partial sums over `tensor`).

Backward memory (Korthikanti et al. count one 16-bit norm input): each norm is a custom_vjp
whose residuals are its input x in the compute dtype and the fp32 per-row statistics
(mean and 1/sigma, [b, s, 1]), not the fp32 intermediates autodiff of the fp32 math would keep
(x - mean, 2 (x - mean), the normalised value: three fp32 [b, s, h]). With
x̂ = (x - mean) rstd (LayerNorm) or x rstd (RMSNorm), g the output cotangent and gγ = g * scale:
    dbias = Σ g,  dscale = Σ g x̂  (over every row),
    dx = rstd (gγ - mean_h(gγ) - x̂ mean_h(gγ x̂))      (RMSNorm: without the mean_h(gγ) term).
"""
from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.parallel.layers import declare, lead


def _rows(x):
    """Every axis but the last (h): where a parameter's gradient sums."""
    return tuple(range(x.ndim - 1))


def _normalise(x, centre: bool, eps: float):
    """x [..., h] -> (x̂ fp32, mean or None, rstd) with statistics [..., 1] in fp32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True) if centre else None
    xc = x32 - mean if centre else x32
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xc), axis=-1, keepdims=True) + eps)
    return xc * rstd, mean, rstd


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm(x, scale, bias, centre: bool, eps: float):
    """x̂ scale (+ bias) in fp32, returned in x's dtype; bias None for RMSNorm."""
    xhat, _, _ = _normalise(x, centre, eps)
    y = xhat * lead(scale, x.ndim)
    return (y if bias is None else y + lead(bias, x.ndim)).astype(x.dtype)


def _norm_fwd(x, scale, bias, centre, eps):
    xhat, mean, rstd = _normalise(x, centre, eps)
    y = xhat * lead(scale, x.ndim)
    y = (y if bias is None else y + lead(bias, x.ndim)).astype(x.dtype)
    # saves x (compute dtype) + per-row mean/rstd (fp32), not x̂ or x - mean in fp32: x̂ is rebuilt in the backward
    return y, (x, mean, rstd, scale, bias)


def _norm_bwd(centre, eps, res, g):
    x, mean, rstd, scale, bias = res
    x32 = x.astype(jnp.float32)
    xhat = ((x32 - mean) if centre else x32) * rstd
    g32 = g.astype(jnp.float32)
    g_scaled = g32 * lead(scale, x.ndim).astype(jnp.float32)
    proj = jnp.mean(g_scaled * xhat, axis=-1, keepdims=True)
    if centre:
        g_scaled = g_scaled - jnp.mean(g_scaled, axis=-1, keepdims=True)
    dx = rstd * (g_scaled - xhat * proj)
    dscale = jnp.sum(g32 * xhat, axis=_rows(x)).astype(scale.dtype)
    dbias = None if bias is None else jnp.sum(g32, axis=_rows(x)).astype(bias.dtype)
    return dx.astype(x.dtype), dscale, dbias


_norm.defvjp(_norm_fwd, _norm_bwd)


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over the last dimension h."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        h = x.shape[-1]
        scale = declare(self, "scale", (h,), ("norm",), nn.initializers.ones, sequence_parallel=True)
        bias = declare(self, "bias", (h,), ("norm",), nn.initializers.zeros, sequence_parallel=True)
        return _norm(x, scale, bias, True, self.eps)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale over the last dimension h."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        scale = declare(self, "scale", (x.shape[-1],), ("norm",), nn.initializers.ones, sequence_parallel=True)
        return _norm(x, scale, None, False, self.eps)


class HeadRMSNorm(nn.Module):
    """QK-norm (Qwen3): y = x / sqrt(mean_d(x^2) + eps) * scale over each head's d values of
    x [b, s, n, d], one scale [d] shared by the n heads. The heads are split over `tensor`, so the
    norm needs no communication, but the scale's gradient sums over every rank's heads
    (`shared_by_heads`, `parallel/reductions.py`)."""

    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = declare(self, "scale", (x.shape[-1],), ("head_dim",), nn.initializers.ones, shared_by_heads=True)
        return _norm(x, scale, None, False, self.eps)


def make_norm(arch: str, eps: float, name: str | None = None) -> nn.Module:
    cls = RMSNorm if arch == "llama" else LayerNorm
    return cls(eps) if name is None else cls(eps, name=name)

"""LayerNorm (GPT) and RMSNorm (Llama), computed in fp32, parameters replicated over `tensor`.

Norms act on the residual stream, which sequence parallelism splits to [b, s/t, h]: their
parameters are declared `sequence_parallel` (their gradients are then partial sums over `tensor`).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.parallel.layers import declare, lead


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over the last dimension h."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        h = x.shape[-1]
        scale = declare(self, "scale", (h,), ("norm",), nn.initializers.ones, sequence_parallel=True)
        bias = declare(self, "bias", (h,), ("norm",), nn.initializers.zeros, sequence_parallel=True)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * lead(scale, x.ndim) + lead(bias, x.ndim)
        return y.astype(x.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale over the last dimension h."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        scale = declare(self, "scale", (x.shape[-1],), ("norm",), nn.initializers.ones, sequence_parallel=True)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps) * lead(scale, x.ndim)
        return y.astype(x.dtype)


def make_norm(arch: str, eps: float, name: str | None = None) -> nn.Module:
    cls = RMSNorm if arch == "llama" else LayerNorm
    return cls(eps) if name is None else cls(eps, name=name)

"""Rotary position embeddings (RoPE, Su et al. 2021), rotate-half convention.

For head dimension d and position p, pairs (x_i, x_{i+d/2}) are rotated by
angle p * theta^(-2i/d).
"""
from __future__ import annotations

import jax.numpy as jnp


def rope_tables(seq_len: int, head_dim: int, theta: float):
    """cos, sin tables [s, d/2] in fp32."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """x [b, s, n, d] -> rotated [b, s, n, d]; computed in fp32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)

"""Rotary position embeddings (RoPE, Su et al. 2021), rotate-half convention.

For head dimension d and position p, pairs (x_i, x_{i+d/2}) are rotated by the
angle p f_i, with f_i = theta^(-2i/d), i < d/2, rescaled as `model.rope_scaling` says:
    none    f_i
    linear  f_i / factor                (positions divided by the factor)
    llama3  Llama 3.1's band-wise rescaling (`llama3_frequencies`).
    yarn    YaRN (Peng et al. 2023): a per-pair blend of kept and divided frequencies
            (`yarn_frequencies`), and cos, sin multiplied by an attention factor
            (`attention_factor`), as transformers' rotary embedding does.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from mtjax.config.schema import ModelConfig
from mtjax.parallel.layers import lead


def llama3_frequencies(inv_freq, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_positions: int):
    """Llama 3.1's rescaling of the frequencies f [d/2] (transformers' `_compute_llama3_parameters`).

    With wavelength w = 2 pi / f and L = original_positions:
        w < L / high_freq_factor   f                                 (high frequencies kept)
        w > L / low_freq_factor    f / factor                        (low ones scaled as linear)
        otherwise                  (1 - c) f / factor + c f,  c = (L / w - low) / (high - low)
    c runs from 0 at w = L / low to 1 at w = L / high, so the bands join continuously.
    """
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = jnp.where(wavelen > original_positions / low_freq_factor, inv_freq / factor, between)
    return jnp.where(wavelen < original_positions / high_freq_factor, inv_freq, scaled)


def yarn_frequencies(inv_freq, m: ModelConfig):
    """YaRN's rescaling of the frequencies f [d/2] (transformers' `_compute_yarn_parameters`).

    Pair i turns L f_i / (2 pi) times over the original context L = rope_original_positions; the
    pair that turns r times is i(r) = d ln(L / (2 pi r)) / (2 ln theta). The blend runs over the pairs
    lo = max(floor(i(beta_fast)), 0) .. hi = min(ceil(i(beta_slow)), d - 1) (hi = lo + 0.001 when
    they meet):
        ramp_i = clip((i - lo) / (hi - lo), 0, 1)
        f'_i   = ramp_i f_i / factor + (1 - ramp_i) f_i
    so the fast pairs (turning more than beta_fast times) keep f, the slow ones (fewer than
    beta_slow) are divided as in linear scaling, and a straight line joins them.
    """
    d, L = m.head_dim, m.rope_original_positions

    def pair(rotations):
        return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(m.rope_theta))

    lo, hi = max(math.floor(pair(m.rope_beta_fast)), 0), min(math.ceil(pair(m.rope_beta_slow)), d - 1)
    hi = hi + 0.001 if hi == lo else hi          # (transformers' guard against a zero-width ramp)
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - lo) / (hi - lo), 0.0, 1.0)
    return ramp * (inv_freq / m.rope_scaling_factor) + (1 - ramp) * inv_freq


def attention_factor(m: ModelConfig) -> float:
    """The factor cos and sin are multiplied by (so q.k by its square): yarn's rope_attention_factor,
    or when that is 0, 0.1 ln(factor) + 1 (1 for factor <= 1); 1 for every other scaling."""
    if m.rope_scaling != "yarn":
        return 1.0
    if m.rope_attention_factor:
        return m.rope_attention_factor
    return 0.1 * math.log(m.rope_scaling_factor) + 1.0 if m.rope_scaling_factor > 1 else 1.0


def rope_frequencies(m: ModelConfig):
    """The rotation frequencies f [d/2] in fp32: theta^(-2i/d), rescaled by `m.rope_scaling`."""
    d = m.head_dim
    inv_freq = 1.0 / m.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    if m.rope_scaling == "linear":
        return inv_freq / m.rope_scaling_factor
    if m.rope_scaling == "llama3":
        return llama3_frequencies(inv_freq, m.rope_scaling_factor, m.rope_low_freq_factor,
                                  m.rope_high_freq_factor, m.rope_original_positions)
    if m.rope_scaling == "yarn":
        return yarn_frequencies(inv_freq, m)
    return inv_freq


def rope_tables(positions, m: ModelConfig):
    """cos, sin tables [..., d/2] in fp32 for integer positions [...]: [s] (the same for every
    row: 0 .. s - 1, or a context rank's chunks) or [b, s] (each row's own: inside each packed
    document, or when decoding from a KV cache), both multiplied by `attention_factor` (1 but for yarn)."""
    angles = positions.astype(jnp.float32)[..., None] * lead(rope_frequencies(m), positions.ndim + 1)
    scale = attention_factor(m)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x, cos, sin):
    """x [b, s, n, d] -> rotated [b, s, n, d]; computed in fp32. cos, sin [s, d/2] or [b, s, d/2]."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = lead(cos[..., None, :], x.ndim), lead(sin[..., None, :], x.ndim)   # [1 or b, s, 1, d/2]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)

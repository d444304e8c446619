"""PROVISIONAL (replaced by the context-attention cores): all-gather attention by autodiff."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from mtjax.mesh import CONTEXT
from mtjax.model.core_attention import softmax_keeping_output
from mtjax.parallel.context_ops import all_positions, context_positions


def all_gather_attention(q, k, v, c: int, kernel: str = "xla"):
    s_l = q.shape[1]
    k = lax.all_gather(k, CONTEXT, axis=1, tiled=True)
    v = lax.all_gather(v, CONTEXT, axis=1, tiled=True)
    qpos = context_positions(s_l, c)
    kpos = all_positions(s_l * c, c).reshape(-1)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.where(kpos[None, :] <= qpos[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = softmax_keeping_output(scores, v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v)


ring_attention = all_gather_attention

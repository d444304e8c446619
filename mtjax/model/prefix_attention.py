"""The second half of a sequence attending to the first half's keys and values (sequence halves
of `parallel.half_batch_overlap`, `block.halved`): whole to the first half's, causally to its own.

Shape legend: b batch, T = s/2 a half's positions, k_r kv heads, g query heads per kv head, d head
dim. Q [b, T, k_r, g, d] and K, V [b, T, k_r, d] at positions T .. 2T - 1; K_A, V_A [b, T, k_r, d]
the first half's, at positions 0 .. T - 1 (every one of them precedes every query here):

    O = softmax([Q K_A^T, causal(Q K^T)] / sqrt(d)) [V_A; V]
      = merge(block(Q, K_A, V_A, full), block(Q, K, V, causal))          (`attention_blocks`)

The backward runs each block's backward from the merged O and lse (flash attention's): dQ is the
two blocks' sum, dK and dV the causal block's, and dK_A, dV_A the full block's, the share of the
first half's keys and values that the second half's queries read (the first half's own core adds
the rest). It keeps Q, K, V, K_A, V_A, O and the fp32 lse: nothing for selective recomputation to
drop.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from mtjax.model.attention_blocks import block_backward, block_forward, merge

F32 = jnp.float32


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def prefixed_attention(q, k, v, k_a, v_a, kernel: str):
    """q [b, T, k_r, g, d], k, v [b, T, k_r, d] (the second half's), k_a, v_a [b, T, k_r, d] (the
    first half's) -> [b, T, k_r, g, d] in v's dtype (module docstring); kernel "xla" or "cudnn"
    (`attention_blocks`)."""
    return _forward(q, k, v, k_a, v_a, kernel)[0]


def _forward(q, k, v, k_a, v_a, kernel: str):
    out, lse = merge([block_forward(q, k_a, v_a, False, kernel), block_forward(q, k, v, True, kernel)])
    out = out.astype(v.dtype)                                                  # [b, T, k_r, g, d]
    return out, (q, k, v, k_a, v_a, out, lse)


def _backward(kernel: str, residuals, d_out):
    q, k, v, k_a, v_a, out, lse = residuals
    rows = (d_out, out, lse)
    dq_a, dk_a, dv_a = block_backward(q, k_a, v_a, False, kernel, rows)       # the first half's keys
    dq, dk, dv = block_backward(q, k, v, True, kernel, rows)                  # its own, causally
    dq = (dq_a.astype(F32) + dq.astype(F32)).astype(q.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), dk_a.astype(k_a.dtype), dv_a.astype(v_a.dtype)


prefixed_attention.defvjp(_forward, _backward)

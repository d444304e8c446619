"""How what a stage sends at one tick arrives at the next, and how it is filed into a slot."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from mtjax.mesh import PIPE
from mtjax.pipeline.table import NONE


def put(buf, slot, value):
    """buf[slot] = value where slot != NONE (buf [S, ...])."""
    i = jnp.maximum(slot, 0)
    return buf.at[i].set(jnp.where(slot != NONE, value.astype(buf.dtype), buf[i]))


class Links:
    """How what a stage sends at one tick arrives at the next (`buffers.channel`).

    Loop layout: activations go to stage i + 1 and gradients to i - 1, one `ppermute` each
    (cyclic when interleaving). V layout (zbv): chunk 0's activations go up and chunk 1's down,
    gradients the other way, and on stage p - 1 the V turns within the stage; so each value is
    sent both ways and kept, [3, ...] = (from i - 1, from i + 1, from itself), and the receiver's
    tables say which to file (at most one value per channel and tick)."""

    def __init__(self, p: int, v: int, layout: str):
        self.p, self.v, self.v_layout = p, v, layout == "v"

    def empty(self, zeros):
        return jnp.stack([zeros] * 3) if self.v_layout else zeros

    def send(self, value, step: int):
        """What arrives next tick from `value` sent towards stage i + step (step = +1 activations, -1 gradients)."""
        if not self.v_layout:
            return lax.ppermute(value, PIPE, ring(self.p, self.v, step))             # [b, s(/t), h], from i - step
        up = lax.ppermute(value, PIPE, ring(self.p, 1, +1))                           # [b, s(/t), h] to i + 1
        down = lax.ppermute(value, PIPE, ring(self.p, 1, -1))                         # [b, s(/t), h] to i - 1
        return jnp.stack([up, down, value])

    def file(self, buf, arrived, slots: tuple, step: int):
        """buf with what arrived filed; `slots` = the row's (prev, next, self) slots of this kind."""
        if not self.v_layout:   # activations come from the previous stage, gradients from the next
            return put(buf, slots[0] if step > 0 else slots[1], arrived)
        for k, slot in enumerate(slots):
            buf = put(buf, slot, arrived[k])
        return buf


def ring(p: int, v: int, step: int) -> list[tuple[int, int]]:
    """ppermute pairs to the next (step +1) or previous (-1) stage; cyclic when interleaving."""
    n = p if v > 1 else p - 1
    return [(i, (i + 1) % p) if step > 0 else ((i + 1) % p, i) for i in range(n)]

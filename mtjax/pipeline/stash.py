"""Where a pipeline stage keeps what its backward needs: rings of slots, one slot per value held.

Two kinds of value wait in them (`buffers.plan_buffers` says which slot, and when):
  the stash     the residuals a chunk's forward leaves for its backward (B, when split), from
                F to B: what `train.recompute` saves, weights excluded;
  the W stash   split schedules (zb, zbv): each matmul's input X and output gradient dY that B
                leaves for W, from B to W (`parallel/taps.py`).
`Stash` keeps a ring per leaf. `PackedStash` keeps any kind as one row of bytes, so that the two
kinds can take turns in one ring (`BufferPlan.shared_stash`): a slot is then held from F to W,
and a stage needs as many as it holds from F to W (`Schedule.slots_held`), each as wide as the
wider kind, where two rings need the most any stage waits for B plus the most any stage waits
for W (every stage gets the same rings: SPMD). `stash_rings` takes whichever is smaller.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mtjax.pipeline.buffers import BufferPlan, plan_buffers
from mtjax.pipeline.table import NONE, Schedule

# where an offloaded stash lives, and where its slots come back to
HOST_MEMORY, DEVICE_MEMORY = jax.memory.Space.Host, jax.memory.Space.Device


class Stash:
    """Per leaf a ring [S + 1, ...] of S slots and one more, slot S, that takes the write of every
    tick without a value to keep.

    Written outside `lax.cond` (the backward's branch only reads it), for what XLA makes of
    it: a buffer that a branch updates and the other passes through is copied whole every
    tick on XLA:GPU (measured on an H100 compile: 26 stash-sized copies in the tick loop,
    temporaries 1.3x), and a conditional update of a host buffer would run on the host. So
    every tick writes: the forward's residuals into their slot, or zeros into slot S (ticks
    without a forward are the bubble's, a number independent of m).

    With `offload` (`train.offload_activations`) the ring lives in pinned host memory: each
    write moves the residuals to the host and the backward slot moves its slot back, the
    pattern XLA's host offloader turns into asynchronous copies. The device then holds one
    chunk's residuals of one micro-batch at a time, whatever the schedule keeps in flight."""

    def __init__(self, offload: bool):
        self.offload = offload

    def empty(self, shapes, slots: int) -> list:
        if not self.offload:
            return [jnp.zeros((slots + 1, *r.shape), r.dtype) for r in shapes]
        # lax.empty, not zeros: XLA:GPU would fill zeros in device memory and then copy them over
        return [jax.device_put(lax.empty((slots + 1, *r.shape), r.dtype), HOST_MEMORY) for r in shapes]

    def write(self, stash: list, slot, leaves: list) -> list:
        """stash[slot] = leaves; slot NONE writes to the spare slot S."""
        if self.offload:
            leaves = [jax.device_put(r, HOST_MEMORY) for r in leaves]
        return [lax.dynamic_update_index_in_dim(s, r, jnp.where(slot == NONE, s.shape[0] - 1, slot), 0)
                for s, r in zip(stash, leaves)]

    def read(self, stash: list, slot) -> list:
        leaves = [lax.dynamic_index_in_dim(s, slot, 0, keepdims=False) for s in stash]
        return [jax.device_put(r, DEVICE_MEMORY) for r in leaves] if self.offload else leaves


class PackedStash:
    """One kind of value (leaves `shapes`) in a ring of byte rows [S + 1, width] uint8 that other
    kinds share: a value is its leaves' bytes end to end (a bitcast, so exact), in a row of
    `width` (the tail past them is never read). Slot S takes the writes of ticks without a value, as in `Stash`. The ring is the
    one-element list `Stash`'s callers pass around."""

    def __init__(self, shapes, width: int):
        self.shapes, self.width = list(shapes), width
        assert nbytes(shapes) <= width

    def empty(self, shapes, slots: int) -> list:
        return [jnp.zeros((slots + 1, self.width), jnp.uint8)]

    def write(self, stash: list, slot, leaves: list) -> list:
        """stash[slot] = leaves' bytes, a leaf at a time (each an in-place update: a whole row
        built first would be one more slot of temporaries); slot NONE writes to the spare slot S."""
        ring, at = stash[0], 0
        row = jnp.where(slot == NONE, ring.shape[0] - 1, slot)
        for x in leaves:
            ring = lax.dynamic_update_slice(ring, _to_bytes(x)[None], (row, jnp.int32(at)))
            at += _size(x)
        return [ring]

    def read(self, stash: list, slot) -> list:
        """The leaves in stash[slot], each sliced from the ring on its own."""
        leaves, at = [], 0
        for r in self.shapes:
            n = _size(r)
            leaves.append(_from_bytes(lax.dynamic_slice(stash[0], (slot, jnp.int32(at)), (1, n))[0], r))
            at += n
        return leaves


def nbytes(shapes) -> int:
    return sum(_size(r) for r in shapes)


def packable(shapes) -> bool:
    """Whether every leaf is plain numbers (no PRNG key arrays) that a bitcast can turn into bytes."""
    return all(not jnp.issubdtype(r.dtype, jax.dtypes.extended) for r in shapes)


def _size(r) -> int:
    return math.prod(r.shape) * np.dtype(r.dtype).itemsize


def _to_bytes(x):
    """x's bytes, flat [size * itemsize] uint8."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(row, r):
    """The leaf shaped like r (a ShapeDtypeStruct) whose bytes are row [size * itemsize] uint8."""
    dtype = np.dtype(r.dtype)
    if dtype == np.bool_:
        return row.reshape(r.shape) != 0
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(row.reshape(r.shape), dtype)
    return lax.bitcast_convert_type(row.reshape(*r.shape, dtype.itemsize), dtype)


def stash_rings(schedule: Schedule, offload: bool, b_shapes, w_shapes) -> tuple[BufferPlan, object, object]:
    """(slot tables, the stash's ring, the W stash's ring) for `schedule`: for a split schedule on
    the device, one ring of byte rows (`PackedStash`) where it takes fewer bytes than two, counting
    each ring's spare slot; otherwise a ring per leaf (`Stash`)."""
    plan = plan_buffers(schedule)
    separate = (plan, Stash(offload), Stash(offload))
    if not schedule.split or offload or not packable([*b_shapes, *w_shapes]):
        return separate
    shared, width = plan_buffers(schedule, shared_stash=True), max(nbytes(b_shapes), nbytes(w_shapes))
    two = (plan.stash_slots + 1) * nbytes(b_shapes) + (plan.w_stash_slots + 1) * nbytes(w_shapes)
    if (shared.stash_slots + 1) * width >= two:
        return separate
    return shared, PackedStash(b_shapes, width), PackedStash(w_shapes, width)

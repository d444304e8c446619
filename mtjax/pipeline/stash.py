"""Where a pipeline stage keeps what its backward needs: rings of slots, one slot per value held.

Two kinds of value wait in them (`buffers.plan_buffers` says which slot, and when):
  the stash     the residuals a chunk's forward leaves for its backward (B, when split), from
                F to B: what `train.recompute` saves, weights excluded;
  the W stash   split schedules (zb, zbv): each matmul's input X and output gradient dY that B
                leaves for W, from B to W (`parallel/taps.py`).
A third, the prefix stash, holds what virtual stage 0's embedding and dense prefix keep for their
backward (`chunk.StageWork.embed_input`), from F to B, in a `Stash` of its own.
`Stash` keeps a ring per leaf. `PackedStash` keeps any kind as one row per dtype, so that the
two kinds can take turns in one set of rings (`BufferPlan.shared_stash`): a slot is then held from F to W,
and a stage needs as many as it holds from F to W (`Schedule.slots_held`), each as wide as the
wider kind, where two rings need the most any stage waits for B plus the most any stage waits
for W (every stage gets the same rings: SPMD). `stash_rings` takes whichever is smaller.
"""
from __future__ import annotations

import collections
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
    """One kind of value (leaves `shapes`) in rings that other kinds share: per dtype one ring
    [S + 1, widths[dtype]] whose slot row holds the kind's leaves of that dtype end to end, flat (so
    a leaf is a slice of a row and a reshape, no conversion). `widths` is the most elements of each
    dtype any sharing kind needs (`shared_widths`); the tail past a kind's own leaves is never read.
    Slot S takes the writes of ticks without a value, as in `Stash`."""

    def __init__(self, shapes, widths: dict):
        self.shapes, self.dtypes = list(shapes), sorted(widths, key=str)
        self.widths = [widths[d] for d in self.dtypes]
        self.places, used = [], dict.fromkeys(self.dtypes, 0)   # per leaf: (its dtype's ring, offset)
        for r in self.shapes:
            d = np.dtype(r.dtype)
            self.places.append((self.dtypes.index(d), used[d]))
            used[d] += math.prod(r.shape)
        assert all(used[d] <= w for d, w in zip(self.dtypes, self.widths)), (used, widths)

    def empty(self, shapes, slots: int) -> list:
        return [jnp.zeros((slots + 1, w), d) for d, w in zip(self.dtypes, self.widths)]

    def write(self, stash: list, slot, leaves: list) -> list:
        """stash[slot] = leaves, each an in-place update of its part of the row (a row built first
        would be one more slot of temporaries); slot NONE writes to the spare slot S."""
        stash = list(stash)
        row = jnp.where(slot == NONE, stash[0].shape[0] - 1, slot)
        for x, (k, at) in zip(leaves, self.places):
            stash[k] = lax.dynamic_update_slice(stash[k], x.reshape(1, x.size), (row, jnp.int32(at)))
        return stash

    def read(self, stash: list, slot) -> list:
        """The leaves in stash[slot], each sliced from its ring on its own."""
        return [lax.dynamic_slice(stash[k], (slot, jnp.int32(at)), (1, math.prod(r.shape))).reshape(r.shape)
                for r, (k, at) in zip(self.shapes, self.places)]


def shared_widths(*kinds) -> dict:
    """{dtype: the most elements of it one value of any kind (a list of leaves' shapes) holds}."""
    widths: dict = {}
    for shapes in kinds:
        count = collections.Counter()
        for r in shapes:
            count[np.dtype(r.dtype)] += math.prod(r.shape)
        widths.update({d: max(widths.get(d, 0), n) for d, n in count.items()})
    return widths


def row_bytes(widths: dict) -> int:
    """Bytes of one slot of rings {dtype: elements}."""
    return sum(n * d.itemsize for d, n in widths.items())


def nbytes(shapes) -> int:
    return row_bytes(shared_widths(shapes))


def packable(shapes) -> bool:
    """Whether every leaf is plain numbers (no PRNG key arrays), which a ring of its dtype can hold."""
    return all(not jnp.issubdtype(r.dtype, jax.dtypes.extended) for r in shapes)


def stash_rings(schedule: Schedule, offload: bool, b_shapes, w_shapes) -> tuple[BufferPlan, object, object]:
    """(slot tables, the stash's ring, the W stash's ring) for `schedule`: for a split schedule on
    the device, shared rings (`PackedStash`) where they take fewer bytes than two kinds apart,
    counting each ring's spare slot; otherwise a ring per leaf (`Stash`)."""
    plan = plan_buffers(schedule)
    separate = (plan, Stash(offload), Stash(offload))
    if not schedule.split or offload or not packable([*b_shapes, *w_shapes]):
        return separate
    shared, widths = plan_buffers(schedule, shared_stash=True), shared_widths(b_shapes, w_shapes)
    two = (plan.stash_slots + 1) * nbytes(b_shapes) + (plan.w_stash_slots + 1) * nbytes(w_shapes)
    if (shared.stash_slots + 1) * row_bytes(widths) >= two:
        return separate
    return shared, PackedStash(b_shapes, widths), PackedStash(w_shapes, widths)

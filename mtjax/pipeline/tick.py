"""One tick of `pipeline_grads`, as five named steps over the carry (see `executor` for the math):

    file_arrivals   what the previous tick's sends delivered, into its slots
    forward_slot    a chunk's forward under `jax.vjp`; its residuals into the stash
    backward_slot   the head's forward and backward (last virtual stage), then B: a chunk's backward
    weight_slot     split schedules: W, the matmul weights' gradients from the W stash
    send            the forward's output on, the input gradient back

Each slot's work runs under `lax.cond` (an empty slot costs nothing) and only computes: every
buffer of the carry is written outside the branches (`stash.Stash` says why).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.pipeline.chunk import StageWork, add_chunk, add_shared, shared, zeros_like_shapes
from mtjax.pipeline.links import Links, put
from mtjax.pipeline.table import NONE, stage_and_chunk

# named scopes of the tick loop's kinds of work (see `scopes.scope_table`)
FORWARD_SCOPE, BACKWARD_SCOPE, HEAD_SCOPE = "pipeline_forward", "pipeline_backward", "pipeline_head"
WEIGHT_SCOPE = "pipeline_weight"
FINAL_SCOPE = "pipeline_final_tick"     # the last tick, run after the loop (`sink.final_tick`)


class TickRow(NamedTuple):
    """One stage's row of the tick tables (int32 scalars; NONE = -1 means nothing)."""
    act_in_prev: jax.Array
    act_in_next: jax.Array
    act_in_self: jax.Array
    grad_in_prev: jax.Array
    grad_in_next: jax.Array
    grad_in_self: jax.Array
    fwd_mb: jax.Array
    fwd_chunk: jax.Array
    fwd_act: jax.Array
    fwd_stash: jax.Array
    fwd_head: jax.Array
    fwd_prefix: jax.Array
    bwd_mb: jax.Array
    bwd_chunk: jax.Array
    bwd_grad: jax.Array
    bwd_stash: jax.Array
    bwd_head: jax.Array
    bwd_prefix: jax.Array
    bwd_wstash: jax.Array
    w_mb: jax.Array
    w_chunk: jax.Array
    w_wstash: jax.Array


def row_of(tables: dict, t, rank) -> TickRow:
    return TickRow(*(tables[k][t, rank] for k in TickRow._fields))


class Carry(NamedTuple):
    """What the tick loop carries. Slot buffers have a leading slot axis."""
    grads: dict          # fp32 gradient sums, shaped like params
    acts: jax.Array      # [S_act, b, s(/t), h] arrived activations
    grad_buf: jax.Array  # [S_grad, b, s(/t), h] arrived gradients
    stash: list          # residual leaves, each [S_stash + 1, ...] (`stash.Stash`), in host memory with offload;
                         #   or one ring per dtype that the W stash shares (`stash.PackedStash`)
    head_in: jax.Array   # [S_head, b, s(/t), h] the last virtual stage's outputs
    recv_act: jax.Array  # [b, s(/t), h] what the previous stage sent last tick ([3, ...] in a V: `Links`)
    recv_grad: jax.Array  # [b, s(/t), h] what the next stage sent last tick ([3, ...] in a V)
    loss: jax.Array      # scalar sum of the head's outputs
    w_stash: list = []   # split schedules: the taps' cotangents B leaves for W, else (or shared) empty
    prefix: list = []    # virtual stage 0's embedding and dense prefix residuals (`StageWork.embed_input`), each
                         #   [S_prefix + 1, ...] (`stash.Stash`); empty without a dense prefix


class Picks(NamedTuple):
    """What this tick's slots take: whether there is a forward and a backward, their micro-batch
    and chunk (clamped to 0 when there is none), and whether the backward starts at the head."""
    has_f: jax.Array
    has_b: jax.Array
    fmb: jax.Array
    fc: jax.Array
    bmb: jax.Array
    bc: jax.Array
    last_b: jax.Array


class Rings(NamedTuple):
    """The stage's slot buffers (`stash.stash_rings`) and the shapes of what goes into them."""
    plan: object          # buffers.BufferPlan
    stash: object         # the stash's ring (`stash.Stash` or `PackedStash`)
    w: object             # the W stash's ring
    stash_shapes: object  # one forward's residual leaves
    b_shapes: tuple       # what a backward returns (`StageWork.backward`)
    prefix: object = None     # the prefix stash's ring (`stash.Stash`)
    prefix_shapes: list = []  # one forward's prefix stash leaves (none without a dense prefix)


class Tick:
    """The tick function of the scan: `__call__(carry, row)` runs the five steps in turn."""

    def __init__(self, work: StageWork, schedule, rings: Rings, zeros_act, w_work=None):
        p, v = schedule.stages, schedule.chunks
        self.work, self.rings, self.zeros_act, self.w_work = work, rings, zeros_act, w_work
        self.links = Links(p, v, schedule.layout)
        self.last_rank, self.last_chunk = stage_and_chunk(schedule.layout, p, p * v - 1)

    def __call__(self, carry: Carry, row: TickRow):
        acts, grad_buf = self.file_arrivals(carry, row)
        at = self.picks(row)
        send_act, head_in, stash, prefix = self.forward_slot(carry, acts, row, at)
        grads, send_grad, for_w, value = self.backward_slot(carry, head_in, grad_buf, stash, prefix, row, at)
        grads, stash, w_stash = self.weight_slot(grads, stash, carry.w_stash, for_w, row)
        recv_act, recv_grad = self.send(send_act, send_grad)
        return Carry(grads, acts, grad_buf, stash, head_in, recv_act, recv_grad, carry.loss + value, w_stash,
                     prefix), None

    def file_arrivals(self, carry: Carry, row: TickRow):
        """(activation slots, gradient slots) with last tick's arrivals filed (`buffers.plan_buffers`)."""
        acts = self.links.file(carry.acts, carry.recv_act, (row.act_in_prev, row.act_in_next, row.act_in_self), +1)
        return acts, self.file_gradient(carry, row)

    def file_gradient(self, carry: Carry, row: TickRow):
        return self.links.file(carry.grad_buf, carry.recv_grad,
                               (row.grad_in_prev, row.grad_in_next, row.grad_in_self), -1)

    def picks(self, row: TickRow) -> Picks:
        has_f, has_b = row.fwd_mb != NONE, row.bwd_mb != NONE
        fmb, fc = jnp.maximum(row.fwd_mb, 0), jnp.maximum(row.fwd_chunk, 0)
        bmb, bc = jnp.maximum(row.bwd_mb, 0), jnp.maximum(row.bwd_chunk, 0)
        last_b = has_b & (self.work.rank == self.last_rank) & (bc == self.last_chunk)
        return Picks(has_f, has_b, fmb, fc, bmb, bc, last_b)

    def forward_slot(self, carry: Carry, acts, row: TickRow, at: Picks):
        """(what to send on, head inputs, stash, prefix stash): the chunk's output is also kept as
        the head's input on the last virtual stage, and its residuals are written to their stash
        slot (virtual stage 0's embedding and dense prefix's to theirs)."""
        def forward():
            with jax.named_scope(FORWARD_SCOPE):
                return self.work.forward(acts[jnp.maximum(row.fwd_act, 0)], self.work.mbs[at.fmb], at.fmb, at.fc)

        def no_forward():   # its residuals go to the spare slot, never read
            rings = self.rings
            return (jnp.zeros_like(self.zeros_act), zeros_like_shapes(rings.stash_shapes),
                    zeros_like_shapes(rings.prefix_shapes))

        send_act, res, pre = lax.cond(at.has_f, forward, no_forward)
        head_in = put(carry.head_in, row.fwd_head, send_act)
        prefix = self.rings.prefix.write(carry.prefix, row.fwd_prefix, pre) if pre else carry.prefix
        return send_act, head_in, self.rings.stash.write(carry.stash, row.fwd_stash, res), prefix

    def head(self, head_in, row: TickRow, at: Picks):
        """(shared leaves' gradients, dy, the head's output) of the head's forward and backward
        on the last virtual stage's backward; zeros elsewhere."""
        work = self.work

        def head():
            with jax.named_scope(HEAD_SCOPE):
                y = head_in[jnp.maximum(row.bwd_head, 0)]
                value, pullback = jax.vjp(lambda q, y: work.fns.head(q, y, work.mbs[at.bmb]), shared(work.params), y)
                dshared, dy = pullback(jnp.ones_like(value))
                return dshared, dy.astype(work.act_dtype), value.astype(jnp.float32)

        def no_head():
            return work.zeros_shared(), jnp.zeros_like(self.zeros_act), jnp.float32(0)
        return lax.cond(at.last_b, head, no_head)

    def backward_slot(self, carry: Carry, head_in, grad_buf, stash, prefix, row: TickRow, at: Picks):
        """(gradient sums, dx to send back, the taps' cotangents for W, the head's output).

        The branches return gradients and the sums happen outside them: a branch that passes the
        accumulators through unchanged makes XLA:GPU copy them every tick (see `stash.Stash`). The
        shared leaves' sum (embedding, head) then runs every tick on every stage: one pass over
        them, where the copy it replaces made two."""
        work, ring = self.work, self.rings.stash
        dshared, dy_head, value = self.head(head_in, row, at)
        dy = jnp.where(at.last_b, dy_head, grad_buf[jnp.maximum(row.bwd_grad, 0)])

        def backward():
            with jax.named_scope(BACKWARD_SCOPE):
                druns, dx, for_w = work.backward(dy, ring.read(stash, row.bwd_stash), at.bc)
                dembed = lax.cond((work.rank == 0) & (at.bc == 0), self.embed_backward(prefix, row),
                                  lambda *_: work.zeros_shared(), dx, at.bmb)
                return druns, dembed, dx, for_w

        def no_backward():
            return zeros_like_shapes(self.rings.b_shapes[0]), work.zeros_shared(), \
                jnp.zeros_like(self.zeros_act), zeros_like_shapes(self.rings.b_shapes[2])

        druns, dembed, send_grad, for_w = lax.cond(at.has_b, backward, no_backward)
        grads = add_shared(carry.grads, jax.tree.map(jnp.add, dshared, dembed))
        return add_chunk(grads, druns, at.bc, work.layer_runs), send_grad, for_w, value

    def embed_backward(self, prefix: list, row: TickRow):
        """Virtual stage 0's (dx, mb) -> the embedding's (and dense prefix's) gradients, from the
        prefix stash's slot of the row's backward, read inside the branch: only stage 0 moves it
        (from the host, with offload)."""
        def embed_backward(dx, mb):
            leaves = self.rings.prefix.read(prefix, jnp.maximum(row.bwd_prefix, 0)) if prefix else []
            return self.work.embed_backward(dx, mb, leaves)
        return embed_backward

    def weight_slot(self, grads, stash, w_stash, for_w, row: TickRow):
        """Split schedules: B's cotangents into the W stash, then the row's W (a W may take its
        own tick's B) added to the sums. (grads, stash, W stash)."""
        if self.w_work is None:
            return grads, stash, w_stash
        shared_stash = self.rings.plan.shared_stash
        held = self.rings.w.write(stash if shared_stash else w_stash, row.bwd_wstash, for_w)
        grads = weight_slot(self.w_work, held, row, grads, self.work.layer_runs)
        return (grads, held, w_stash) if shared_stash else (grads, stash, held)

    def send(self, send_act, send_grad):
        # [b, s(/t), h] each -> the same from stages i - 1 and i + 1 ([3, b, s(/t), h] in a V: `Links`)
        return self.links.send(send_act, +1), self.links.send(send_grad, -1)


def weight_work(split, w_ring, taps_def):
    """W as a function (W stash, slot) -> per run, {kernel path: gradient} of the chunk whose
    taps' cotangents (each matmul's X and dY, `taps_def`'s leaves) are in that slot."""
    def work(w_stash, slot):
        with jax.named_scope(WEIGHT_SCOPE):
            cotangents = jax.tree.unflatten(taps_def, w_ring.read(w_stash, slot))
            return tuple(map(split.weight_grads, cotangents))
    return work


def weight_slot(w_work, w_stash, row: TickRow, grads, layer_runs):
    """grads + the weight slot's W (when the row has one): its kernels' gradients, on its chunk's rows."""
    def no_weight():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    shapes = jax.eval_shape(w_work, w_stash, 0)
    dkernels = lax.cond(row.w_mb != NONE, lambda: w_work(w_stash, jnp.maximum(row.w_wstash, 0)), no_weight)
    return add_chunk(grads, dkernels, jnp.maximum(row.w_chunk, 0), layer_runs)

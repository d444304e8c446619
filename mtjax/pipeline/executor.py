"""One executor for every schedule table: a `lax.scan` over ticks inside `shard_map`.

Shape legend: m micro-batches, b micro-batch, s sequence, h hidden, t tensor
size, p stages, v chunks per stage (interleaving), L = l/(p v) layers per
chunk; the activation a stage sends is [b, s, h] ([b, s/t, h] with sequence
parallelism). Stage i holds v L layers in the order it runs them (`layer_order.py`):
chunk c, virtual stage j = c p + i, is rows [c L, (c+1) L) of its `layers` shard.
Every stage holds the embedding and head, used only by virtual stages 0 and p v - 1.
zbv's V layout puts virtual stages i and 2p - 1 - i on stage i instead (so stage 0 runs the
embedding and the head) and moves values both ways (`Links`).

Each tick, every device reads its stage's row of the tables (`TickRow`) and
  1. files the activation and the gradient that arrived from the previous tick's
     sends into their slots (`buffers.plan_buffers`);
  2. forward slot: embeds its micro-batch (virtual stage 0; outside the vjp, its
     backward recomputes the lookup; a dense prefix after it under a vjp of its own, its
     residuals in the prefix stash) or reads the arrived activation, runs the chunk's
     layer runs under `jax.vjp`, and stashes the residuals the
     backward needs, i.e. what `train.recompute` saves (none: all of them; selective:
     all but the attention core; full: each layer's input) -- weights are not
     stashed, the backward reads them from the parameters. The last virtual stage
     also keeps its output, the head's input;
  3. backward slot: on the last virtual stage runs the head and the loss forward and
     backward (`jax.vjp`), then any stage pulls the incoming gradient back through the
     stashed residuals; parameter gradients are accumulated in fp32. A split schedule
     (zb, zbv) computes only B here: the input gradient and the non-matmul weights'
     gradients, each matmul's (X, dY) going to the W stash (`parallel/taps.py`);
  3b. weight slot (split schedules): W, the matmul weights' gradients X^T dY of a chunk
     whose B ran at this tick or earlier, from its W-stash slot;
  4. sends the forward's output to the next virtual stage and the input gradient to
     the previous one (`ppermute` over `pipe`; cyclic when interleaving, since virtual
     stage c p + p - 1 feeds c p + p on stage 0).
`lax.cond` runs only the taken branch, so an empty slot costs nothing. A pipelined
step therefore computes each chunk's forward once (plus what `train.recompute`
recomputes), as a step without pipelining does. The branches only compute: they
return activations, residuals and gradients, and every buffer of the carry is
written outside them (`stash.Stash` says why).

The caller hands in the model as three functions (`StageFns`, plus `SplitFns` for B/W), so this package
knows nothing of training. The work of each slot runs under a `jax.named_scope`
(`*_SCOPE`), so that the executed-FLOPs count can weight each by the ticks that take it.

Where each part lives: the tick's five steps in `tick.py` (`Tick`), the work of one chunk
(forward, backward, embedding backward, where gradients land) in `chunk.py`, the sends and the
filing of arrivals in `links.py`, and the last tick with the data-reduction sink in `sink.py`.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.mesh import PIPE
from mtjax.pipeline.buffers import plan_buffers
from mtjax.pipeline.chunk import (EMBED_SCOPE, StageWork, chunk_runs, dropout_key, shared, traced_virtual_stage,
                                  zeros_like_shapes)
from mtjax.pipeline.links import Links
from mtjax.pipeline.schedules import NONE, Schedule
from mtjax.pipeline.sink import final_tick
from mtjax.pipeline.stash import Stash, stash_rings
from mtjax.pipeline.table import stage_and_chunk
from mtjax.pipeline.tick import (BACKWARD_SCOPE, FINAL_SCOPE, FORWARD_SCOPE, HEAD_SCOPE, WEIGHT_SCOPE, Carry, Rings,
                                 Tick, TickRow, row_of, weight_work)

__all__ = ["BACKWARD_SCOPE", "EMBED_SCOPE", "FINAL_SCOPE", "FORWARD_SCOPE", "HEAD_SCOPE", "WEIGHT_SCOPE", "SplitFns",
           "StageFns", "TickRow", "last_backward_reduces", "pipeline_forward", "pipeline_grads", "stage_activation_shape"]


class StageFns(NamedTuple):
    """The model, as a stage runs it. `shared` is the parameter tree without `layers`; `runs`
    is one chunk's L layers cut into the row runs the model scans (`layer_runs`, e.g. block
    recomputation's (N, L - N)), a tuple of stacks; `key` is a dropout key (or None when
    deterministic).
      embed(shared, tokens [b, s+1], key) -> x [b, s(/t), h]
      layers(shared, runs, x, key, sinks=None, tokens=None) -> y [b, s(/t), h]   (differentiated in
          runs and x, and in `sinks`, one slot tree per run, when the step reduces over `data` in
          the last backward: `last_backward_reduces`; `tokens`, the micro-batch's [b, s+1], for
          what the layers read off the rows: packed rows' documents)
      head(shared, y, tokens [b, s+1]) -> the micro-batch's output (a scalar loss sum when
                                          training; anything when evaluating)
    `prefix`: whether `embed` also runs layers (a dense prefix): then its residuals are stashed
    for its backward, in a ring of their own, rather than its forward run again there.
    """
    embed: Callable
    layers: Callable
    head: Callable
    split: "SplitFns | None" = None
    prefix: bool = False


class SplitFns(NamedTuple):
    """What a split schedule (B and W, `zero_bubble`) needs beyond `StageFns` (`parallel/taps.py`):
      taps(shared, runs, x) -> per run, zero taps; `StageFns.layers(..., taps)` runs them, and the
                               taps' cotangents are each matmul's (X, dY)
      weights(run, its taps) -> (its tapped matmul weights, the rest), flat {path: leaf} dicts;
                               join(kernels, rest) -> run
      weight_grads(tap cotangents of a run) -> {path: gradient} of its matmul weights (W)
    """
    taps: Callable
    weights: Callable
    join: Callable
    weight_grads: Callable


def stage_activation_shape(micro_batch: int, seq_len: int, hidden: int, tensor: int,
                           sequence_parallel: bool) -> tuple[int, int, int]:
    """[b, s, h], or [b, s/t, h] when sequence parallelism is active (the caller's resolved flag)."""
    s = seq_len // tensor if sequence_parallel else seq_len
    return (micro_batch, s, hidden)


def last_backward_reduces(schedule: Schedule) -> bool:
    """Whether the table's last tick holds stage 0's last backward and nothing else, with one
    chunk per stage (GPipe, 1F1B). Then `pipeline_grads` can run that tick after the loop with
    the data reduction inside its backward (see there)."""
    t = schedule.ticks - 1
    f, b, w = schedule.forward_mb[t], schedule.backward_mb[t], schedule.weight_mb[t]
    return bool(schedule.chunks == 1 and (f == NONE).all() and (w == NONE).all()
                and b[0] != NONE and (b[1:] == NONE).all())


def pipeline_grads(fns: StageFns, params, mbs, keys, schedule: Schedule, act_shape, act_dtype,
                   layer_runs: tuple[int, ...], offload: bool = False, sink_slots: Callable | None = None):
    """Run `schedule` (with backwards) over micro-batches mbs [m, b, s+1].

    Returns (local fp32 gradient sums shaped like `params`, local sum of the head's outputs,
    `into`). `params` holds this stage's v chunks of L = sum(layer_runs) layers; leaves are in
    the dtype the model computes with. `offload` keeps the stash in host memory (`stash.Stash`).

    `sink_slots` (earlier fp32 sums of the `layers` leaves [L, ...] -> the data-reduction sink's
    slots, `grad_reduce.sink_slots`; with `fns.layers` taking them) asks for Megatron's overlap of
    the data reduction with the backward. Where the table allows it (`last_backward_reduces`) the
    last tick runs after the loop (`final_tick`): stage 0 differentiates its last micro-batch
    through the sink, whose backward reduces layer l's G_l + g_l over `data` while the layers
    below are differentiated; every other stage, idle at that tick since its own last backward,
    runs the same program with a zero gradient (g_l = 0 exactly), so that its reduction of G_l
    runs there too, where it costs no time: a lockstep tick lasts as long as stage 0's backward.
    `into` is then the sink slots' cotangents (the reduced layer gradients, `grad_reduce`), and
    the gradient sums hold zeros where they went; otherwise `into` is None.

    The embedding runs outside the forward's `jax.vjp` (on virtual stage 0 only): its backward
    in the backward slot recomputes the lookup, so no stash slot carries its residuals (a
    `lax.cond` inside the pullback would make every slot carry them). A dense prefix after it
    (`fns.prefix`) is layers, not to be run twice: it runs under a `jax.vjp` of its own in
    virtual stage 0's branch, its residuals (what `train.recompute` saves) going to a ring of their
    own, the prefix stash (`buffers.plan_buffers`: sized for stage 0's chunk 0 alone).

    A split schedule (`schedule.split`, with `fns.split`) runs each backward as two work items:
    the backward slot's B pulls dy back to the chunk's input and to the weights that are not
    matmul kernels (norms, biases), with the kernels held constant, and files the taps'
    cotangents, each matmul's (X, dY), in the W stash; the weight slot's W turns them into the
    kernels' gradients (`SplitFns.weight_grads`, X^T dY), ticks later.
    """
    rank = lax.axis_index(PIPE)
    zeros_act = jnp.zeros(act_shape, act_dtype)
    work = StageWork(fns, params, mbs, keys, act_dtype, layer_runs,
                     fns.split if schedule.split else None, rank, (schedule.layout, schedule.stages))
    tick, plan = _make_tick(work, schedule, offload, zeros_act)
    tables = {k: jnp.asarray(a) for k, a in vars(plan.tables).items()}
    carry = _empty_carry(tick, params, act_shape, act_dtype)
    reduce_last = sink_slots is not None and last_backward_reduces(schedule)
    loop_ticks = schedule.ticks - 1 if reduce_last else schedule.ticks
    carry, _ = lax.scan(lambda c, t: tick(c, row_of(tables, t, rank)), carry, jnp.arange(loop_ticks))
    if not reduce_last:
        return carry.grads, carry.loss, None
    grads, into = final_tick(tick, carry, row_of(tables, schedule.ticks - 1, rank), sink_slots)
    return grads, carry.loss, into


def _make_tick(work: StageWork, schedule: Schedule, offload: bool, zeros_act):
    """(the tick function, the buffer plan): the stash rings sized from one forward's residuals
    and one backward's W-stash leaves, traced abstractly."""
    stash_shapes, prefix_shapes = jax.eval_shape(lambda: work.forward(zeros_act, work.mbs[0], 0, 0)[1:])
    b_shapes = jax.eval_shape(lambda: work.backward(zeros_act, zeros_like_shapes(stash_shapes), 0))
    plan, stash_ring, w_ring = stash_rings(schedule, offload, jax.tree.leaves(stash_shapes), b_shapes[2])
    w_work = None
    if work.split is not None:
        taps = jax.eval_shape(lambda: work.split.taps(shared(work.params),
                                                      chunk_runs(work.params, 0, work.layer_runs), zeros_act))
        w_work = weight_work(work.split, w_ring, jax.tree.structure(taps))
    rings = Rings(plan, stash_ring, w_ring, stash_shapes, b_shapes, Stash(offload), list(prefix_shapes))
    return Tick(work, schedule, rings, zeros_act, w_work), plan


def _empty_carry(tick: Tick, params, act_shape, act_dtype) -> Carry:
    plan, rings, zeros_act = tick.rings.plan, tick.rings, tick.zeros_act
    return Carry(grads=jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), params),
                 acts=jnp.zeros((plan.act_slots, *act_shape), act_dtype),
                 grad_buf=jnp.zeros((plan.grad_slots, *act_shape), act_dtype),
                 stash=rings.stash.empty(rings.stash_shapes, plan.stash_slots),
                 head_in=jnp.zeros((plan.head_slots, *act_shape), act_dtype),
                 recv_act=tick.links.empty(zeros_act), recv_grad=tick.links.empty(zeros_act), loss=jnp.float32(0),
                 w_stash=rings.w.empty(rings.b_shapes[2], plan.w_stash_slots)
                 if tick.w_work is not None and not plan.shared_stash else [],
                 prefix=rings.prefix.empty(rings.prefix_shapes, plan.prefix_slots))


def pipeline_forward(fns: StageFns, params, mbs, keys, schedule: Schedule, act_shape, act_dtype,
                     layer_runs: tuple[int, ...], out_shape: jax.ShapeDtypeStruct):
    """Run a forward-only `schedule` over mbs [m, b, s+1]: -> [m, *out_shape], the head's output
    per micro-batch on the last stage (zeros on the others; the caller sums over `pipe`)."""
    p, v = schedule.stages, schedule.chunks
    plan = plan_buffers(schedule)
    rank = lax.axis_index(PIPE)
    tables = {k: jnp.asarray(a) for k, a in vars(plan.tables).items()}
    zeros_act = jnp.zeros(act_shape, act_dtype)
    m = schedule.micro_batches
    links, (last_rank, last_chunk) = Links(p, v, schedule.layout), stage_and_chunk(schedule.layout, p, p * v - 1)

    def tick(carry, t):
        acts, recv, outs = carry
        row = row_of(tables, t, rank)
        acts = links.file(acts, recv, (row.act_in_prev, row.act_in_next, row.act_in_self), +1)
        mb, c = jnp.maximum(row.fwd_mb, 0), jnp.maximum(row.fwd_chunk, 0)
        last = (row.fwd_mb != NONE) & (rank == last_rank) & (c == last_chunk)

        def forward():
            with jax.named_scope(FORWARD_SCOPE):
                key = dropout_key(keys, mb, traced_virtual_stage(schedule.layout, p, rank, c))
                x = lax.cond((rank == 0) & (c == 0),
                             lambda: fns.embed(shared(params), mbs[mb], key).astype(act_dtype),
                             lambda: acts[jnp.maximum(row.fwd_act, 0)])
                return fns.layers(shared(params), chunk_runs(params, c, layer_runs), x, key,
                                  tokens=mbs[mb]).astype(act_dtype)

        send = lax.cond(row.fwd_mb != NONE, forward, lambda: jnp.zeros_like(zeros_act))

        def head():
            with jax.named_scope(HEAD_SCOPE):
                return fns.head(shared(params), send, mbs[mb]).astype(out_shape.dtype)

        # written outside the cond, into row m when there is nothing to write (see `stash.Stash`)
        out = lax.cond(last, head, lambda: jnp.zeros(out_shape.shape, out_shape.dtype))
        outs = lax.dynamic_update_index_in_dim(outs, out, jnp.where(last, mb, m), 0)
        recv = links.send(send, +1)
        return (acts, recv, outs), None

    carry = (jnp.zeros((plan.act_slots, *act_shape), act_dtype), links.empty(zeros_act),
             jnp.zeros((m + 1, *out_shape.shape), out_shape.dtype))
    (_, _, outs), _ = lax.scan(tick, carry, jnp.arange(schedule.ticks))
    return outs[:m]

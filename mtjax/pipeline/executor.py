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
     backward recomputes the lookup) or reads the arrived activation, runs the chunk's
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
(`SCOPES`), so that the executed-FLOPs count can weight each by the ticks that take it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict
from jax import lax

from mtjax.mesh import PIPE
from mtjax.pipeline.buffers import plan_buffers
from mtjax.pipeline.schedules import NONE, Schedule
from mtjax.pipeline.stash import stash_rings
from mtjax.pipeline.table import stage_and_chunk

# named scopes of the tick loop's kinds of work (see `scope_ticks`)
FORWARD_SCOPE, BACKWARD_SCOPE, HEAD_SCOPE = "pipeline_forward", "pipeline_backward", "pipeline_head"
WEIGHT_SCOPE = "pipeline_weight"


class StageFns(NamedTuple):
    """The model, as a stage runs it. `shared` is the parameter tree without `layers`; `runs`
    is one chunk's L layers cut into the row runs the model scans (`layer_runs`, e.g. block
    recomputation's (N, L - N)), a tuple of stacks; `key` is a dropout key (or None when
    deterministic).
      embed(shared, tokens [b, s+1], key) -> x [b, s(/t), h]
      layers(shared, runs, x, key, sinks=None) -> y [b, s(/t), h]   (differentiated in runs and x,
          and in `sinks`, one slot tree per run, when the step reduces over `data` in the last
          backward: `last_backward_reduces`)
      head(shared, y, tokens [b, s+1]) -> the micro-batch's output (a scalar loss sum when
                                          training; anything when evaluating)
    """
    embed: Callable
    layers: Callable
    head: Callable
    split: "SplitFns | None" = None


class SplitFns(NamedTuple):
    """What a split schedule (B and W, `zero_bubble`) needs beyond `StageFns` (`parallel/taps.py`):
      taps(shared, runs, x) -> per run, zero taps; `StageFns.layers(..., taps)` runs them, and the
                               taps' cotangents are each matmul's (X, dY)
      weights(run) -> (its matmul weights, the rest), flat {path: leaf} dicts; join(kernels, rest) -> run
      weight_grads(tap cotangents of a run) -> {path: gradient} of its matmul weights (W)
    """
    taps: Callable
    weights: Callable
    join: Callable
    weight_grads: Callable


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
    bwd_mb: jax.Array
    bwd_chunk: jax.Array
    bwd_grad: jax.Array
    bwd_stash: jax.Array
    bwd_head: jax.Array
    bwd_wstash: jax.Array
    w_mb: jax.Array
    w_chunk: jax.Array
    w_wstash: jax.Array


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


def stage_activation_shape(micro_batch: int, seq_len: int, hidden: int, tensor: int,
                           sequence_parallel: bool) -> tuple[int, int, int]:
    """[b, s, h], or [b, s/t, h] when sequence parallelism is active (the caller's resolved flag)."""
    s = seq_len // tensor if sequence_parallel else seq_len
    return (micro_batch, s, hidden)


def scope_ticks(schedule: Schedule) -> list[dict[str, int]]:
    """Per stage, how many ticks run each scope's work: forwards, backwards (B when split), the
    head (the backwards of the last virtual stage) and, split, the weight gradients (W)."""
    p, v = schedule.stages, schedule.chunks
    has_f, has_b = schedule.forward_mb != NONE, schedule.backward_mb != NONE
    has_w = schedule.weight_mb != NONE
    last_rank, last_chunk = stage_and_chunk(schedule.layout, p, p * v - 1)
    head = has_b & (schedule.backward_chunk == last_chunk)
    return [{FORWARD_SCOPE: int(has_f[:, i].sum()), BACKWARD_SCOPE: int(has_b[:, i].sum()),
             HEAD_SCOPE: int(head[:, i].sum()) if i == last_rank else 0, WEIGHT_SCOPE: int(has_w[:, i].sum())}
            for i in range(p)]


def _shared(params):
    """The parameters outside the layer stack (embedding, positions, final norm, head)."""
    return {k: w for k, w in params.items() if k != "layers"}


def _run_starts(layer_runs) -> list[int]:
    return [sum(layer_runs[:k]) for k in range(len(layer_runs))]


def _chunk_runs(params, c, layer_runs) -> tuple:
    """Chunk c's rows [c L, (c+1) L) of every `layers` leaf, cut into runs of `layer_runs` rows
    (L = their sum). Cut here, outside the forward's `jax.vjp`, so that each run's weights are
    the pullback's inputs and `_Residuals` can leave them out of the stash."""
    return _rows(params["layers"], c, layer_runs)


def _rows(stack, c, layer_runs) -> tuple:
    """Chunk c's rows of every leaf of a stacked tree ([v L, ...]), cut into `layer_runs`."""
    size = sum(layer_runs)
    return tuple(jax.tree.map(lambda w, a=a, n=n: lax.dynamic_slice_in_dim(w, c * size + a, n), stack)
                 for a, n in zip(_run_starts(layer_runs), layer_runs))


def _add_shared(grads, dshared):
    """grads + dshared (in fp32) on the leaves outside the layer stack."""
    return {**grads, **{k: jax.tree.map(lambda a, d: a + d.astype(a.dtype), grads[k], dshared[k])
                        for k in dshared}}


def _add_chunk(grads, druns, c, layer_runs):
    """grads + druns (in fp32), run k landing on its rows of chunk c. A run's gradients are a tree
    shaped like the run, or a flat {path: leaf} dict of some of its leaves (split schedules)."""
    size = sum(layer_runs)

    def add_rows(acc, d, a):
        rows = lax.dynamic_slice_in_dim(acc, c * size + a, d.shape[0])
        return lax.dynamic_update_slice_in_dim(acc, rows + d.astype(acc.dtype), c * size + a, 0)
    layers = flatten_dict(grads["layers"])
    for a, d in zip(_run_starts(layer_runs), druns):
        for path, g in _flat(d).items():
            layers[path] = add_rows(layers[path], g, a)
    return {**grads, "layers": unflatten_dict(layers)}


def _flat(tree) -> dict:
    """{path: leaf} of a nested dict; a dict already flat (tuple keys) as it is."""
    return tree if all(isinstance(k, tuple) for k in tree) else flatten_dict(tree)


def _put(buf, slot, value):
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
            return lax.ppermute(value, PIPE, _ring(self.p, self.v, step))            # [b, s(/t), h]
        up = lax.ppermute(value, PIPE, _ring(self.p, 1, +1))                          # [b, s(/t), h] to i + 1
        down = lax.ppermute(value, PIPE, _ring(self.p, 1, -1))                        # [b, s(/t), h] to i - 1
        return jnp.stack([up, down, value])

    def file(self, buf, arrived, slots: tuple, step: int):
        """buf with what arrived filed; `slots` = the row's (prev, next, self) slots of this kind."""
        if not self.v_layout:   # activations come from the previous stage, gradients from the next
            return _put(buf, slots[0] if step > 0 else slots[1], arrived)
        for k, slot in enumerate(slots):
            buf = _put(buf, slot, arrived[k])
        return buf


def _key(keys, mb, c):
    return None if keys is None else jax.random.fold_in(keys[mb], c)


class _Residuals:
    """Turns `jax.vjp`'s pullback into stash leaves and back.

    A pullback is a pytree whose leaves are its residuals. The leaves that are the
    parameters themselves (the weights every matmul's backward reads) are not stashed:
    they are taken again from the parameters in the backward slot. The rest are this
    micro-batch's activations, dropout masks and the like, the stash proper."""

    def __init__(self):
        self.treedef = None
        self.from_params = None   # per leaf: index into the parameter leaves, or None (stashed)

    def split(self, pullback, params) -> list:
        leaves, self.treedef = jax.tree.flatten(pullback)
        plist = jax.tree.leaves(params)
        self.from_params = [next((k for k, w in enumerate(plist) if leaf is w), None) for leaf in leaves]
        return [leaf for leaf, k in zip(leaves, self.from_params) if k is None]

    def join(self, stashed: list, params):
        plist, it = jax.tree.leaves(params), iter(stashed)
        leaves = [next(it) if k is None else plist[k] for k in self.from_params]
        return jax.tree.unflatten(self.treedef, leaves)


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
    `lax.cond` inside the pullback would make every slot carry them).

    A split schedule (`schedule.split`, with `fns.split`) runs each backward as two work items:
    the backward slot's B pulls dy back to the chunk's input and to the weights that are not
    matmul kernels (norms, biases), with the kernels held constant, and files the taps'
    cotangents, each matmul's (X, dY), in the W stash; the weight slot's W turns them into the
    kernels' gradients (`SplitFns.weight_grads`, X^T dY), ticks later.
    """
    p, v = schedule.stages, schedule.chunks
    rank = lax.axis_index(PIPE)
    zeros_act = jnp.zeros(act_shape, act_dtype)
    residuals = _Residuals()
    links, (last_rank, last_chunk) = Links(p, v, schedule.layout), stage_and_chunk(schedule.layout, p, p * v - 1)
    split = fns.split if schedule.split else None

    def embed(tokens, key):
        return fns.embed(_shared(params), tokens, key).astype(act_dtype)

    def chunk_vjp(runs, x, key):
        """(y, pullback) of one chunk: unsplit, the pullback of (runs, x); split, of (the runs'
        weights other than matmul kernels, x, zero taps), the kernels held constant, so that
        autodiff leaves out their gradients (W's work) and returns the taps' (X, dY)."""
        shared = _shared(params)
        if split is None:
            return jax.vjp(lambda runs, x: fns.layers(shared, runs, x, key), runs, x)
        kernels, rest = zip(*map(split.weights, runs))
        def run(rest, x, taps):
            return fns.layers(shared, tuple(map(split.join, kernels, rest)), x, key, taps)
        return jax.vjp(run, tuple(rest), x, split.taps(shared, runs, x))

    def chunk_forward(x_in, tokens, mb, c):
        """(y, stash leaves) of chunk c: the residuals its backward needs, weights excluded."""
        runs, key = _chunk_runs(params, c, layer_runs), _key(keys, mb, c)
        x = lax.cond((rank == 0) & (c == 0), lambda: embed(tokens, key), lambda: x_in)
        y, pullback = chunk_vjp(runs, x, key)
        return y.astype(act_dtype), residuals.split(pullback, runs)

    def chunk_backward(dy, stashed, c):
        """(gradients of the chunk's runs (split: the non-kernel leaves), dx, the taps' cotangents
        as W-stash leaves (split; else none))."""
        runs = _chunk_runs(params, c, layer_runs)
        grads = residuals.join(stashed, runs)(dy)
        return grads[0], grads[1].astype(act_dtype), jax.tree.leaves(grads[2:])

    def embed_backward(dx, mb):
        """The embedding's gradient from dx [b, s(/t), h], virtual stage 0's input gradient."""
        _, pullback = jax.vjp(lambda q: fns.embed(q, mbs[mb], _key(keys, mb, 0)).astype(act_dtype),
                              _shared(params))
        return pullback(dx)[0]

    def zeros_shared():   # made inside each branch: a branch that returns a value from outside copies it
        return jax.tree.map(jnp.zeros_like, _shared(params))

    def zeros_like_shapes(shapes):
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)

    stash_shapes = jax.eval_shape(lambda: chunk_forward(zeros_act, mbs[0], 0, 0)[1])
    b_shapes = jax.eval_shape(lambda: chunk_backward(zeros_act, zeros_like_shapes(stash_shapes), 0))
    w_stash_shapes, w_work = b_shapes[2], None
    plan, stash_ring, w_ring = stash_rings(schedule, offload, jax.tree.leaves(stash_shapes), w_stash_shapes)
    tables = {k: jnp.asarray(a) for k, a in vars(plan.tables).items()}
    if split is not None:
        taps = jax.eval_shape(lambda: split.taps(_shared(params), _chunk_runs(params, 0, layer_runs), zeros_act))
        w_work = _weight_work(split, w_ring, jax.tree.structure(taps))

    def tick(carry: Carry, row: TickRow):
        acts = links.file(carry.acts, carry.recv_act, (row.act_in_prev, row.act_in_next, row.act_in_self), +1)
        grad_buf = links.file(carry.grad_buf, carry.recv_grad,
                              (row.grad_in_prev, row.grad_in_next, row.grad_in_self), -1)
        has_f, has_b = row.fwd_mb != NONE, row.bwd_mb != NONE
        fmb, fc = jnp.maximum(row.fwd_mb, 0), jnp.maximum(row.fwd_chunk, 0)
        bmb, bc = jnp.maximum(row.bwd_mb, 0), jnp.maximum(row.bwd_chunk, 0)
        last_b = has_b & (rank == last_rank) & (bc == last_chunk)

        def forward():
            with jax.named_scope(FORWARD_SCOPE):
                return chunk_forward(acts[jnp.maximum(row.fwd_act, 0)], mbs[fmb], fmb, fc)

        def no_forward():   # its residuals go to the spare slot, never read
            return jnp.zeros_like(zeros_act), zeros_like_shapes(stash_shapes)

        # written outside the cond (see `stash.Stash`): the head input and the stash
        send_act, res = lax.cond(has_f, forward, no_forward)
        head_in = _put(carry.head_in, row.fwd_head, send_act)
        stash = stash_ring.write(carry.stash, row.fwd_stash, res)

        # The branches return gradients and the sums happen outside them: a branch that passes the
        # accumulators through unchanged makes XLA:GPU copy them every tick (see `stash.Stash`). The
        # shared leaves' sum (embedding, head) then runs every tick on every stage: one pass over
        # them, where the copy it replaces made two.
        def head():
            with jax.named_scope(HEAD_SCOPE):
                y = head_in[jnp.maximum(row.bwd_head, 0)]
                value, pullback = jax.vjp(lambda q, y: fns.head(q, y, mbs[bmb]), _shared(params), y)
                dshared, dy = pullback(jnp.ones_like(value))
                return dshared, dy.astype(act_dtype), value.astype(jnp.float32)

        def no_head():
            return zeros_shared(), jnp.zeros_like(zeros_act), jnp.float32(0)

        dshared, dy_head, value = lax.cond(last_b, head, no_head)
        dy = jnp.where(last_b, dy_head, grad_buf[jnp.maximum(row.bwd_grad, 0)])

        def backward():
            with jax.named_scope(BACKWARD_SCOPE):
                druns, dx, for_w = chunk_backward(dy, stash_ring.read(stash, row.bwd_stash), bc)
                dembed = lax.cond((rank == 0) & (bc == 0), embed_backward, lambda *_: zeros_shared(), dx, bmb)
                return druns, dembed, dx, for_w

        def no_backward():
            return zeros_like_shapes(b_shapes[0]), zeros_shared(), jnp.zeros_like(zeros_act), \
                zeros_like_shapes(w_stash_shapes)

        druns, dembed, send_grad, for_w = lax.cond(has_b, backward, no_backward)
        grads = _add_shared(carry.grads, jax.tree.map(jnp.add, dshared, dembed))
        grads = _add_chunk(grads, druns, bc, layer_runs)
        w_stash = carry.w_stash
        if w_work is not None:      # the weight slot, after B (a W may take its own tick's B)
            held = w_ring.write(stash if plan.shared_stash else w_stash, row.bwd_wstash, for_w)
            grads = _weight_slot(w_work, held, row, grads, layer_runs)
            stash, w_stash = (held, w_stash) if plan.shared_stash else (stash, held)
        recv_act, recv_grad = links.send(send_act, +1), links.send(send_grad, -1)
        return Carry(grads, acts, grad_buf, stash, head_in, recv_act, recv_grad, carry.loss + value, w_stash), None

    carry = Carry(grads=jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), params),
                  acts=jnp.zeros((plan.act_slots, *act_shape), act_dtype),
                  grad_buf=jnp.zeros((plan.grad_slots, *act_shape), act_dtype),
                  stash=stash_ring.empty(stash_shapes, plan.stash_slots),
                  head_in=jnp.zeros((plan.head_slots, *act_shape), act_dtype),
                  recv_act=links.empty(zeros_act), recv_grad=links.empty(zeros_act), loss=jnp.float32(0),
                  w_stash=w_ring.empty(w_stash_shapes, plan.w_stash_slots)
                  if w_work is not None and not plan.shared_stash else [])
    if sink_slots is None or not last_backward_reduces(schedule):
        carry, _ = lax.scan(lambda c, t: tick(c, _row(tables, t, rank)), carry, jnp.arange(schedule.ticks))
        return carry.grads, carry.loss, None
    carry, _ = lax.scan(lambda c, t: tick(c, _row(tables, t, rank)), carry, jnp.arange(schedule.ticks - 1))
    row = _row(tables, schedule.ticks - 1, rank)

    def final_tick():
        """The last tick, outside the loop: one chunk's backward through the sink on every stage
        (stage 0's real one; the others' with dy = 0 on a stash slot of finite residuals)."""
        has_b = row.bwd_mb != NONE
        grad_buf = links.file(carry.grad_buf, carry.recv_grad,
                              (row.grad_in_prev, row.grad_in_next, row.grad_in_self), -1)
        dy = jnp.where(has_b, grad_buf[jnp.maximum(row.bwd_grad, 0)], jnp.zeros_like(zeros_act))
        stashed = stash_ring.read(carry.stash, jnp.maximum(row.bwd_stash, 0))
        runs, bmb = _chunk_runs(params, 0, layer_runs), jnp.maximum(row.bwd_mb, 0)
        slots = _rows(sink_slots(carry.grads["layers"]), 0, layer_runs)
        with jax.named_scope(BACKWARD_SCOPE):
            pullback = _sink_pullback(fns, params, runs, zeros_act, slots, _key(keys, bmb, 0), stashed)
            druns, dx, dslots = pullback(dy)
            dembed = lax.cond(rank == 0, embed_backward, lambda *_: zeros_shared(), dx.astype(act_dtype), bmb)
        grads = _add_chunk(_add_shared(carry.grads, dembed), druns, 0, layer_runs)
        into = jax.tree.map(lambda *r: jnp.concatenate(r, axis=0), *[d["into"] for d in dslots])
        return grads, into

    grads, into = final_tick()
    return grads, carry.loss, into


def _sink_pullback(fns: StageFns, params, runs, x, slots, key, stashed: list):
    """The pullback of one chunk's layers with the data-reduction sink, on residuals the forward
    stashed without it. Tracing the sink's forward only gives the pullback's structure: its
    activations are replaced by the stashed ones (the sink adds no residual of its own, its slots
    and the weights are the pullback's inputs), so XLA drops that forward as dead code."""
    _, pullback = jax.vjp(lambda runs, x, slots: fns.layers(_shared(params), runs, x, key, sinks=slots),
                          runs, x, slots)
    leaves, treedef = jax.tree.flatten(pullback)
    inputs = jax.tree.leaves((runs, slots))
    own = [k for k, leaf in enumerate(leaves) if not any(leaf is w for w in inputs)]
    shapes = lambda xs: [(a.shape, a.dtype) for a in xs]  # noqa: E731
    if shapes([leaves[k] for k in own]) != shapes(stashed):
        raise RuntimeError("the data-reduction sink changed the layers' residuals: "
                           f"{shapes([leaves[k] for k in own])} against the stash's {shapes(stashed)}")
    for k, r in zip(own, stashed):
        leaves[k] = r
    return jax.tree.unflatten(treedef, leaves)


def _weight_work(split: SplitFns, w_ring, taps_def):
    """W as a function (W stash, slot) -> per run, {kernel path: gradient} of the chunk whose
    taps' cotangents (each matmul's X and dY, `taps_def`'s leaves) are in that slot."""
    def work(w_stash, slot):
        with jax.named_scope(WEIGHT_SCOPE):
            cotangents = jax.tree.unflatten(taps_def, w_ring.read(w_stash, slot))
            return tuple(map(split.weight_grads, cotangents))
    return work


def _weight_slot(w_work, w_stash, row: TickRow, grads, layer_runs):
    """grads + the weight slot's W (when the row has one): its kernels' gradients, on its chunk's rows."""
    def no_weight():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    shapes = jax.eval_shape(w_work, w_stash, 0)
    dkernels = lax.cond(row.w_mb != NONE, lambda: w_work(w_stash, jnp.maximum(row.w_wstash, 0)), no_weight)
    return _add_chunk(grads, dkernels, jnp.maximum(row.w_chunk, 0), layer_runs)


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
        row = _row(tables, t, rank)
        acts = links.file(acts, recv, (row.act_in_prev, row.act_in_next, row.act_in_self), +1)
        mb, c = jnp.maximum(row.fwd_mb, 0), jnp.maximum(row.fwd_chunk, 0)
        last = (row.fwd_mb != NONE) & (rank == last_rank) & (c == last_chunk)

        def forward():
            with jax.named_scope(FORWARD_SCOPE):
                key = _key(keys, mb, c)
                x = lax.cond((rank == 0) & (c == 0),
                             lambda: fns.embed(_shared(params), mbs[mb], key).astype(act_dtype),
                             lambda: acts[jnp.maximum(row.fwd_act, 0)])
                return fns.layers(_shared(params), _chunk_runs(params, c, layer_runs), x, key).astype(act_dtype)

        send = lax.cond(row.fwd_mb != NONE, forward, lambda: jnp.zeros_like(zeros_act))

        def head():
            with jax.named_scope(HEAD_SCOPE):
                return fns.head(_shared(params), send, mbs[mb]).astype(out_shape.dtype)

        # written outside the cond, into row m when there is nothing to write (see `stash.Stash`)
        out = lax.cond(last, head, lambda: jnp.zeros(out_shape.shape, out_shape.dtype))
        outs = lax.dynamic_update_index_in_dim(outs, out, jnp.where(last, mb, m), 0)
        recv = links.send(send, +1)
        return (acts, recv, outs), None

    carry = (jnp.zeros((plan.act_slots, *act_shape), act_dtype), links.empty(zeros_act),
             jnp.zeros((m + 1, *out_shape.shape), out_shape.dtype))
    (_, _, outs), _ = lax.scan(tick, carry, jnp.arange(schedule.ticks))
    return outs[:m]


def _row(tables: dict, t, rank) -> TickRow:
    return TickRow(*(tables[k][t, rank] for k in TickRow._fields))


def _ring(p: int, v: int, step: int) -> list[tuple[int, int]]:
    """ppermute pairs to the next (step +1) or previous (-1) stage; cyclic when interleaving."""
    n = p if v > 1 else p - 1
    return [(i, (i + 1) % p) if step > 0 else ((i + 1) % p, i) for i in range(n)]

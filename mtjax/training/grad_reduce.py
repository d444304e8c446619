"""The gradients' reductions over `data` and `pipe`, and the data reduction that overlaps the
backward (Megatron's overlap_grad_reduce).

Shape legend: l layers (of this stage), d data size, c context size (the replicas are the d c
ranks of `data` and `context`); a layer leaf is [l, ...], one layer's slice of it [...].

Without the overlap the step sums its micro-batches' gradients locally, then reduces every leaf
over the replicas once: an all-reduce, or with the distributed optimizer a reduce-scatter along the
leaf's scatter dimension (`zero.scatter_dim`), this rank keeping the 1/(d c) block it updates.

With it (`overlaps_data_reduction`), the last micro-batch runs with a *sink* in the layer scan
(`block.scan_layers`): each layer's weights pass through an identity whose backward receives
that layer's weight gradient g_l as soon as the backward has made it and returns

    reduce_data(G_l + g_l)        G_l: the fp32 sum over the earlier micro-batches, layer l's slice

as the cotangent of the sink's `into` slot, a zero array of the reduced slice's shape. So layer
l's all-reduce or reduce-scatter runs inside the backward loop while the layers below are still
being differentiated, every gradient element still crosses the network once per step, and the
additions are those of the plain path, in the same order. A leaf whose scatter dimension is the
layer axis itself cannot be reduced a layer at a time (one layer is no rank's block): it passes
the sink untouched (AFTER) and is reduced after the backward with the leaves outside the layers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax.sharding import PartitionSpec as P

from mtjax.mesh import DATA, PIPE
from mtjax.parallel.fsdp import scan_fsdp
from mtjax.parallel.gloo import psum_scatter
from mtjax.training.plan import StepPlan

AFTER = "after"      # a layer leaf reduced after the backward, not in it


def _reduce_leaf(g, dim, axes):
    # partial -> summed: g's shape, or with `dim` this rank's 1/r block along it (r the ranks of `axes`)
    return lax.psum(g, axes) if dim is None else psum_scatter(g, axes, dim)


def reduce_over_data(grads, scatter_dims, done=None, axes=(DATA,)):
    """All-reduce over `axes` (the replicas: `data`, and `context` with context parallelism), or
    with the distributed optimizer (`scatter_dims` a tree of dims) reduce-scatter each leaf along
    its scatter dimension. `done`: a tree of bools, True where the leaf was reduced already (in the
    backward, `data_reduction_sink`)."""
    dims = jax.tree.map(lambda _: None, grads) if scatter_dims is None else scatter_dims
    done = jax.tree.map(lambda _: False, grads) if done is None else done
    return jax.tree.map(lambda g, k, ok: g if ok else _reduce_leaf(g, k, axes), grads, dims, done,
                        is_leaf=lambda x: x is None)


def reduce_over_pipe(grads, replicated, scatter_dims):
    """Sum over `pipe` the gradients of the pipe-replicated leaves (embedding, positions, final
    norm, head: only the first/last stage holds a share): reduce-scattered along the dimension the
    optimizer state splits over `pipe`, all-reduced where it does not (`scatter_dims` None or a
    leaf's None). Before the `data` reduction, whose blocks are minor to the pipe blocks."""
    dims = jax.tree.map(lambda _: None, replicated) if scatter_dims is None else scatter_dims

    def one(g, r, k):
        if not r:
            return g
        return lax.psum(g, PIPE) if k is None else psum_scatter(g, PIPE, k)   # g's shape, or its 1/p along k
    return jax.tree.map(one, grads, replicated, dims)


def overlaps_data_reduction(plan: StepPlan) -> bool:
    """Whether the step asks to reduce the layers' gradients over `data` (and `context`) inside the
    last micro-batch's backward: with data (or context) parallelism and without activation offload (the last
    micro-batch runs outside the micro-batch scan or the tick loop, where JAX (0.10.2) refuses the
    moves to host memory inside `shard_map`). With a pipeline the executor does it where its
    table allows (`pipeline.executor.last_backward_reduces`)."""
    # fsdp in the layer scan: reduced in every backward; fsdp per step (a pipeline's): as here
    return plan.replicas > 1 and not plan.recompute.offload and scan_fsdp(plan.fsdp) is None


def last_tick_after_loop(plan: StepPlan) -> bool:
    """Whether the pipelined step runs its table's last tick after the tick loop, with the data
    reduction in its backward (`pipeline.executor.pipeline_grads`' sink)."""
    from mtjax.pipeline.executor import last_backward_reduces
    return plan.pipe > 1 and overlaps_data_reduction(plan) and last_backward_reduces(plan.schedule)


def fsdp_sharded(plan: StepPlan, tree):
    """A tree of bools shaped like the parameters: True on the layer leaves FSDP holds as shards
    (their gradients are reduce-scattered inside each backward, `parallel/fsdp.py`): none where a
    pipelined step gathers the stage's layers once (`Fsdp.per_step`)."""
    if scan_fsdp(plan.fsdp) is None:
        return jax.tree.map(lambda _: False, tree)
    out = {k: jax.tree.map(lambda _: False, v) for k, v in tree.items() if k != "layers"}
    out["layers"] = jax.tree.map(lambda k: k is not None, plan.fsdp.dim_tree(), is_leaf=lambda x: x is None)
    return out


def held_by_replicas(specs, axes):
    """True per leaf split over the replica `axes` themselves (an MoE layer's experts at e = d c,
    `model/moe.py`): each rank's gradient is complete for the part it holds, and nothing is
    reduced over the replicas."""
    return jax.tree.map(lambda s: any(a in (n if isinstance(n, tuple) else (n,)) for a in axes for n in s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def layer_dims(plan: StepPlan, layers):
    """Per leaf of the `layers` subtree: how one layer's slice is reduced in the backward: None
    (all-reduce), k (reduce-scatter along the slice's dim k, the leaf's k + 1), or AFTER (the
    leaf's scatter dimension is the layer axis, or the leaf is held by the replicas: passed
    through, and `make_grad_fn` leaves it alone)."""
    split = plan.split.data_dims
    if split is None:
        dims = jax.tree.map(lambda _: None, layers)
    else:
        dims = jax.tree.map(lambda k: None if k is None else (AFTER if k == 0 else k - 1), split["layers"],
                            is_leaf=lambda x: x is None)
    held = held_by_replicas(plan.params.specs["layers"], plan.replica_axes)
    return jax.tree.map(lambda k, h: AFTER if h else k, dims, held, is_leaf=lambda x: x is None)


def sink_slots(earlier, dims, d: int) -> dict:
    """The sink's inputs for the layer stacks: `earlier` (the fp32 sums [l, ...]) and `into`,
    zeros [l, ...] shaped like each layer's reduced slice ([l, 0] for AFTER leaves)."""
    def receiver(e, k):
        if k == AFTER:
            return jnp.zeros((e.shape[0], 0), e.dtype)
        shape = list(e.shape)
        if k is not None:
            shape[k + 1] //= d
        return jnp.zeros(shape, e.dtype)
    return {"earlier": earlier, "into": jax.tree.map(receiver, earlier, dims, is_leaf=lambda x: x is None)}


def data_reduction_sink(dims, axes=(DATA,)):
    """sink(weights, slots) -> weights, for one layer (see the module docstring). Backward: the
    weights' cotangent is zero where the reduction took the gradient (the AFTER leaves keep theirs),
    `into`'s is the reduced G_l + g_l."""
    @jax.custom_vjp
    def sink(weights, slots):
        return weights

    def forward(weights, slots):
        return weights, slots

    def backward(slots, d_weights):
        def one(e, r, g, k):
            if k == AFTER:
                return g, jnp.zeros_like(r)
            # one layer's slice [...] -> reduced: the same, or its 1/(d c) block along k (`into`'s shape)
            return jnp.zeros_like(g), _reduce_leaf(e + g.astype(e.dtype), k, axes)
        out = jax.tree.map(one, slots["earlier"], slots["into"], d_weights, dims, is_leaf=lambda x: x is None)
        is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
        d_w = jax.tree.map(lambda p: p[0], out, is_leaf=is_pair)
        into = jax.tree.map(lambda p: p[1], out, is_leaf=is_pair)
        return d_w, {"earlier": jax.tree.map(jnp.zeros_like, slots["earlier"]), "into": into}

    sink.defvjp(forward, backward)
    return sink


def take_sunk(total, into, dims):
    """(gradients, done) after a backward through the sink: the layer leaves it reduced come from
    `into` (the slots' cotangents) and are `done`; the AFTER leaves and those outside the layers
    keep `total`, the local sums, to be reduced after."""
    after = jax.tree.map(lambda k: k == AFTER, dims, is_leaf=lambda x: x is None)
    layers = jax.tree.map(lambda t, r, late: t if late else r, total["layers"], into, after)
    done = {k: jax.tree.map(lambda _: False, v) for k, v in total.items() if k != "layers"}
    done["layers"] = jax.tree.map(lambda late: not late, after)
    return {**total, "layers": layers}, done

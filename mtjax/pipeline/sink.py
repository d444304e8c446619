"""The last tick with the data reduction inside its backward (Megatron's overlap of the data
reduction with the backward, where the table allows it: `executor.last_backward_reduces`).

The tick runs after the loop: stage 0 differentiates its last micro-batch through the sink,
whose backward reduces layer l's G_l + g_l over `data` while the layers below are
differentiated; every other stage, idle at that tick since its own last backward, runs the same
program with a zero gradient (g_l = 0 exactly), so that its reduction of G_l runs there too.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.pipeline.chunk import add_chunk, add_shared, chunk_runs, rows, shared
from mtjax.pipeline.table import NONE
from mtjax.pipeline.tick import FINAL_SCOPE, Carry, Tick, TickRow


def final_tick(tick: Tick, carry: Carry, row: TickRow, sink_slots):
    """(gradient sums, the sink slots' cotangents): one chunk's backward through the sink on every
    stage (stage 0's real one; the others' with dy = 0 on a stash slot of finite residuals)."""
    work, zeros_act = tick.work, tick.zeros_act
    has_b = row.bwd_mb != NONE
    grad_buf = tick.file_gradient(carry, row)
    dy = jnp.where(has_b, grad_buf[jnp.maximum(row.bwd_grad, 0)], jnp.zeros_like(zeros_act))
    stashed = tick.rings.stash.read(carry.stash, jnp.maximum(row.bwd_stash, 0))
    runs, bmb = chunk_runs(work.params, 0, work.layer_runs), jnp.maximum(row.bwd_mb, 0)
    slots = rows(sink_slots(carry.grads["layers"]), 0, work.layer_runs)
    with jax.named_scope(FINAL_SCOPE):     # every stage runs it once, outside the tick loop
        pullback = sink_pullback(work.fns, work.params, runs, zeros_act, slots,
                                 work.key(bmb, 0), stashed, work.mbs[bmb])
        druns, dx, dslots = pullback(dy)
        dembed = lax.cond(work.rank == 0, tick.embed_backward(carry.prefix, row), lambda *_: work.zeros_shared(),
                          dx.astype(work.act_dtype), bmb)
    grads = add_chunk(add_shared(carry.grads, dembed), druns, 0, work.layer_runs)
    into = jax.tree.map(lambda *r: jnp.concatenate(r, axis=0), *[d["into"] for d in dslots])
    return grads, into


def sink_pullback(fns, params, runs, x, slots, key, stashed: list, tokens=None):
    """The pullback of one chunk's layers with the data-reduction sink, on residuals the forward
    stashed without it. Tracing the sink's forward only gives the pullback's structure: its
    activations are replaced by the stashed ones (the sink adds no residual of its own, its slots
    and the weights are the pullback's inputs), so XLA drops that forward as dead code."""
    _, pullback = jax.vjp(lambda runs, x, slots: fns.layers(shared(params), runs, x, key, sinks=slots,
                                                            tokens=tokens), runs, x, slots)
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

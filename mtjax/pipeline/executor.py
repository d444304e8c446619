"""One executor for every schedule table: a `lax.scan` over ticks inside `shard_map`.

Shape legend: m micro-batches, b micro-batch, s sequence, h hidden, t tensor
size, p stages, v chunks per stage (interleaving), L = l/(p v) layers per
chunk; the activation a stage sends is [b, s, h] ([b, s/t, h] with sequence
parallelism). Stage i holds v L layers, chunk c being virtual stage
j = c p + i (the caller orders the `layers` axis so that this is a contiguous
block sharded over `pipe`); every stage holds the embedding and head, used
only by virtual stages 0 and p v - 1.

Each tick, every device reads its stage's row of the table and
  1. files what arrived from the previous tick's ppermutes into its slots;
  2. runs FORWARD (first stage: embed its micro-batch's tokens; others: the
     stashed input; then its layers), BACKWARD (`jax.vjp` of the stage,
     recomputed from the stashed input; on the last stage through the head and
     the loss; the parameter gradients are accumulated), or nothing when idle
     (`lax.switch` runs only the taken branch, so idle stages skip the compute);
  3. sends its output to stage i + 1 and its input gradient to stage i - 1
     (`ppermute` over `pipe`, every tick; cyclic when interleaving, since
     virtual stage c p + p - 1 feeds c p + p on stage 0).
The stash holds stage inputs only, `plan_buffers` slots of them (about p for
1F1B, m for GPipe). Because the backward recomputes the stage's forward, a
pipelined step costs one more forward of the layers than a step without
pipelining (like full recomputation); the last stage skips its forward tick's
compute entirely, since its backward redoes it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import numpy as np
from jax import lax

from mtjax.mesh import PIPE
from mtjax.training.loss import scaled_loss_sum
from mtjax.pipeline.buffers import plan_buffers
from mtjax.pipeline.schedules import Schedule


def _chunk(params, c, layers_per_chunk: int):
    """`params` with every `layers` leaf cut to chunk c's L layers (rows [c L, (c+1) L))."""
    cut = jax.tree.map(lambda w: lax.dynamic_slice_in_dim(w, c * layers_per_chunk, layers_per_chunk),
                       params["layers"])
    return {**params, "layers": cut}


def _stage_functions(model, layout, keys, layers_per_chunk: int, scale):
    """(chunk_out, chunk_loss): one chunk's forward, and the last chunk's loss, as functions of params."""
    def chunk_out(params, x_in, tokens, mb, c, is_first):
        rngs = {"dropout": jax.random.fold_in(keys[mb], c)}
        x = lax.cond(is_first,
                     lambda: model.apply({"params": params}, tokens[:, :-1], rngs=rngs,
                                         method="embed_tokens_to_stream"),
                     lambda: x_in)
        return model.apply({"params": _chunk(params, c, layers_per_chunk)}, x, rngs=rngs, method="run_layers")

    def chunk_loss(params, x_in, tokens, mb, c, is_first):
        y = chunk_out(params, x_in, tokens, mb, c, is_first)
        logits = model.apply({"params": params}, y, method="head")                 # [b, s, V/t]
        return scaled_loss_sum(logits, tokens[:, 1:], layout, scale)
    return chunk_out, chunk_loss


def _file(slots, arrived_mb, chunk, value):
    """Write `value` into slot (chunk, arrived_mb mod S) when something arrived (arrived_mb >= 0)."""
    c, idx = jnp.maximum(chunk, 0), jnp.maximum(arrived_mb, 0) % slots.shape[1]
    keep = slots[c, idx]
    return slots.at[c, idx].set(jnp.where(arrived_mb >= 0, value, keep))


def pipeline_grads(model, params, mbs, keys, layout, schedule: Schedule, act_shape, act_dtype, scale=1.0):
    """Run `schedule` over micro-batches mbs [m, b, s+1]; returns (local grads, local loss sum),
    both multiplied by the loss scale.

    `model` holds one chunk (L layers); `params["layers"]` holds this stage's v chunks.
    """
    p, v = layout.pipe, schedule.chunks
    plan = plan_buffers(schedule)
    rank = lax.axis_index(PIPE)
    tables = [jnp.asarray(a, jnp.int32) for a in (schedule.action, schedule.micro_batch, schedule.chunk,
                                                  plan.fwd_mb, plan.fwd_chunk, plan.bwd_mb, plan.bwd_chunk)]
    chunk_out, chunk_loss = _stage_functions(model, layout, keys, model.num_layers, scale)
    zeros_act = jnp.zeros(act_shape, act_dtype)
    up = [(i, (i + 1) % p) for i in range(p if v > 1 else p - 1)]
    down = [((i + 1) % p, i) for i in range(p if v > 1 else p - 1)]

    def tick(carry, t):
        grads, fwd_slots, bwd_slots, recv_f, recv_b, loss = carry
        action, mb, c, fmb, fc, bmb, bc = (tab[t, rank] for tab in tables)
        fwd_slots = _file(fwd_slots, fmb, fc, recv_f)
        bwd_slots = _file(bwd_slots, bmb, bc, recv_b)
        mb, c = jnp.maximum(mb, 0), jnp.maximum(c, 0)
        is_first = (rank == 0) & (c == 0)
        is_last = (rank == p - 1) & (c == v - 1)
        x_in = fwd_slots[c, mb % plan.fwd_slots]
        tokens = mbs[mb]

        def idle():
            return grads, zeros_act, zeros_act, jnp.float32(0)

        def forward():
            y = lax.cond(is_last, lambda: zeros_act,   # the last chunk's backward recomputes it all
                         lambda: chunk_out(params, x_in, tokens, mb, c, is_first).astype(act_dtype))
            return grads, y, zeros_act, jnp.float32(0)

        def backward():
            def through_loss():
                value, vjp = jax.vjp(lambda q, x: chunk_loss(q, x, tokens, mb, c, is_first), params, x_in)
                return (*vjp(jnp.ones_like(value)), value)

            def through_layers():
                dy = bwd_slots[c, mb % plan.bwd_slots]
                _, vjp = jax.vjp(lambda q, x: chunk_out(q, x, tokens, mb, c, is_first), params, x_in)
                return (*vjp(dy.astype(act_dtype)), jnp.float32(0))

            dparams, dx, value = lax.cond(is_last, through_loss, through_layers)
            return jax.tree.map(jnp.add, grads, dparams), zeros_act, dx.astype(act_dtype), value

        grads, send_f, send_b, value = lax.switch(action, [idle, forward, backward])
        recv_f = lax.ppermute(send_f, PIPE, up)      # [b, s(/t), h] to the next virtual stage
        recv_b = lax.ppermute(send_b, PIPE, down)    # [b, s(/t), h] to the previous one
        return (grads, fwd_slots, bwd_slots, recv_f, recv_b, loss + value), None

    carry = (jax.tree.map(jnp.zeros_like, params),
             jnp.zeros((v, plan.fwd_slots, *act_shape), act_dtype),
             jnp.zeros((v, plan.bwd_slots, *act_shape), act_dtype),
             zeros_act, zeros_act, jnp.float32(0))
    (grads, *_, loss), _ = lax.scan(tick, carry, jnp.arange(schedule.ticks))
    return grads, loss


def interleave_order(num_layers: int, p: int, v: int) -> np.ndarray:
    """Storage order of the layers for interleaving: position k of stage i's block holds
    chunk c = k // L, i.e. canonical layer (c p + i) L + k mod L. Identity when v = 1."""
    L = num_layers // (p * v)
    return np.array([(c * p + i) * L + r for i in range(p) for c in range(v) for r in range(L)])


def stage_activation_shape(layout, sequence_parallel: bool, hidden: int) -> tuple[int, int, int]:
    """[b, s, h], or [b, s/t, h] with sequence parallelism."""
    s = layout.seq_len // layout.tensor if sequence_parallel and layout.tensor > 1 else layout.seq_len
    return (layout.micro_batch, s, hidden)


"""One executor for every schedule table: a `lax.scan` over ticks inside `shard_map`.

Shape legend: m micro-batches, b micro-batch, s sequence, h hidden, t tensor
size, p stages; the activation a stage sends is [b, s, h] ([b, s/t, h] with
sequence parallelism). Stage i holds layers [i l/p, (i+1) l/p) (the `layers`
axis is sharded over `pipe`); every stage holds the embedding and head, used
only on the first and last stage.

Each tick, every device reads its stage's row of the table and
  1. files what arrived from the previous tick's ppermutes into its slots;
  2. runs FORWARD (first stage: embed its micro-batch's tokens; others: the
     stashed input; then its layers), BACKWARD (`jax.vjp` of the stage,
     recomputed from the stashed input; on the last stage through the head and
     the loss; the parameter gradients are accumulated), or nothing when idle
     (`lax.switch` runs only the taken branch, so idle stages skip the compute);
  3. sends its output to stage i + 1 and its input gradient to stage i - 1
     (`ppermute` over `pipe`, every tick).
The stash holds stage inputs only, `plan_buffers` slots of them (about p for
1F1B, m for GPipe). Because the backward recomputes the stage's forward, a
pipelined step costs one more forward of the layers than a step without
pipelining (like full recomputation); the last stage skips its forward tick's
compute entirely, since its backward redoes it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax import lax

from mtjax.mesh import PIPE
from mtjax.parallel.vocab import vocab_parallel_cross_entropy
from mtjax.pipeline.buffers import plan_buffers
from mtjax.pipeline.schedules import Schedule


def _stage_functions(model, layout, keys):
    """(stage_out, stage_loss): a stage's forward, and the last stage's loss, as functions of params."""
    def stage_out(params, x_in, tokens, mb, is_first):
        rngs = {"dropout": keys[mb]}
        x = lax.cond(is_first,
                     lambda: model.apply({"params": params}, tokens[:, :-1], rngs=rngs,
                                         method="embed_tokens_to_stream"),
                     lambda: x_in)
        return model.apply({"params": params}, x, rngs=rngs, method="run_layers")

    def stage_loss(params, x_in, tokens, mb, is_first):
        y = stage_out(params, x_in, tokens, mb, is_first)
        logits = model.apply({"params": params}, y, method="head")                 # [b, s, V/t]
        losses = vocab_parallel_cross_entropy(logits, tokens[:, 1:], layout.vocab, layout.tensor)
        return jnp.sum(losses) / layout.tokens_per_step
    return stage_out, stage_loss


def _file(slots, arrived_mb, value):
    """Write `value` into slot arrived_mb mod S when something arrived (arrived_mb >= 0)."""
    idx = jnp.maximum(arrived_mb, 0) % slots.shape[0]
    keep = slots[idx]
    return slots.at[idx].set(jnp.where(arrived_mb >= 0, value, keep))


def pipeline_grads(model, params, mbs, keys, layout, schedule: Schedule, act_shape, act_dtype):
    """Run `schedule` over micro-batches mbs [m, b, s+1]; returns (local grads, local loss sum)."""
    p = layout.pipe
    plan = plan_buffers(schedule)
    rank = lax.axis_index(PIPE)
    is_first, is_last = rank == 0, rank == p - 1
    tables = [jnp.asarray(a, jnp.int32) for a in
              (schedule.action, schedule.micro_batch, plan.fwd_arrival, plan.bwd_arrival)]
    stage_out, stage_loss = _stage_functions(model, layout, keys)
    zeros_act = jnp.zeros(act_shape, act_dtype)

    def tick(carry, t):
        grads, fwd_slots, bwd_slots, recv_f, recv_b, loss = carry
        action, mb, fa, ba = (tab[t, rank] for tab in tables)
        fwd_slots = _file(fwd_slots, fa, recv_f)
        bwd_slots = _file(bwd_slots, ba, recv_b)
        x_in = fwd_slots[jnp.maximum(mb, 0) % plan.fwd_slots]
        tokens = mbs[jnp.maximum(mb, 0)]

        def idle():
            return grads, zeros_act, zeros_act, jnp.float32(0)

        def forward():
            y = lax.cond(is_last, lambda: zeros_act,   # the last stage's backward recomputes it all
                         lambda: stage_out(params, x_in, tokens, mb, is_first).astype(act_dtype))
            return grads, y, zeros_act, jnp.float32(0)

        def backward():
            def through_loss():
                value, vjp = jax.vjp(lambda q, x: stage_loss(q, x, tokens, mb, is_first), params, x_in)
                return (*vjp(jnp.ones_like(value)), value)

            def through_layers():
                dy = bwd_slots[mb % plan.bwd_slots]
                _, vjp = jax.vjp(lambda q, x: stage_out(q, x, tokens, mb, is_first), params, x_in)
                return (*vjp(dy.astype(act_dtype)), jnp.float32(0))

            dparams, dx, value = lax.cond(is_last, through_loss, through_layers)
            return jax.tree.map(jnp.add, grads, dparams), zeros_act, dx.astype(act_dtype), value

        grads, send_f, send_b, value = lax.switch(action, [idle, forward, backward])
        recv_f = lax.ppermute(send_f, PIPE, [(i, i + 1) for i in range(p - 1)])    # [b, s(/t), h]
        recv_b = lax.ppermute(send_b, PIPE, [(i + 1, i) for i in range(p - 1)])    # [b, s(/t), h]
        return (grads, fwd_slots, bwd_slots, recv_f, recv_b, loss + value), None

    carry = (jax.tree.map(jnp.zeros_like, params),
             jnp.zeros((plan.fwd_slots, *act_shape), act_dtype), jnp.zeros((plan.bwd_slots, *act_shape), act_dtype),
             zeros_act, zeros_act, jnp.float32(0))
    (grads, *_, loss), _ = lax.scan(tick, carry, jnp.arange(schedule.ticks))
    return grads, loss


def stage_activation_shape(layout, sequence_parallel: bool, hidden: int) -> tuple[int, int, int]:
    """[b, s, h], or [b, s/t, h] with sequence parallelism."""
    s = layout.seq_len // layout.tensor if sequence_parallel and layout.tensor > 1 else layout.seq_len
    return (layout.micro_batch, s, hidden)


"""The train and eval steps: one `jax.jit`, inside it one `shard_map` over (data, pipe, context, tensor).

Shape legend: B global batch, m micro-batches, b micro-batch, s sequence,
d data size, c context size, t tensor size; batches hold s + 1 tokens (inputs and labels).

Inside `shard_map` each device sees its parameter shards and its data
rank's B/d sequences (with c > 1, s/c positions of each), runs m micro-batches, and accumulates
gradients locally. Then, once per global batch:
  * with pipe > 1, the sum over `pipe` of the leaves every stage holds (embedding, positions,
    final norm, head), reduce-scattered into the optimizer state's pipe split (`zero.py`), or
    all-reduced where it has none;
  * all-reduce over the replicas, `data` and `context` (the data-parallel gradient reduction; a
    reduce-scatter with the distributed optimizer). The layers' gradients may be reduced earlier:
    inside the last micro-batch's backward (`grad_reduce`: overlapped with the backward; with a
    pipeline, in the last tick's, where the table allows: `pipeline.executor.last_backward_reduces`),
    or layer by layer under FSDP; the experts held split over the replicas are not reduced;
  * all-reduce over `tensor` of the gradients that are partial sums there:
    parameters replicated over `tensor` but used on different data on each
    rank, as their declarations say (`parallel/reductions.py`: norms, biases
    and positions under sequence parallelism; kv heads replicated because k < t).
The optimizer then updates the global (sharded) arrays outside shard_map.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from mtjax.config.schema import ModelConfig
from mtjax.mesh import DATA, PIPE, TENSOR
from mtjax.model.transformer import Transformer
from mtjax.training.grad_reduce import (data_reduction_sink, fsdp_sharded, held_by_replicas, layer_dims,
                                        overlaps_data_reduction,
                                        reduce_over_data, reduce_over_pipe, sink_slots, take_sunk)
from mtjax.training.computed_weights import (accumulated, as_computed, fuses_accumulation, step_variables, unjoined,
                                             with_main_grad)
from mtjax.training.loss import scaled_loss_sum
from mtjax.training.moe_stats import carry_loss_scale
from mtjax.training.packing import local_weights, loss_denominator, row_documents, token_ids
from mtjax.training.plan import StepPlan
from mtjax.partitioning import uses_axis
from mtjax.parallel import grid_ops, taps
from mtjax.parallel.fsdp import scan_fsdp, stage_weights
from mtjax.parallel.context_ops import split_row
from mtjax.pipeline.executor import SplitFns, StageFns, pipeline_forward, pipeline_grads, stage_activation_shape
from mtjax.pipeline.schedules import forward_only



def local_model(cfg: ModelConfig, plan: StepPlan, stage: bool = True, deterministic: bool | None = None) -> Transformer:
    """The model as one device inside shard_map sees it: local shapes over `tensor`, and with
    `stage` only one model chunk's l/(p v) layers, of which block recomputation recomputes the
    first N (`plan.recompute.layers`). `deterministic` defaults to the plan's (evaluation
    passes True)."""
    layers = plan.layers_per_chunk if stage else plan.num_layers
    deterministic = plan.deterministic if deterministic is None else deterministic
    recompute = plan.recompute
    if plan.pipe > 1:   # the pipeline moves its stash to the host as a whole (`pipeline.stash.Stash`)
        recompute = replace(recompute, offload=False)
    model = plan.layout.local_model(layers, deterministic, recompute)
    if scan_fsdp(plan.fsdp) is not None:   # the layer stack as shards, gathered in the layer scan
        model = model.clone(fsdp=plan.fsdp)
    # the auxiliary losses of the MoE layers average over the global batch, as the loss does
    return model.clone(ctx=replace(model.ctx, batch_rows=plan.global_batch)) if cfg.moe else model


def stage_fns(model, plan: StepPlan, head=None, scale=1.0, sink=None, denominator=None) -> StageFns:
    """The model as the pipeline executor runs it (see `StageFns`; with the taps of
    `parallel/taps.py` for split schedules). Training batches hold s + 1 tokens; the head
    defaults to the micro-batch's loss sum times `scale` over `denominator` (`scaled_loss_sum`).
    `sink`: the layers' data-reduction sink (`grad_reduce.data_reduction_sink`), run where
    `layers` is given slots. Packed rows: every stage reads the documents off the micro-batch's
    tokens itself (`packing.row_documents`), so nothing but the activations crosses `pipe`."""
    sunk = model if sink is None else model.clone(grad_sink=sink)

    def embed(shared, tokens, key):
        rngs = {} if key is None else {"dropout": key}
        return model.apply({"params": shared}, inputs_and_labels(tokens, plan)[0], rngs=rngs,
                           docs=row_documents(tokens, plan), method="embed_and_prefix")

    def layers(shared, runs, x, key, taps=None, sinks=None, tokens=None):
        rngs = {} if key is None else {"dropout": key}
        docs = None if tokens is None else row_documents(tokens, plan)
        return (model if sinks is None else sunk).apply({"params": shared}, x, runs, sinks, taps, docs, rngs=rngs,
                                                        method="run_layers")

    def zero_taps(shared, runs, x):
        return model.apply({"params": shared}, x, runs, method="zero_taps")

    def loss(shared, y, tokens):
        logits = model.apply({"params": shared}, y, method="head")                 # [b, s/c, V/t]
        return scaled_loss_sum(logits, inputs_and_labels(tokens, plan)[1], plan, scale,
                               local_weights(tokens, plan), denominator)
    weight_gradients = taps.weight_gradients if plan.grid is None else \
        partial(taps.weight_gradients, weight_gradient=grid_ops.block_dA)
    if scan_fsdp(plan.fsdp) is not None:   # W's kernel gradients of a run, reduce-scattered onto the shards
        weight_gradients = partial(_scattered, weight_gradients, plan.fsdp)
    split = SplitFns(zero_taps, taps.split_weights, taps.join_weights, weight_gradients)
    return StageFns(embed, layers, head or loss, split, prefix=model.prefix_layers > 0)


def _scattered(weight_gradients, fsdp, cotangents):
    return fsdp.scatter_stack(weight_gradients(cotangents))


def inputs_and_labels(tokens, plan: StepPlan):
    """A micro-batch's rows [b, s + 1] -> (inputs, labels) [b, s/c]: the tokens and the next
    tokens at this context rank's positions (`context_ops.split_row`; all s at c = 1). Cut once,
    here at the data: every layer then sees only these s/c tokens. Where labels may carry no loss
    the ids are read first (`packing.token_ids`)."""
    ids = token_ids(tokens) if plan.masks_loss else tokens
    return split_row(ids[:, :-1], plan.context), split_row(ids[:, 1:], plan.context)


def _activation_shape(model, plan: StepPlan):
    if plan.grid is not None:   # the grid's residual stream block [b/(d q), s, h/q]
        g = plan.grid
        return (plan.micro_batch // g.batch_blocks, plan.seq_len, model.cfg.hidden_size // g.q)
    return stage_activation_shape(plan.micro_batch, plan.local_seq_len, model.cfg.hidden_size, plan.tensor,
                                  plan.sequence_parallel)


def _micro_batch_loss(model, variables, tokens, rng, plan: StepPlan, scale=1.0, denominator=None):
    """Sum of this micro-batch's token losses / N (B s, or the loss-carrying labels' count:
    `packing.py`), so the sums over micro-batches and data ranks give the global mean.
    tokens [b, s + 1] -> scalar. `variables`: the model's ({"params": ...}, and any joined kernels)."""
    inputs, labels = inputs_and_labels(tokens, plan)                  # [b, s/c]
    logits = model.apply(variables, inputs, row_documents(tokens, plan), rngs={"dropout": rng})
    return scaled_loss_sum(logits, labels, plan, scale, local_weights(tokens, plan), denominator)


def _accumulated_grads(model, params, mbs, keys, plan: StepPlan, scale, denominator=None):
    """No pipeline: value_and_grad per micro-batch, summed over a scan. -> (grads, loss sum, done),
    both multiplied by the loss scale; `done` (a tree of bools, or None) marks the leaves already
    reduced over `data`, in the last micro-batch's backward (`grad_reduce`).

    The matmul weights are cast to the compute dtype once per step (`computed_weights.as_computed`), as the
    pipeline does, not in every layer of every micro-batch (on an H100 the per-micro-batch casts
    and their fp32 gradient stacks were 4-5% of gpt1.3b's step: `mtjax.inspect --target h100`).
    The gradients are the same values: a weight gradient is a matmul whose output is in the
    compute dtype either way, and the sum over micro-batches stays fp32."""
    computed = as_computed(params, plan)
    grad_fn = jax.value_and_grad(lambda v, x, k: _micro_batch_loss(model, v, x, k, plan, scale, denominator))
    variables = step_variables(model, computed, plan)       # the column kernels joined once, where they can be
    fused = fuses_accumulation(model, plan)     # the layer stack's dW summed in its backward

    def accumulate(acc, xs):
        tokens, key = xs
        loss, grads = grad_fn(with_main_grad(variables, acc) if fused else variables, tokens, key)
        return accumulated(acc, grads, fused), loss

    zeros = step_variables(model, jax.tree.map(jnp.zeros_like, params), plan)
    if not overlaps_data_reduction(plan):
        grads, losses = lax.scan(accumulate, zeros, (mbs, keys))
        return unjoined(grads, params), jnp.sum(losses), None
    acc, losses = lax.scan(accumulate, zeros, (mbs[:-1], keys[:-1]))      # m - 1 micro-batches
    loss, grads, done = _last_micro_batch(model, computed, acc["params"], mbs[-1], keys[-1], plan, scale, denominator)
    return grads, jnp.sum(losses) + loss, done


def _last_micro_batch(model, computed, acc, tokens, key, plan: StepPlan, scale, denominator=None):
    """The step's last micro-batch with the layers' data reduction in its backward
    (`grad_reduce.data_reduction_sink`): -> (its loss, the step's gradients, done), `done` True on
    the layer leaves reduced there (the `into` slots' cotangents); the others are the local sums,
    to be reduced after. The same model function, dropout keys included, as `_micro_batch_loss`."""
    dims = layer_dims(plan, acc["layers"])
    sunk = model.clone(grad_sink=data_reduction_sink(dims, plan.replica_axes))
    slots = sink_slots(acc["layers"], dims, plan.replicas)

    def loss_fn(weights, layer_slots):
        inputs, labels = inputs_and_labels(tokens, plan)
        logits = sunk.apply({"params": weights, "grad_sink": {"layers": layer_slots}}, inputs,
                            row_documents(tokens, plan), rngs={"dropout": key})          # [b, s, V/t]
        return scaled_loss_sum(logits, labels, plan, scale, local_weights(tokens, plan), denominator)

    loss, (grads, d_slots) = jax.value_and_grad(loss_fn, argnums=(0, 1))(computed, slots)
    total = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)     # what the sink did not take
    return (loss, *take_sunk(total, d_slots["into"], dims))


def _pipelined_grads(model, params, mbs, keys, plan: StepPlan, scale, denominator=None):
    """The pipeline executor's (grads, loss sum, done), both multiplied by the loss scale; `done`
    as in `_accumulated_grads`, where the executor reduced the layers over `data` in the last
    tick's backward (`pipeline_grads`' sink)."""
    dims = layer_dims(plan, params["layers"]) if overlaps_data_reduction(plan) else None
    fns = stage_fns(model, plan, scale=scale, denominator=denominator,
                    sink=None if dims is None else data_reduction_sink(dims, plan.replica_axes))
    slots = None if dims is None else lambda earlier: sink_slots(earlier, dims, plan.replicas)
    act_dtype = plan.compute_dtype
    params = stage_weights(plan.fsdp, params)    # fsdp per step: the stage's layers gathered once
    grads, loss, into = pipeline_grads(fns, as_computed(params, plan), mbs, keys, plan.schedule,
                                       _activation_shape(model, plan), act_dtype, model.layer_runs,
                                       offload=plan.recompute.offload, sink_slots=slots)
    if into is None:
        return grads, loss, None
    grads, done = take_sunk(grads, into, dims)
    return grads, loss, done


def make_grad_fn(model, mesh, plan: StepPlan):
    """(params, batch [B, s+1], rng, loss scale S) -> (S x grads, mean loss), gradients reduced.

    With pipe > 1, `model` holds one chunk's layers and `plan.schedule` drives the executor. The
    gradients come out in the optimizer state's layout `plan.split` (`zero.py`): reduce-scattered
    over `pipe` where it splits a pipe-replicated leaf, and over `data` with the distributed
    optimizer. `plan.params.tensor_sums` (`parallel/reductions.py`) marks the gradients summed
    over `tensor`.
    """
    specs, reductions, split = plan.params.specs, plan.params.tensor_sums, plan.split
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    pipe_replicated = jax.tree.map(lambda s: not uses_axis(s, PIPE), specs, is_leaf=is_spec)
    held = held_by_replicas(specs, plan.replica_axes)

    def tensor_sums(grads):   # r: True (over `tensor`), the grid axes to sum over, or False
        # each leaf: partial -> summed, its shape unchanged
        return jax.tree.map(lambda g, r: lax.psum(g, TENSOR if r is True else r) if r else g, grads, reductions)

    def body(params, batch, rng_data, scale):
        # fp32 leaves to differentiate, so gradients accumulate in fp32 whatever the compute dtype
        params = jax.tree.map(lambda w: w.astype(jnp.float32), params)
        params = carry_loss_scale(params, scale, model.cfg)   # the MoE auxiliary losses' cotangent: S
        # the same key on every context rank: attention dropout draws by true position, and the
        # hidden dropout folds the context rank in itself (`model/dropout.py`)
        rng = jax.random.fold_in(jax.random.wrap_key_data(rng_data), lax.axis_index(DATA))
        mbs = batch.reshape(plan.micro_batches, plan.micro_batch, -1)     # [m, b, s+1]
        keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(plan.micro_batches))
        n = loss_denominator(batch, plan)      # the global batch's loss-carrying labels, before any work
        if plan.pipe == 1:
            grads, loss, done = _accumulated_grads(model, params, mbs, keys, plan, scale, n)
        else:
            grads, loss, done = _pipelined_grads(model, params, mbs, keys, plan, scale, n)
            grads = reduce_over_pipe(grads, pipe_replicated, split.pipe_dims)
            loss = lax.psum(loss, PIPE)                                 # scalar: the last stage's
        if scan_fsdp(plan.fsdp) is not None:   # the shards' gradients were reduce-scattered layer by layer
            done = fsdp_sharded(plan, grads)
        loss = lax.psum(loss, plan.replica_axes) / scale                  # scalar, over the replicas' rows
        done = held if done is None else jax.tree.map(lambda a, b: a or b, done, held)   # experts at e = d c: complete
        grads = reduce_over_data(grads, split.data_dims, done, plan.replica_axes)   # once per global batch
        return tensor_sums(grads), loss

    return jax.shard_map(body, mesh=mesh, in_specs=(plan.compute_specs, P(DATA, None), P(), P()),
                         out_specs=(split.specs, P()), check_vma=False)


def _eval_schedule(plan: StepPlan, micro_batches: int):
    """The forward-only schedule that evaluation runs, with the training schedule's chunking."""
    return forward_only(plan.pipe, micro_batches, plan.virtual_stages, plan.schedule.layout)


def make_loss_fn(model, mesh, plan: StepPlan):
    """(params, batch [B, s+1]) -> mean loss, no gradients (validation). With pipe > 1 the
    forward runs through the stages (`model` holds one chunk) on a forward-only schedule."""
    def body(params, batch):
        mbs = batch.reshape(plan.micro_batches, plan.micro_batch, -1)
        n = loss_denominator(batch, plan)
        if plan.pipe == 1:
            key = jax.random.key(0)   # deterministic model: dropout is off, the key is unused

            def one(total, tokens):
                return total + _micro_batch_loss(model, {"params": params}, tokens, key, plan, denominator=n), None
            total, _ = lax.scan(one, jnp.float32(0), mbs)
        else:
            weights = stage_weights(plan.fsdp, params)     # fsdp per step: the stage's layers gathered once
            losses = pipeline_forward(stage_fns(model, plan, denominator=n), weights, mbs, None,
                                      _eval_schedule(plan, plan.micro_batches),
                                      _activation_shape(model, plan), model.dtype, model.layer_runs,
                                      jax.ShapeDtypeStruct((), jnp.float32))
            total = lax.psum(jnp.sum(losses), PIPE)      # scalar: only the last stage's are non-zero
        return lax.psum(total, plan.replica_axes)       # scalar, over the replicas' rows

    return jax.shard_map(body, mesh=mesh, in_specs=(plan.compute_specs, P(DATA, None)), out_specs=P(),
                         check_vma=False)


def batch_sharding(mesh) -> NamedSharding:
    """Global batches [B, s+1] are split over `data` along B."""
    return NamedSharding(mesh, P(DATA, None))

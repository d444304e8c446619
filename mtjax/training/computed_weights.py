"""The weights a step computes with, made once per step from the fp32 parameters.

Two things happen to the parameters before the micro-batch loop, neither changing a value:

  * the matmul weights are cast to the compute dtype (`as_computed`), once per step rather than in
    every layer of every micro-batch;
  * without a pipeline, the column kernels that share an input are joined along their columns
    (`step_variables`, `model/joined_columns.py`), and the summed gradients are split back after
    the loop (`unjoined`).

And the micro-batches' weight gradients of the layer stack are summed where they are made
(Megatron's gradient accumulation fusion, `--gradient-accumulation-fusion`): the fp32 sums go
into the model as the `main_grad` variables and come back as their cotangent, each layer's
backward having added its dW into its row (`stash_scan`; `with_main_grad`, `accumulated`).
Without it a micro-batch's backward copies each dW into a fresh [l, ...] stack in the compute
dtype (2 + 2 bytes a parameter in bf16) and a second pass adds the stack into the sums (2 + 4 +
4): 14 bytes a parameter per micro-batch, against 2 + 4 + 4 in one pass (docs/design.md,
"Gradient accumulation fusion").
"""
from __future__ import annotations

import jax

from mtjax.model.joined_columns import COLLECTION, join_model, split_model
from mtjax.model.stash_scan import MAIN_GRAD
from mtjax.parallel.fsdp import is_matmul_weight
from mtjax.training.grad_reduce import fsdp_sharded, overlaps_data_reduction
from mtjax.training.plan import StepPlan


def as_computed(params, plan: StepPlan):
    """Matmul weights in the compute dtype, everything else as given. The layers cast their
    kernels and the experts' weights to the compute dtype anyway (`parallel/layers.py`,
    `model/moe.py`; `fsdp.is_matmul_weight`); casting first makes the cast weights the
    pullback's residuals *be* the parameters, which the executor then does not stash per
    micro-batch. The gradients are the same: a cast's backward casts back. FSDP's
    shards stay fp32: their gather casts them (`Fsdp.gather`), and their reduce-scattered
    gradients come back in fp32."""
    sharded = fsdp_sharded(plan, params)

    def cast(path, w, shard):
        keys = tuple(getattr(k, "key", k) for k in path)
        return w.astype(plan.compute_dtype) if is_matmul_weight(keys) and not shard else w
    return jax.tree_util.tree_map_with_path(cast, params, sharded)


def joins_columns(model, plan: StepPlan) -> bool:
    """Whether the step joins the layers' column kernels once (`model/joined_columns.py`): where
    the layers take them joined (`ParallelContext.joins_columns`), but not with FSDP's per-unit
    gathers, the last micro-batch's data-reduction sink (it works per parameter) or activation
    offload (its layer loop is a plain `lax.scan`)."""
    return (model.ctx.joins_columns and model.fsdp is None and not overlaps_data_reduction(plan)
            and not plan.recompute.offload)


def step_variables(model, params, plan: StepPlan) -> dict:
    """A tree shaped as the parameters -> the model's `apply` variables: {"params": params}, or
    with the column kernels joined (`join_model`) where `joins_columns`. Used for the computed
    weights and for the gradient accumulators alike."""
    if joins_columns(model, plan):
        return join_model(params, kv_split=model.cfg.kv_heads % plan.tensor == 0)
    return {"params": params}


def unjoined(grads, params) -> dict:
    """`step_variables`' inverse on the summed gradients: shaped as `params`."""
    return split_model(grads, params) if COLLECTION in grads else grads["params"]


def fuses_accumulation(model, plan: StepPlan) -> bool:
    """Whether the layer stack's weight gradients are summed in its backward (`stash_scan`'s
    `main_grad`): where the stack runs as one stash scan (no block recomputation's two runs, no
    tensor grid, FSDP or offload, which run other loops). With a data-reduction sink the step's
    last micro-batch is not accumulated so (`step._last_micro_batch`); the others are."""
    return (plan.grid is None and model.fsdp is None and not plan.recompute.offload
            and len(model.layer_runs) == 1)


def with_main_grad(variables: dict, sums: dict) -> dict:
    """The step's variables with the layer stack's running sums (`sums`, shaped as the
    variables, fp32) as the `main_grad` collection."""
    stack = {"params": sums["params"]["layers"]}
    if COLLECTION in sums:
        stack["joined"] = sums[COLLECTION]["layers"]
    return {**variables, MAIN_GRAD: {"layers": stack}}


def accumulated(sums: dict, grads: dict, fused: bool) -> dict:
    """The running sums after one micro-batch's `grads`: each leaf's gradient added in, or with
    `fused` the layer stack's sums as its backward returned them (`main_grad`'s cotangent)."""
    def add(a, g):
        return jax.tree.map(lambda a, g: a + g.astype(a.dtype), a, g)
    if not fused:
        return add(sums, {k: grads[k] for k in sums})
    stack = grads[MAIN_GRAD]["layers"]
    out = {}
    for collection, tree in sums.items():
        rest = {k: v for k, v in tree.items() if k != "layers"}
        out[collection] = {**add(rest, {k: grads[collection][k] for k in rest}),
                           "layers": stack["params" if collection == "params" else "joined"]}
    return out

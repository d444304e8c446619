"""The weights a step computes with, made once per step from the fp32 parameters.

Two things happen to the parameters before the micro-batch loop, neither changing a value:

  * the matmul weights are cast to the compute dtype (`as_computed`), once per step rather than in
    every layer of every micro-batch;
  * without a pipeline, the column kernels that share an input are joined along their columns
    (`step_variables`, `model/joined_columns.py`), and the summed gradients are split back after
    the loop (`unjoined`).
"""
from __future__ import annotations

import jax

from mtjax.model.joined_columns import COLLECTION, join_model, split_model
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

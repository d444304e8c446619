"""The MoE layers' routing statistics out of the step, and the aux-loss-free bias update.

Each MoE layer's zero parameter `stats` [E + 3] receives, as its gradient, the sums of its
routing statistics (`model/moe.py` `attach`): the step's gradient machinery adds them over
micro-batches, pipeline stages and the d c replicas, so the train step reads global sums per layer
[l, E + 3]:
    loads[x]   entries routed to expert x (before drops), sum over x = B s k (less padding's)
    kept       entries that found a slot (dropless: all real ones)
    balance    sum over rows of E/(k S^2) sum_x n_x P_x     (the per-row balance term)
    z          sum over rows of (1/S) sum over the row of logsumexp(router logits)^2
over the real tokens only: packed rows' padding is routed nowhere and counts in none of them, and
S is a row's real tokens (s without padding; `model/moe.py`).
The leaf's gradient is then zeroed, so the optimizer (clipping included) never sees it and the
parameter stays zero. Into the step, the leaf carries the loss scale S instead (S - 1, so that the
stored zero means S = 1: `carry_loss_scale`), for the auxiliary losses' cotangent under fp16.
Metrics: the auxiliary losses as they join the objective (coefficient times the batch mean, summed
over layers), the dropped fraction, and per MoE layer max load / mean load (named by the layer's
index in the model, `moe_layers`).

Aux-loss-free balancing (DeepSeek-V3, `model.moe_router_bias`): once per global batch, after the
optimizer, b_x += rate * sign(mean_y load_y - load_x) from the loads summed over all ranks; also
after a step skipped for its gradients (an fp16 overflow), as Megatron's, but not after a
non-finite loss.
"""
from __future__ import annotations

import jax.numpy as jnp

from mtjax.config.schema import ModelConfig


def _moe(tree):
    return tree["layers"]["moe"]


def carry_loss_scale(params, scale, cfg: ModelConfig):
    """params (the step's fp32 copies: every leaf is cast back to fp32 before this) with each MoE
    layer's `stats` (stored as zeros) filled with S - 1, S the loss scale: `model/moe.py` `attach`
    gives the auxiliary losses the cotangent 1 + stats[0] = S, as the scaled cross-entropy has.
    Only the value changes: the parameter's gradient (the routing sums) does not depend on it."""
    if not cfg.moe:
        return params
    probe = _moe(params)["stats"]
    moe = {**_moe(params), "stats": jnp.full(probe.shape, scale - 1.0, probe.dtype)}
    return {**params, "layers": {**params["layers"], "moe": moe}}


def take_stats(grads, cfg: ModelConfig):
    """(grads with the stats leaves zeroed, stats [l, E + 3]; None without experts)."""
    if not cfg.moe:
        return grads, None
    stats = _moe(grads)["stats"]
    moe = {**_moe(grads), "stats": jnp.zeros_like(stats)}
    return {**grads, "layers": {**grads["layers"], "moe": moe}}, stats


def metrics(stats, cfg: ModelConfig, global_batch: int) -> dict:
    """The step's MoE metrics from the global stats [l, E + 3]."""
    if stats is None:
        return {}
    E = cfg.num_experts
    loads, kept, balance, z = stats[:, :E], stats[:, E], stats[:, E + 1], stats[:, E + 2]
    routed = jnp.sum(loads, -1)
    ratio = jnp.max(loads, -1) / jnp.maximum(jnp.mean(loads, -1), 1.0)
    out = {"moe_aux_loss": cfg.moe_aux_loss_coeff * jnp.sum(balance) / global_batch,
           "moe_z_loss": cfg.moe_z_loss_coeff * jnp.sum(z) / global_batch,
           "moe_dropped": 1.0 - jnp.sum(kept) / jnp.maximum(jnp.sum(routed), 1.0),
           "moe_load_max_over_mean": jnp.max(ratio)}
    out.update({f"moe_load_max_over_mean/{layer}": ratio[i] for i, layer in enumerate(moe_layers(cfg))})
    return out


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The model's MoE layers (0-based, canonical), in the order of the stats' rows: the per-layer
    metrics are named by them (`moe_load_max_over_mean/3` is layer 3, past a dense prefix too)."""
    return [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]


def update_router_bias(params, stats, cfg: ModelConfig, where=True):
    """b_x += rate * sign(mean load - load_x) per MoE layer (module docstring) where `where` (a
    traced bool) holds; the rest unchanged.

    The sign is taken of E (mean - load_x) = sum_y load_y - E load_x: loads are whole counts, so
    that difference is exact (below 2**24), and an expert at the mean gets 0. The mean itself is
    not: sum / E rounds for E = 3, 6, ..., and XLA may fuse (sum * (1/E)) - load_x into one
    multiply-add, so an expert with exactly the mean load (every expert when top_k = E) moved by
    +-rate on the rounding's sign."""
    if stats is None or not cfg.moe_router_bias:
        return params
    loads = stats[:, :cfg.num_experts]                                                  # [l, E]
    step = cfg.moe_router_bias_rate * jnp.sign(jnp.sum(loads, -1, keepdims=True) - cfg.num_experts * loads)
    bias = _moe(params)["bias"]
    moe = {**_moe(params), "bias": jnp.where(where, bias + step.astype(bias.dtype), bias)}
    return {**params, "layers": {**params["layers"], "moe": moe}}

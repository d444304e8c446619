"""The column kernels that share an input, joined once for a run of layers (Megatron keeps them
joined: `linear_qkv`, and `linear_fc1` of a gated MLP).

Shape legend: n layers of the run, h hidden, a_r / k_r this rank's query / kv heads, d head dim,
f_r this rank's ffn columns.

Under sequence parallelism a block's column layers share one gathered input X_full, and the
gathered matmul (`parallel/async_linear.py`) works on their columns side by side:

    [Q K V]   = X_full [A_q A_k A_v]                  A_qkv    [h, (a_r + 2 k_r) d]
    dX_full   = [dQ dK dV] [A_q A_k A_v]^T
    dA_qkv    = X_full^T [dQ dK dV]                   (gate, up likewise: A_gu [h, 2 f_r])

Given the kernels one by one, every layer's backward joins them for the dgrad (a pass over the
kernels) and splits the joined weight gradient into the parameters' (a pass over the gradient;
with half batches one per half, `block.halved`, before the halves' sum). Joined here once, on the
run's stack [n, h, ...] before the layer loop, the layers read A_qkv's row as it lies, their
weight gradient comes back joined, and the split is the join's transpose on the stack: slices
that the gradient's next pass (the micro-batches' sum) reads in place. The values are the
same: only where the concatenation happens moves.

Joined: Q, K, V when every rank holds its own kv heads (k divisible by t; with k < t each rank
picks one head of the whole K, V kernels, `ColumnParallelLinear.pick_t`), and a gated MLP's gate
and up. The layers find the joined kernel in the `COLLECTION` variables (`joined_kernel`); their
own kernels are then left out of the parameters they are given.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from mtjax.parallel.async_linear import column_edges

COLLECTION = "joined_columns"
# (module, joined name, the column layers in the order of their columns)
GROUPS = (("attn", "qkv", ("q", "k", "v")), ("mlp", "gate_up", ("gate", "up")))


def join_columns(params, kv_split: bool) -> tuple[dict, dict]:
    """A run's stacked layer parameters (leaves [n, ...]) -> (those parameters less the joined
    kernels, the `COLLECTION` variables: {module: {name: [n, h, sum_i |out_i|]}}). `kv_split`:
    k divisible by t (Q, K, V are joined only then)."""
    rest, joined = dict(params), {}
    for module, name, names in GROUPS:
        if module == "attn" and not kv_split:
            continue
        held = rest.get(module)
        if not isinstance(held, dict) or not all(isinstance(held.get(n), dict) and "kernel" in held[n]
                                                 for n in names):
            continue
        kernels = [held[n]["kernel"] for n in names]                            # [n, h, *out_i]
        joined[module] = {name: jnp.concatenate([k.reshape(k.shape[:2] + (-1,)) for k in kernels], axis=-1)}
        rest[module] = {**held, **{n: {key: v for key, v in held[n].items() if key != "kernel"} for n in names}}
    return rest, joined


def join_model(params, kv_split: bool) -> dict:
    """A model's parameters -> its `apply` variables with the `layers` stack's column kernels
    joined: {"params": the rest, COLLECTION: {"layers": joined}} (`join_columns`)."""
    rest, joined = join_columns(params["layers"], kv_split)
    return {"params": {**params, "layers": rest}, COLLECTION: {"layers": joined}}


def split_model(variables, like) -> dict:
    """`join_model`'s inverse on gradients (any dtype): the joined kernels' columns back into
    their layers' kernels, shaped as `like`'s (the model's parameters)."""
    params, joined = dict(variables["params"]), variables[COLLECTION]["layers"]
    layers = dict(params["layers"])
    for module, name, names in GROUPS:
        if module not in joined:
            continue
        kernels = [like["layers"][module][n]["kernel"] for n in names]           # [n, h, *out_i]
        whole = joined[module][name]                                            # [n, h, sum_i |out_i|]
        cut = [whole[..., lo:hi].reshape(k.shape)
               for (lo, hi, _), k in zip(column_edges([k.shape[2:] for k in kernels]), kernels)]
        layers[module] = {**layers[module], **{n: {**layers[module][n], "kernel": c} for n, c in zip(names, cut)}}
    return {**params, "layers": layers}


def joined_kernel(module: nn.Module, name: str):
    """The joined kernel `name` [h, sum_i |out_i|] handed to `module` (a row of `join_columns`'
    stack), or None when its layers hold their own."""
    return module.get_variable(COLLECTION, name) if module.has_variable(COLLECTION, name) else None

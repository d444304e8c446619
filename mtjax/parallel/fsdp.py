"""FSDP (ZeRO-3): the layer stack's weights held as shards over the replicas, gathered a layer
at a time where the layer runs (`parallel.fsdp`).

Shape legend: n layers of a run, r = d c the replica ranks (`data`, and `context` when c > 1),
W_i one layer's weights (each leaf its tensor-parallel block), S_i = W_i / r its shard.

The distributed optimizer (`training/zero.py`) splits each master leaf [l, ...] over the
replicas along its scatter dimension k (never the layer axis while another divides). FSDP keeps
that split in the step as well: a layer leaf enters the step's `shard_map` as its shard
[n, ..., size_k / r, ...] (cast to the compute dtype where it lives), and layer i's slice is

    W_i = all_gather(S_i, replicas, along k - 1)        forward, just before layer i runs
    dS_i = psum_scatter(dW_i, replicas, along k - 1)   its transpose, in the backward

so the sum over replicas of the layer's gradient lands, reduced, on the block of the rank that
owns it: the data reduction of `grad_reduce` happens per layer and per micro-batch, inside the
backward, and the step's fp32 accumulator over micro-batches holds shards only (12/r persistent
bytes per parameter plus the r-th of an fp32 gradient sum).

What moves: every leaf in the compute dtype (w bytes an element), as the compute copy holds it
(`layout.compute_params`: the master rounded to w bytes, norms and biases included), so the
gather is exact; after it the leaves the layer reads in fp32 (norm scales, biases, the router:
all but `is_matmul_weight`) are cast back, the values and dtypes the layer saw before. Only the
leaves whose value in the step is not the compute copy's move in fp32 (`Fsdp.wide`: the MoE
router's fp32 bias, and `stats`, which the step fills with S - 1). Gradients move in fp32 (the
sum over replicas then rounds once). A
leaf with no dimension but the layer axis that r divides is held whole (`dims` None): the step
gathers it with the weights outside the stack and reduces its gradient after the backward, as
the distributed optimizer does.

The scan that runs the layers with these collectives, prefetching one layer ahead in both
directions, is `model/fsdp_scan.py`.

Under a pipeline (`parallel.fsdp_pipeline_gather`) a stage runs its layers m times a step, once
per micro-batch, so the scan's collectives run m times. With `per_step` the stage instead gathers
its v L layers once, before the schedule's loop, and the scan runs them as plain weights:

    W = all_gather(S, replicas, along k)        the stage's stacked [v L, ...] leaves, held for the step
    dS = psum_scatter(sum_mb dW, replicas, k)   once, after the micro-batches' fp32 sums

(the reduce-scatter is the distributed optimizer's data reduction, `training/grad_reduce.py`,
overlapped with the last backward where the table allows). It holds the stage's compute-dtype
weights and its fp32 gradient sums whole for the step, (w + 4) v L P_L bytes, for m times fewer
collectives: `docs/design.md` ("FSDP under a pipeline") compares the two.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict
from jax import lax

from mtjax.parallel.gloo import psum_scatter


@dataclass(frozen=True)
class Fsdp:
    """The static facts of the layer stack's sharding: the replica axes, per layer leaf the
    dimension of one layer's slice that is split over them (None: held whole), whether the
    backward keeps the forward's gathered weights, and the compute dtype the kernels move in."""

    axes: tuple[str, ...]            # the replica axes: ('data',) or ('data', 'context')
    dims: tuple                      # ((leaf path, dim of one layer's slice | None), ...)
    keep_gathered: bool = False      # backward reuses the forward's gathered W_i (ZeRO-2-like memory)
    dtype: jnp.dtype = jnp.float32   # the compute dtype: the leaves are gathered in it
    per_step: bool = False           # pipelined: a stage's layers gathered once per step, not in the scan
    wide: tuple = ()                 # leaf paths gathered in fp32: their step value is not the compute copy's

    def dim_tree(self) -> dict:
        """`dims` as a tree shaped like one layer's parameters."""
        return unflatten_dict(dict(self.dims))

    def gather(self, shard: dict) -> dict:
        """One layer's shard S_i (tree of [..., size_k / r, ...]) -> W_i, the layer's weights:
        kernels in the compute dtype, the rest in fp32, each gathered in the compute dtype but
        those in `wide`; leaves held whole are only cast."""
        return self._gathered(shard, 0)

    def gather_stack(self, shards: dict) -> dict:
        """A stage's stacked shards (leaves [n, ..., size_k / r, ...]) -> its n layers' weights
        [n, ...], as `gather` casts them: one all-gather per leaf, along the stacked leaf's k (one
        layer's k - 1, plus the layer axis). Its transpose is the data reduction's reduce-scatter
        of the step's gradient sums (`per_step`)."""
        return self._gathered(shards, 1)

    def _gathered(self, tree: dict, offset: int) -> dict:
        dims = dict(self.dims)

        def one(path, s):
            k, read = dims[path], self.dtype if is_matmul_weight(path) else jnp.float32
            if k is None:
                return s.astype(read)
            moved = s.astype(jnp.float32 if path in self.wide else self.dtype)     # exact: the compute copy's values
            return lax.all_gather(moved, self.axes, axis=k + offset, tiled=True).astype(read)  # size_k / r -> size_k
        return unflatten_dict({p: one(p, s) for p, s in flatten_dict(tree).items()})

    def scatter(self, grads: dict, like: dict) -> dict:
        """dW_i (one layer's gradient, W_i's shapes) -> dS_i in fp32, then `like`'s dtypes: the sum over
        the replicas, this rank keeping its block; a leaf held whole passes unreduced."""
        dims, dtypes = dict(self.dims), {p: s.dtype for p, s in flatten_dict(like).items()}

        def one(path, g):
            g, k = g.astype(jnp.float32), dims[path]
            if k is not None:
                g = psum_scatter(g, self.axes, k)   # size_k -> size_k / r (`gloo`: safe across processes)
            return g.astype(dtypes[path])
        return unflatten_dict({p: one(p, g) for p, g in flatten_dict(grads).items()})

    def scatter_stack(self, grads: dict) -> dict:
        """A run's flat {path: dW [n, ...]} (the split backward's W) -> {path: dS [n, ...]}: the same
        reduce-scatter, along the stacked leaf's k (one layer's k - 1, plus the layer axis)."""
        dims = dict(self.dims)

        def one(path, g):
            k = dims[path]
            g = g.astype(jnp.float32)
            # [n, ..., size_k, ...] -> [n, ..., size_k / r, ...]
            return g if k is None else psum_scatter(g, self.axes, k + 1)
        return {p: one(p, g) for p, g in grads.items()}


def is_matmul_weight(path: tuple) -> bool:
    """A leaf the layer casts to the compute dtype before its matmul: a `kernel`, or an expert's
    weight (`model/moe.py` `Experts`: fc1 or gate/up, fc2); the rest (norms, biases, the fp32
    router) the layer reads in fp32. The step casts these leaves once before its micro-batches
    (`training/step.py`)."""
    return path[-1] == "kernel" or (len(path) > 1 and path[-2] == "experts")


def scan_fsdp(fsdp: Fsdp | None) -> Fsdp | None:
    """The FSDP the layer scan runs (gather and reduce-scatter per layer and micro-batch): None
    without FSDP, or where a pipelined step gathers each stage's layers once (`per_step`)."""
    return None if fsdp is None or fsdp.per_step else fsdp


def stage_weights(fsdp: Fsdp | None, params: dict) -> dict:
    """The parameters a pipelined step's stages compute with: under `per_step` the `layers`
    shards gathered once (`Fsdp.gather_stack`), the rest as given; otherwise `params`."""
    if fsdp is None or not fsdp.per_step:
        return params
    return {**params, "layers": fsdp.gather_stack(params["layers"])}


def fsdp_dims(layer_data_dims) -> tuple:
    """From the distributed optimizer's split of the `layers` subtree (dimension of each stacked
    leaf [l, ...] split over the replicas, None if none divides) -> `Fsdp.dims`: one layer's dim
    k - 1, or None where the split is on the layer axis or absent (that leaf is held whole)."""
    leaves = jax.tree_util.tree_leaves_with_path(layer_data_dims, is_leaf=lambda x: x is None)
    out = []
    for path, k in leaves:
        key = tuple(getattr(p, "key", p) for p in path)
        out.append((key, None if k is None or k == 0 else k - 1))
    return tuple(sorted(out))


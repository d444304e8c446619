"""Where the optimizer state lives: Megatron's distributed optimizer (ZeRO-1) as a split over
`data`, and the pipe-replicated parameters' state as a split over `pipe`.

The step computes with the parameters laid out by `param_specs`. The fp32 master weights and both
AdamW moments are split further, along one dimension each:
  * over `pipe` whenever p > 1, the leaves `param_specs` replicates over `pipe` (those without a
    `layers` axis: the embedding, GPT's position embedding, a mixture of experts' dense prefix
    (`dense_layers`, run by the first stage), the final norm, the untied output
    layer). Only the first and last stages compute with them; without the split every stage
    would hold their 12 bytes per parameter (1B parameters for V = 128k at h = 4096);
  * over `data`, every leaf, with `parallel.distributed_optimizer` (and `parallel.fsdp`, which also
    keeps the layer leaves split inside the step: `parallel/fsdp.py`). Here and below `data` and d
    stand for the replicas, (`data`, `context`) and d c when c > 1 (`replica_group`); a leaf
    already split over them (experts at e = d c) is not split again.
A leaf split over both takes them on one dimension when one divides: the first unsharded
dimension whose size p·d divides, else the first sharded one whose per-device size p·d divides
(one sharded over `pipe`, a layer axis, last: `scatter_dim`), named (..., 'pipe', 'data') there (pipe major, so that a reduce-scatter over `pipe` and then one
over `data` leave each device its own block). Otherwise each axis goes on its own dimension by the
same rule, `pipe` first; an axis that divides no dimension leaves the leaf whole over it (with
p, d dividing h and s: none in practice; a norm scale of h with p·d not dividing h but p and d
each dividing it keeps only `pipe`).

In the step (`make_grad_fn`):
  * the gradients of pipe-split leaves are reduce-scattered over `pipe` (`psum_scatter` along
    the split dimension; on CPU with several processes an all-to-all and a sum, see
    `grad_reduce.psum_scatter`) instead of all-reduced, then over `data` the same way with the
    distributed optimizer: each device keeps the block it updates;
  * optax updates only the owned blocks (the arrays are split, so the elementwise update runs
    on them alone);
  * the updated master weights are cast to the compute dtype and then gathered over `pipe` and
    `data` (`Trainer.compute_params`; XLA inserts the all-gathers).
Persistent bytes per parameter and device: 12/d (master + 2 moments; d = 1 without the
distributed optimizer) for the layers' parameters, 12/(p·d) for the pipe-split ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from mtjax.mesh import CONTEXT, DATA, PIPE
from mtjax.partitioning import uses_axis


def _axes(name) -> tuple:
    return () if name is None else (name if isinstance(name, tuple) else (name,))


def scatter_dim(spec: P, shape: tuple[int, ...], n: int, sizes: dict) -> int | None:
    """The dimension to split n ways: the first unsharded one whose size n divides, else the
    first sharded one whose per-device size n divides, one sharded over `pipe` (a stack's layer
    axis) last (None if there is none).

    The layer axis goes last because a leaf split along it cannot be reduced a layer at a time:
    the data reduction would leave it until after the backward (`grad_reduce.AFTER`) and FSDP
    would hold it whole. It is named `pipe` at p = 1 too, so it is never free: a GPT fc1 bias
    [l, f] (`pipe`, `tensor`) at l = d = 4 took it before f."""
    names = tuple(spec) + (None,) * (len(shape) - len(spec))
    local = [size // int(np.prod([sizes[a] for a in _axes(name)] or [1])) for name, size in zip(names, shape)]
    rank = lambda name: 0 if name is None else 2 if PIPE in _axes(name) else 1    # noqa: E731
    for want in (0, 1, 2):
        for dim, (name, size) in enumerate(zip(names, local)):
            if rank(name) == want and size % n == 0:
                return dim
    return None


def with_axis(spec: P, dim: int | None, ndim: int, axis: str) -> P:
    """`spec` with mesh axis `axis` added, minor-most, on `dim`: ('tensor', 'data') splits each
    tensor shard further over data, which is what a reduce-scatter of the local shard produces."""
    if dim is None:
        return spec
    names = list(tuple(spec) + (None,) * (ndim - len(spec)))
    names[dim] = _axes(names[dim]) + _axes(axis) if names[dim] is not None else axis
    return P(*names)


def _split_leaf(spec: P, shape: tuple[int, ...], axes: tuple[str, ...], sizes: dict):
    """(spec with `axes` added, {axis: its dimension or None}): all on one dimension if one divides
    their product, else each on its own, in the order given (the order of the reductions)."""
    if len(axes) > 1 and (dim := scatter_dim(spec, shape, int(np.prod([sizes[a] for a in axes])), sizes)) is not None:
        for axis in axes:
            spec = with_axis(spec, dim, len(shape), axis)
        return spec, dict.fromkeys(axes, dim)
    dims = {}
    for axis in axes:
        dims[axis] = scatter_dim(spec, shape, sizes[axis], sizes)
        spec = with_axis(spec, dims[axis], len(shape), axis)
    return spec, dims


@dataclass(frozen=True)
class StateSplit:
    """The optimizer state's layout; each tree is shaped like the parameters."""

    specs: Any          # PartitionSpecs of the master weights (the moments follow them)
    pipe_dims: Any      # dimension split over `pipe`, None where not (pipe-sharded leaves, p = 1)
    data_dims: Any      # dimension split over `data`; the whole tree is None without the distributed optimizer


def replica_group(mesh):
    """The axes the distributed optimizer splits over, as one name or a tuple: `data`, or
    (`data`, `context`) with context parallelism (context ranks hold the same parameters)."""
    return (DATA, CONTEXT) if int(dict(mesh.shape).get(CONTEXT, 1)) > 1 else DATA


def state_split(param_specs, param_shapes, mesh, distributed: bool) -> StateSplit:
    """Split the optimizer state of pipe-replicated leaves over `pipe` (p > 1) and, when
    `distributed`, of every leaf over the replicas (`replica_group`: d, or d c > 1 ranks)."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    sizes = {name: int(mesh.shape[name]) for name in mesh.axis_names}
    group = replica_group(mesh)
    sizes[group] = int(np.prod([sizes[a] for a in _axes(group)]))

    def axes(spec):
        pipe = (PIPE,) if sizes[PIPE] > 1 and not uses_axis(spec, PIPE) else ()
        # split over them already: experts at e = d c
        held = any(a in _axes(name) for a in _axes(group) for name in spec)
        return pipe + ((group,) if distributed and sizes[group] > 1 and not held else ())

    split = jax.tree.map(lambda s, a: _split_leaf(s, a.shape, axes(s), sizes), param_specs, param_shapes,
                         is_leaf=is_spec)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and is_spec(x[0])  # noqa: E731
    dims = lambda axis: jax.tree.map(lambda x: x[1].get(axis), split, is_leaf=is_pair)  # noqa: E731
    return StateSplit(specs=jax.tree.map(lambda x: x[0], split, is_leaf=is_pair), pipe_dims=dims(PIPE),
                      data_dims=dims(group) if distributed else None)

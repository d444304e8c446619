"""Megatron's distributed optimizer (ZeRO-1), written as a sharding over `data`.

Each fp32 master weight and both AdamW moments gain a `data` split along one
dimension whose per-device size d divides (an unsharded one if possible). In the step:
  * gradients are reduce-scattered over `data` (`psum_scatter` along that
    dimension) instead of all-reduced: each rank keeps the 1/d it owns;
  * optax updates only the owned shards (the arrays are sharded, so the
    elementwise update runs on 1/d of each);
  * the updated master weights are cast to the compute dtype and then
    gathered (XLA inserts the all-gather when they enter the step's
    `shard_map`, whose parameter specs have no `data`).
Leaves with no suitable dimension (none in practice for d dividing h) stay
replicated over `data` and are all-reduced as without the optimizer.
Persistent bytes per parameter and device: 12/d (master + 2 moments) plus
what the compute copy costs transiently.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from mtjax.mesh import DATA


def _axes(name) -> tuple:
    return () if name is None else (name if isinstance(name, tuple) else (name,))


def scatter_dim(spec: P, shape: tuple[int, ...], d: int, sizes: dict) -> int | None:
    """The dimension to split over `data`: the first unsharded one whose size d divides, else the
    first sharded one whose per-device size d divides (None if there is none)."""
    names = tuple(spec) + (None,) * (len(shape) - len(spec))
    local = [size // int(np.prod([sizes[a] for a in _axes(n)] or [1])) for n, size in zip(names, shape)]
    for want_free in (True, False):
        for dim, (name, n) in enumerate(zip(names, local)):
            if (name is None) == want_free and n % d == 0:
                return dim
    return None


def with_data_axis(spec: P, dim: int | None, ndim: int) -> P:
    """`spec` with `data` added, minor-most, on `dim`: ('tensor', 'data') splits each tensor
    shard further over data, which is what a reduce-scatter of the local shard produces."""
    if dim is None:
        return spec
    names = list(tuple(spec) + (None,) * (ndim - len(spec)))
    names[dim] = _axes(names[dim]) + (DATA,) if names[dim] is not None else DATA
    return P(*names)


def distributed_specs(param_specs, param_shapes, mesh):
    """(master specs with a `data` split, the split dimension of every leaf)."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    sizes = {name: int(mesh.shape[name]) for name in mesh.axis_names}
    d = sizes[DATA]
    dims = jax.tree.map(lambda s, a: scatter_dim(s, a.shape, d, sizes) if d > 1 else None,
                        param_specs, param_shapes, is_leaf=is_spec)
    specs = jax.tree.map(lambda s, a, k: with_data_axis(s, k, len(a.shape)),
                         param_specs, param_shapes, dims, is_leaf=is_spec)
    return specs, dims

"""The tensor axis laid out as a q x q grid (2D, t = q^2) or q x q x d (2.5D, t = q^2 d).

Shape legend: t tensor size, q grid side, d depth (1 for 2D), b micro-batch, s sequence,
h hidden, V padded vocabulary.

The user's mesh stays (data, pipe, tensor). With `parallel.tensor_grid` 2d or 2.5d the step
runs on a mesh of the same devices in the same order whose `tensor` axis is cut into three
named sub-axes, depth slowest:

    tensor rank r = (k q + i) q + j     k on DEPTH, i on ROW, j on COL

so the collectives of `grid_ops.py` address one sub-axis at a time and no model code does rank
arithmetic. Device (k, i, j) holds the activation block [b/(d q) rows of depth k, block i ..., h/q
columns j] and the weight block A_ij; the weights are replicated along DEPTH.

Parameter layout (`grid_spec`): a matmul kernel [in, ..., out, ...] is split by its first input
dimension over ROW and its first output dimension over COL; every vector that multiplies or is
added to the residual stream or a layer's output (biases, norm scales, position table) is split
over COL with the columns it meets; the embedding table [V, h] is split (ROW, COL).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtjax.mesh import DATA, PIPE, TENSOR
from mtjax.parallel.grid_shape import grid_side

ROW, COL, DEPTH = "tensor_row", "tensor_col", "tensor_depth"
GRID_AXES = (DEPTH, ROW, COL)


@dataclass(frozen=True)
class Grid:
    """The static shape of the grid: side q and depth d (t = q^2 d)."""

    q: int
    depth: int = 1

    @property
    def size(self) -> int:
        return self.q * self.q * self.depth

    @property
    def batch_blocks(self) -> int:
        """How many blocks the micro-batch is cut into: d q (depth, then the batch grid axis)."""
        return self.depth * self.q


def make_grid(kind: str, tensor: int, depth: int = 1) -> Grid | None:
    """The Grid of `parallel.tensor_grid` (None for 1d); the config is validated first."""
    if kind == "1d":
        return None
    d = depth if kind == "2.5d" else 1
    q = grid_side(tensor, d)
    assert q is not None, (kind, tensor, depth)
    return Grid(q, d)


def grid_mesh(mesh, grid: Grid | None):
    """`mesh` (data, pipe, tensor) with `tensor` cut into (DEPTH, ROW, COL); itself for 1d."""
    if grid is None:
        return mesh
    from jax.sharding import AxisType, Mesh

    d, p, t = (int(mesh.shape[a]) for a in (DATA, PIPE, TENSOR))
    assert t == grid.size, (t, grid)
    devices = np.asarray(mesh.devices).reshape(d, p, grid.depth, grid.q, grid.q)
    return Mesh(devices, (DATA, PIPE) + GRID_AXES, axis_types=(AxisType.Auto,) * 5)


# ---- parameter layout -------------------------------------------------------------------
INPUT_DIMS = {"o": 2}     # kernels whose input is more than one dimension ([a, d] of attention's output)


def grid_spec(path: tuple[str, ...], ndim: int, stacked: bool):
    """The PartitionSpec of the parameter at `path` (module names then the leaf's), `ndim` dims;
    `stacked`: a leading `layers` axis over PIPE."""
    from jax.sharding import PartitionSpec as P

    lead = (PIPE,) if stacked else ()
    n = ndim - len(lead)
    leaf, owner = path[-1], path[-2] if len(path) > 1 else ""
    if leaf == "embedding":
        dims = (ROW, COL)                                      # [V/q, h/q]
    elif leaf == "pos_embedding":
        dims = (None, COL)                                     # [S, h/q]
    elif leaf == "kernel":
        k = INPUT_DIMS.get(owner, 1)
        dims = (ROW,) + (None,) * (k - 1) + (COL,) + (None,) * (n - k - 1)
    else:                                                      # bias, scale: [n/q, ...]
        dims = (COL,) + (None,) * (n - 1)
    assert len(dims) == n, (path, ndim)
    return P(*(lead + dims))


def grid_specs(shapes):
    """Specs for a parameter tree (global shapes) by `grid_spec`."""
    import jax

    def one(path, x):
        names = tuple(getattr(k, "key", str(k)) for k in path)
        return grid_spec(names, x.ndim, names[0] == "layers")
    return jax.tree_util.tree_map_with_path(one, shapes)


def grid_sums(shapes, grid: Grid):
    """Per parameter, the grid axes its local gradient is a partial sum over, summed once per
    step (`step.make_grad_fn`): DEPTH for every weight (each depth layer saw its own rows), and
    ROW for the vectors split over COL only (each row of the grid saw its own batch rows).
    Kernels and the embedding come out of their backward already summed over the grid
    (`grid_ops.linear_dA`, the head's all-gather), so only DEPTH is left for them."""
    import jax

    def one(path, x):
        leaf = getattr(path[-1], "key", "")
        axes = () if leaf in ("kernel", "embedding") else (ROW,)
        axes += (DEPTH,) if grid.depth > 1 else ()
        return axes or False
    return jax.tree_util.tree_map_with_path(one, shapes)

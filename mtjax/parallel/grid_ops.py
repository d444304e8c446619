"""Named operators on the 2D / 2.5D tensor grid (`grid.py`), as `tensor_ops.py` is for 1D.

Shape legend: q grid side, d depth, b micro-batch, s sequence, h hidden; a block's rows are
r = b/(d q) micro-batch rows, `k` a contracted dimension, `n` an output dimension. Device
(z, i, j) sits at DEPTH z, ROW i, COL j. Every collective runs along ONE grid axis, and every
operator is a `jax.custom_vjp`, so the backward communicates exactly what is written here.
They run inside `shard_map` over the grid mesh (`check_vma=False`).

The linear layer Y = X A on the q x q grid (one depth layer; DEPTH only repeats it on other rows):

    X_ij [r, k/q]  rows of batch block i, columns j of k      A_ij [k/q, n/q]      Y_ij [r, n/q]
    forward    X_i: = all_gather_COL(X_ij) [r, k]   A_:j = all_gather_ROW(A_ij) [k, n/q]
               Y_ij = X_i: A_:j                                              (`linear_forward`)
    backward   dX_ij = psum_scatter_COL(dY_ij A_:j^T) [r, k] -> [r, k/q]      (`linear_dX`)
               dA_ij = psum_scatter_ROW(X_i:^T dY_ij) [k, n/q] -> [k/q, n/q]  (`linear_dA`)

The residuals are the blocks X_ij and A_ij, not the gathered X_i: and A_:j (q times smaller); the
backward gathers them again (one all-gather each, as Megatron's sequence parallelism re-gathers).

Why gather once rather than SUMMA's q broadcast steps: both move the same bytes per device
((q-1)/q of X_i: and of A_:j), but the q-step form issues q collectives of 1/q the size, each
followed by a small matmul, and XLA keeps one step's buffers live at a time. The gather form is
one collective and one large matmul per operand (better for a GPU's matmul units and the
collective's latency) at the cost of holding X_i: and A_:j ([r, k] + [k, n/q]) while it runs.
`summa_forward` is SUMMA's form, written with ppermute broadcasts for the comparison:
`scripts/bench_tensor_grid.py` measures both forward products from the compiled HLO (collective
bytes and count, XLA's temp bytes), see docs/benchmarks.md.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.parallel.grid import COL, ROW


def _gather(x, axis: str, dim: int):
    return lax.all_gather(x, axis, axis=dim, tiled=True)                    # [.., D/q, ..] -> [.., D, ..] at dim


def _scatter(x, axis: str, dim: int):
    return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)     # partial [.., D, ..] -> [.., D/q, ..]


# ---- the linear layer --------------------------------------------------------------------
def linear_forward(x, a):
    """Y_ij = X_i: A_:j. x [..., k/q], a [k/q, n/q] -> [..., n/q]."""
    xg = _gather(x, COL, x.ndim - 1)                 # [..., k]      along COL
    ag = _gather(a, ROW, 0)                          # [k, n/q]      along ROW
    return jnp.einsum("...k,kn->...n", xg, ag)


def linear_dX(dy, a):
    """dX_ij = sum over COL of dY_ij A_:j^T. dy [..., n/q], a [k/q, n/q] -> [..., k/q]."""
    ag = _gather(a, ROW, 0)                          # [k, n/q]      along ROW
    partial_dx = jnp.einsum("...n,kn->...k", dy, ag)  # [..., k]     partial over COL
    return _scatter(partial_dx, COL, dy.ndim - 1)    # [..., k/q]    along COL


def linear_dA(x, dy):
    """dA_ij = sum over ROW of X_i:^T dY_ij. x [..., k/q], dy [..., n/q] -> [k/q, n/q]."""
    xg = _gather(x, COL, x.ndim - 1)                 # [..., k]      along COL
    rows = "".join("abcdefg"[: x.ndim - 1])
    partial_da = jnp.einsum(f"{rows}k,{rows}n->kn", xg, dy)   # [k, n/q] partial over ROW
    return _scatter(partial_da, ROW, 0)              # [k/q, n/q]    along ROW


@jax.custom_vjp
def grid_linear(x, a):
    """Y = X A on the grid: x [..., k/q], a [k/q, n/q] -> [..., n/q] (module docstring)."""
    return linear_forward(x, a)


def _linear_fwd(x, a):
    return linear_forward(x, a), (x, a)              # the blocks, not the gathered operands


def _linear_bwd(res, dy):
    x, a = res
    return linear_dX(dy, a).astype(x.dtype), linear_dA(x, dy).astype(a.dtype)


grid_linear.defvjp(_linear_fwd, _linear_bwd)


# ---- a layer's blocks as matrices (`GridLinear`: kernels [*in/q.., *out/q..]) -------------------
def _as_matrices(x, a, n_out: int):
    """x [..., *in], a [*in, *out] (n_out trailing dims of a are out) -> (x [..., k/q], a [k/q, n/q],
    the lead dims, out)."""
    n_in = a.ndim - n_out
    lead, out = x.shape[: x.ndim - n_in], a.shape[n_in:]
    k = math.prod(a.shape[:n_in])
    return x.reshape(lead + (k,)), a.reshape(k, math.prod(out)), lead, out


def block_linear(n_out: int, x, a):
    """Y = X A of a layer's blocks, through `grid_linear` (its whole backward): [..., *in] -> [..., *out]."""
    xm, am, lead, out = _as_matrices(x, a, n_out)
    return grid_linear(xm, am).reshape(lead + out)


def block_forward(n_out: int, x, a):
    """`block_linear`'s forward alone (`linear_forward`), for the split backward's tap."""
    xm, am, lead, out = _as_matrices(x, a, n_out)
    return linear_forward(xm, am).reshape(lead + out)


def block_dX(n_out: int, dy, x, a):
    """`linear_dX` of a layer's blocks: dy [..., *out] -> dX [..., *in] (the split backward's B)."""
    xm, am, lead, _ = _as_matrices(x, a, n_out)
    return linear_dX(dy.reshape(lead + (am.shape[1],)), am).reshape(x.shape)


def block_dA(x, dy):
    """`linear_dA` of a layer's blocks (the split backward's W): x [r, s, *in], dy [r, s, *out]
    -> dA [*in, *out], gathered along COL and reduce-scattered along ROW inside."""
    r, s = x.shape[:2]
    return linear_dA(x.reshape(r, s, -1), dy.reshape(r, s, -1)).reshape(x.shape[2:] + dy.shape[2:])


def _broadcast(x, axis: str, root: int, q: int):
    """The block of the device at `root` along `axis`, on every device of that axis: q - 1
    ppermutes from the root (a device that is no destination receives zeros)."""
    out = jnp.where(rank(axis) == root, x, jnp.zeros_like(x))
    for k in range(1, q):
        out = out + lax.ppermute(x, axis, [(root, (root + k) % q)])   # x's block shape, root's to root + k
    return out


def summa_forward(x, a, q: int):
    """Y_ij = sum_l X_il A_lj by SUMMA's q steps: at step l, X_il is broadcast along COL from
    column l and A_lj along ROW from row l. x [..., k/q], a [k/q, n/q] -> [..., n/q]. The same
    bytes as `linear_forward`'s gathers, in q steps holding one block each; kept for the
    measurement (`scripts/bench_tensor_grid.py`), not run by the model."""
    y = None
    for step in range(q):
        xl = _broadcast(x, COL, step, q)                      # X_il [..., k/q]
        al = _broadcast(a, ROW, step, q)                      # A_lj [k/q, n/q]
        part = jnp.einsum("...k,kn->...n", xl, al)
        y = part if y is None else y + part
    return y


# ---- reductions and redistributions along one axis -----------------------------------------
@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather(x, axis: str, dim: int):
    """Forward all-gather along `axis` on `dim`; backward reduce-scatter (the partial cotangents)."""
    return _gather(x, axis, dim)


gather.defvjp(lambda x, axis, dim: (_gather(x, axis, dim), None),
              lambda axis, dim, _, g: (_scatter(g, axis, dim),))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def reduce_scatter(x, axis: str, dim: int):
    """Forward reduce-scatter of partial sums along `axis` on `dim`; backward all-gather."""
    return _scatter(x, axis, dim)


reduce_scatter.defvjp(lambda x, axis, dim: (_scatter(x, axis, dim), None),
                      lambda axis, dim, _, g: (_gather(g, axis, dim),))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce(x, axes):
    """Forward all-reduce over `axes` (partial -> whole, replicated); backward identity (Megatron's g)."""
    return lax.psum(x, axes)                         # partial -> summed, x's shape


reduce.defvjp(lambda x, axes: (lax.psum(x, axes), None), lambda axes, _, g: (g,))   # as `reduce`


def rank(axis: str):
    """This device's index along grid axis `axis`."""
    return lax.axis_index(axis)


def block(x, axis: str, dim: int, blocks: int):
    """This device's contiguous 1/blocks slice of `x` along `dim`, indexed by its rank on `axis`
    (no communication; the caller takes care of the cotangent)."""
    size = x.shape[dim] // blocks
    return lax.dynamic_slice_in_dim(x, rank(axis) * size, size, axis=dim)

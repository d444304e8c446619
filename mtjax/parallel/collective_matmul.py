"""Collective matmuls: sequence parallelism's all-gather and reduce-scatter hidden behind the matmuls.

Shape legend: b micro-batch, s sequence, h hidden, t tensor size, n = s/t (one chunk), r this rank;
a kernel is [*in, *out] (a column layer's [h, *out_r], a row layer's [*in_r, h]).

With sequence parallelism a column-parallel layer computes Y_r = AllGather_s(X) A_r and a
row-parallel one Y = ReduceScatter_s(sum_r X_r A_r) (`tensor_ops.enter_tensor_region`,
`exit_tensor_region`): the collective sits on the critical path before or after its matmul. Here
both are split along s into t chunks, X = [X_0; ...; X_{t-1}], and computed chunk by chunk on a
ring (rank r sends to r + 1), so that each step's matmul runs while `ppermute` moves the next
chunk (Wang et al., ASPLOS 2023; Megatron's --tp-comm-overlap):

    all_gather_matmul      Y_r = [X_0; ...; X_{t-1}] A_r = [X_0 A_r; ...; X_{t-1} A_r]:
                           step j multiplies the chunk X_{(r-j) mod t} it holds while the ring
                           brings X_{(r-j-1) mod t}; the rows land at their own offsets.
    matmul_reduce_scatter  Y_c = sum_r X_r[c] A_r for chunk c: step j adds this rank's partial
                           X_r[(r-j-1) mod t] A_r to the partial sum received, and passes it on;
                           after t steps rank r holds its own chunk Y_r, complete.

The backward of each is the other's pattern: the column layer's dX = ReduceScatter_s(dY A_r^T) is
a ring of partial sums, and its dA_r = AllGather_s(X)^T dY = sum_c X_c^T dY[c] gathers X again
chunk by chunk (the forward keeps only the shard, as `_all_but_gathers` does), each chunk's
product overlapping the next chunk's permute; the row layer's dX_r = AllGather_s(dY) A_r^T and
dA_r = X_r^T AllGather_s(dY) share one ring of dY chunks. Each ring moves t - 1 chunks, as the
all-gather or reduce-scatter it replaces does: the bytes are the same, only their form changes.

Every operator is a `jax.custom_vjp` (the backward communicates exactly this, nothing left to
autodiff), runs inside `shard_map` with `tensor` manual, and needs t > 1. The `_tapped` forms
are for the split backward (`parallel/taps.py`): their backward computes dX only and hands the
tap (X, dY) with X and dY over the whole sequence, what W's plain X^T dY needs.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.mesh import TENSOR
from mtjax.parallel.ring import pass_along

SEQ = 1   # activations are [b, s, ...]


class SequenceShard(NamedTuple):
    """A column layer's input left as this rank's sequence chunk [b, s/t, h] (`tensor_overlap`):
    the layers that share it gather it inside their matmuls (`all_gather_matmul`) over t ranks."""
    x: jax.Array
    t: int
    by_all_to_all: bool = False     # the ring's steps as all-to-alls (`ring.pass_along`)


def _next(x, t: int, a2a: bool):
    """x sent one step along the ring: rank r receives rank r - 1's value (`ring.pass_along`; as an
    all-to-all with `a2a`: XLA:CPU inside a pipeline stage)."""
    return pass_along(x, TENSOR, t, 1, a2a)


def _chunk(x, c, n: int):
    """Rows [c n, (c + 1) n) of x [b, s, ...] (c traced)."""
    return lax.dynamic_slice_in_dim(x, c * n, n, axis=SEQ)


def _place(y, part, c, n: int):
    """y [b, s, ...] with rows [c n, (c + 1) n) replaced by part [b, n, ...]."""
    return lax.dynamic_update_slice_in_dim(y, part, c * n, axis=SEQ)


def _x_times(x, w):
    """X [b, n, *in] A [*in, *out] -> [b, n, *out]."""
    k = x.ndim - 2
    return jnp.tensordot(x, w, axes=(tuple(range(2, 2 + k)), tuple(range(k))))


def _times_wT(dy, w, k_out: int):
    """dY [b, n, *out] A^T -> [b, n, *in], `k_out` the number of out dims."""
    return jnp.tensordot(dy, w, axes=(tuple(range(dy.ndim - k_out, dy.ndim)), tuple(range(w.ndim - k_out, w.ndim))))


def _xT_times(x, dy):
    """sum over (b, n) of X^T dY, accumulated in fp32: X [b, n, *in], dY [b, n, *out] -> [*in, *out]."""
    return jnp.tensordot(x, dy, axes=([0, 1], [0, 1]), preferred_element_type=jnp.float32)


# all_gather_matmul -----------------------------------------------------------------------------
def _gather_forward(x, ws, t: int, a2a: bool):
    """x [b, n, h] (this rank's chunk), ws ([h, *out_i]) -> ([b, s, *out_i]), by t ring steps."""
    r, (b, n, _) = lax.axis_index(TENSOR), x.shape
    ys = [jnp.zeros((b, n * t) + w.shape[1:], x.dtype) for w in ws]     # [b, s, *out_i]
    for j in range(t):
        held = x                                                            # X_c, c = (r - j) mod t: [b, n, h]
        if j < t - 1:
            x = _next(x, t, a2a)                                            # in flight: X_{c-1}
        c = (r - j) % t
        ys = [_place(y, _x_times(held, w).astype(x.dtype), c, n) for y, w in zip(ys, ws)]   # [b, n, *out_i] at c
    return tuple(ys)


def _gather_backward(x, ws, dys, t: int, a2a: bool, gather_x: bool):
    """The column layer's backward on the ring: (dX [b, n, h], dA_i [h, *out_i] fp32 (None with
    `gather_x`), the gathered X [b, s, h] (with `gather_x`, else None))."""
    r, (b, n, h) = lax.axis_index(TENSOR), x.shape
    das = None if gather_x else [jnp.zeros(w.shape, jnp.float32) for w in ws]
    full = jnp.zeros((b, n * t, h), x.dtype) if gather_x else None
    acc = None
    for j in range(t):
        held = x                                                            # X_c, c = (r - j) mod t
        if j < t - 1:
            x = _next(x, t, a2a)
        c, d = (r - j) % t, (r - j - 1) % t                                 # X's chunk; dX's destination
        if gather_x:
            full = _place(full, held, c, n)                                 # [b, s, h]
        else:
            das = [da + _xT_times(held, _chunk(dy, c, n)) for da, dy in zip(das, dys)]   # [h, *out_i]
        part = sum(_times_wT(_chunk(dy, d, n), w, w.ndim - 1) for dy, w in zip(dys, ws))  # [b, n, h]: chunk d
        acc = part if acc is None else _next(acc, t, a2a) + part            # partial sums of chunk d
    return acc.astype(x.dtype), das, full                                  # acc: chunk r, summed over ranks


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _all_gather_matmul(x, ws, t, a2a):
    return _gather_forward(x, ws, t, a2a)


def _agm_fwd(x, ws, t, a2a):
    return _gather_forward(x, ws, t, a2a), (x, ws)       # keeps the shard, not the gathered X


def _agm_bwd(t, a2a, res, dys):
    x, ws = res
    dx, das, _ = _gather_backward(x, ws, dys, t, a2a, gather_x=False)
    return dx, tuple(da.astype(w.dtype) for da, w in zip(das, ws))


_all_gather_matmul.defvjp(_agm_fwd, _agm_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _all_gather_matmul_tapped(x, ws, taps, t, a2a):
    del taps
    return _gather_forward(x, ws, t, a2a)


def _agmt_fwd(x, ws, taps, t, a2a):
    del taps
    return _gather_forward(x, ws, t, a2a), (x, ws)


def _agmt_bwd(t, a2a, res, dys):
    x, ws = res
    dx, _, full = _gather_backward(x, ws, dys, t, a2a, gather_x=True)
    return dx, tuple(jnp.zeros_like(w) for w in ws), tuple((full, dy.astype(x.dtype)) for dy in dys)


_all_gather_matmul_tapped.defvjp(_agmt_fwd, _agmt_bwd)


def all_gather_matmul(x_shard, kernels, t: int, taps=None, by_all_to_all: bool = False):
    """Y_i = AllGather_s(X) A_i for column-parallel kernels sharing X, by t ring steps.

    x_shard [b, s/t, h], kernels ([h, *out_i]) -> ([b, s, *out_i]), in x_shard's dtype. The
    backward returns dX [b, s/t, h] = ReduceScatter_s(sum_i dY_i A_i^T) and dA_i = X^T dY_i.
    `taps` ((X [b, s, h], Y_i) zeros, one per kernel; `parallel/taps.py`): the split backward's
    form, whose backward gives zero for the kernels and (X, dY_i) to each tap. `by_all_to_all`:
    each ring step as an all-to-all (`ring.pass_along`).
    """
    kernels = tuple(kernels)
    if taps is None:
        return _all_gather_matmul(x_shard, kernels, t, by_all_to_all)
    return _all_gather_matmul_tapped(x_shard, kernels, tuple(taps), t, by_all_to_all)


# matmul_reduce_scatter -------------------------------------------------------------------------
def _scatter_forward(x, w, t: int, a2a: bool):
    """x [b, s, *in_r], w [*in_r, h] -> [b, s/t, h] = sum over ranks of X_r[r'] A_r for this rank r'."""
    r, n = lax.axis_index(TENSOR), x.shape[SEQ] // t
    acc = None
    for j in range(t):
        d = (r - j - 1) % t                                                 # the chunk this step adds to
        part = _x_times(_chunk(x, d, n), w)                                 # [b, n, h]
        acc = part if acc is None else _next(acc, t, a2a) + part
    return acc                                                              # chunk r, summed over ranks


def _scatter_backward(x, w, dy, t: int, a2a: bool, gather_dy: bool):
    """The row layer's backward: one ring of dY chunks [b, n, h] -> (dX [b, s, *in_r], dA [*in_r, h]
    fp32 (None with `gather_dy`), the gathered dY [b, s, h] (with `gather_dy`, else None))."""
    r, n = lax.axis_index(TENSOR), dy.shape[SEQ]
    dx = jnp.zeros(x.shape, x.dtype)
    da = None if gather_dy else jnp.zeros(w.shape, jnp.float32)
    full = jnp.zeros((dy.shape[0], n * t) + dy.shape[2:], dy.dtype) if gather_dy else None
    for j in range(t):
        held = dy                                                           # dY_c, c = (r - j) mod t: [b, n, h]
        if j < t - 1:
            dy = _next(dy, t, a2a)
        c = (r - j) % t
        dx = _place(dx, _times_wT(held, w, 1).astype(x.dtype), c, n)       # [b, n, *in_r] at c
        if gather_dy:
            full = _place(full, held, c, n)
        else:
            da = da + _xT_times(_chunk(x, c, n), held)                      # [*in_r, h]
    return dx, da, full


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_reduce_scatter(x, w, t, a2a):
    return _scatter_forward(x, w, t, a2a)


def _mrs_fwd(x, w, t, a2a):
    return _scatter_forward(x, w, t, a2a), (x, w)


def _mrs_bwd(t, a2a, res, dy):
    x, w = res
    dx, da, _ = _scatter_backward(x, w, dy, t, a2a, gather_dy=False)
    return dx, da.astype(w.dtype)


_matmul_reduce_scatter.defvjp(_mrs_fwd, _mrs_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmul_reduce_scatter_tapped(x, w, tap, t, a2a):
    del tap
    return _scatter_forward(x, w, t, a2a)


def _mrst_fwd(x, w, tap, t, a2a):
    del tap
    return _scatter_forward(x, w, t, a2a), (x, w)


def _mrst_bwd(t, a2a, res, dy):
    x, w = res
    dx, _, full = _scatter_backward(x, w, dy, t, a2a, gather_dy=True)
    return dx, jnp.zeros_like(w), (x, full.astype(x.dtype))


_matmul_reduce_scatter_tapped.defvjp(_mrst_fwd, _mrst_bwd)


def matmul_reduce_scatter(x, kernel, t: int, tap=None, by_all_to_all: bool = False):
    """Y = ReduceScatter_s(X_r A_r) for a row-parallel kernel, by t ring steps.

    x [b, s, *in_r], kernel [*in_r, h] -> [b, s/t, h], summed over ranks. The backward gathers dY
    chunk by chunk: dX_r = AllGather_s(dY) A_r^T [b, s, *in_r], dA_r = X_r^T AllGather_s(dY).
    `tap` ((X, Y [b, s, h]) zeros): the split backward's form (zero for the kernel, (X, dY) to the tap).
    `by_all_to_all`: each ring step as an all-to-all (`ring.pass_along`).
    """
    if tap is None:
        return _matmul_reduce_scatter(x, kernel, t, by_all_to_all)
    return _matmul_reduce_scatter_tapped(x, kernel, tap, t, by_all_to_all)

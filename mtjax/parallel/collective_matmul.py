"""Collective matmuls: sequence parallelism's all-gather and reduce-scatter hidden behind the matmuls.

Shape legend: b micro-batch, s sequence, h hidden, t tensor size, n = s/t (one chunk), r this rank;
a kernel is [*in, *out] (a column layer's [h, *out_r], a row layer's [*in_r, h]).

With sequence parallelism a column-parallel layer computes Y_r = AllGather_s(X) A_r and a
row-parallel one Y = ReduceScatter_s(sum_r X_r A_r) (`tensor_ops.enter_tensor_region`,
`exit_tensor_region`): the collective sits on the critical path before or after its matmul. Here
both are split along s into t chunks, X = [X_0; ...; X_{t-1}], and computed chunk by chunk over the
`tensor` ranks (`ring.pass_along`), so that each step's matmul runs while `ppermute` moves the next
chunk (Wang et al., ASPLOS 2023; Megatron's --tp-comm-overlap):

    all_gather_matmul      Y_r = [X_0; ...; X_{t-1}] A_r = [X_0 A_r; ...; X_{t-1} A_r]:
                           step j multiplies the chunk X_{(r-j) mod t} it holds while the ring
                           brings X_{(r-j-1) mod t}; the rows are put in order once at the end.
    matmul_reduce_scatter  Y_c = sum_r X_r[c] A_r for chunk c: step k computes this rank's share
                           X_r[(r+k) mod t] A_r while the previous step's share travels to its
                           owner; rank r adds the t shares of its chunk Y_r once, in fp32.

The backward of each is the other's pattern: the column layer's dX = ReduceScatter_s(dY A_r^T) is
computed share by share, and X is gathered again riding the same permutes (the forward keeps only
the shard, as `_all_but_gathers` does); the row layer's dX_r = AllGather_s(dY) A_r^T runs on a
ring of dY chunks. The weight gradients are one matmul each on the gathered operand, dA_r =
AllGather_s(X)^T dY_r or X_r^T AllGather_s(dY), as without the overlap: per-chunk products would
write a [*in, *out] fp32 partial per step (at b s << h f, more bytes than the chunk they come
from). Each operator moves t - 1 chunks per rank, as the all-gather or reduce-scatter it replaces
does: the bytes are the same, only their form changes.

Without a fence XLA's scheduler is free to run all t - 1 permutes of a ring back to back and the
matmuls after them (or to merge the t matmuls into one): `ring.fence` ties each step's permutes and
matmuls together (`lax.optimization_barrier`), so step j + 1 starts only when both are done and
each permute can only hide behind its own step's work. Shares travel in the matmul's output dtype
(bf16 in a bf16 step: the bytes of the reduce-scatter replaced) and are summed once in fp32 (one
rounding, where a bf16 ring reduce-scatter rounds at every hop).

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
from mtjax.parallel.ring import fence, pass_along

SEQ = 1   # activations are [b, s, ...]


class SequenceShard(NamedTuple):
    """A column layer's input left as this rank's sequence chunk [b, s/t, h] (sequence
    parallelism): the layers that share it gather it inside their matmuls over t ranks, by a ring
    (`all_gather_matmul`, `tensor_overlap`) or by one all-gather (`async_linear.gather_matmul`)."""
    x: jax.Array
    t: int
    by_all_to_all: bool = False     # the ring's steps as all-to-alls (`ring.pass_along`)
    ring: bool = True               # False: one all-gather, the backward's collectives overlapped
    fused: bool = True              # (ring False) False: the all-gather alone, then the matmuls (half_batches)


def _next(x, t: int, a2a: bool):
    """x sent one step along the ring: rank r receives rank r - 1's value (`ring.pass_along`; as an
    all-to-all with `a2a`: XLA:CPU inside a pipeline stage)."""
    return pass_along(x, TENSOR, t, 1, a2a)


def _chunk(x, c, n: int):
    """Rows [c n, (c + 1) n) of x [b, s, ...] (c traced)."""
    return lax.dynamic_slice_in_dim(x, c * n, n, axis=SEQ)


def _in_order(steps: list, t: int):
    """Y [b, s, ...] from a ring's chunks in step order, steps[j] = Y_{(r - j) mod t} [b, n, ...].
    Reversed they are T_k = Y_{(r + 1 + k) mod t}, so Y is T rolled by r + 1 chunks: the slice of
    [T; T] at (t - 1 - r) n. One concatenate and one slice, which XLA fuses into one pass (or into
    the pass that consumes Y)."""
    r, n = lax.axis_index(TENSOR), steps[0].shape[SEQ]
    twice = jnp.concatenate(steps[::-1] * 2, axis=SEQ)                      # [b, 2s, ...]
    return lax.dynamic_slice_in_dim(twice, (t - 1 - r) % t * n, t * n, axis=SEQ)


def _x_times(x, w):
    """X [b, n, *in] A [*in, *out] -> [b, n, *out]."""
    k = x.ndim - 2
    return jnp.tensordot(x, w, axes=(tuple(range(2, 2 + k)), tuple(range(k))))


def _times_wT(dy, w, k_out: int):
    """dY [b, n, *out] A^T -> [b, n, *in], `k_out` the number of out dims."""
    return jnp.tensordot(dy, w, axes=(tuple(range(dy.ndim - k_out, dy.ndim)), tuple(range(w.ndim - k_out, w.ndim))))


def _xT_times(x, dy):
    """sum over (b, s) of X^T dY: X [b, s, *in], dY [b, s, *out] -> [*in, *out] (one matmul,
    accumulated in fp32 inside it, in the inputs' dtype out, as the einsum's own gradient)."""
    return jnp.tensordot(x, dy, axes=([0, 1], [0, 1]))


def _gather_ring(x, product, t: int, a2a: bool):
    """The gathering ring: x [b, n, ...] (this rank's chunk) -> (product(X_c) for every chunk c in
    order, [b, s, ...]; the gathered X [b, s, ...]). Step j holds X_c, c = (r - j) mod t, and
    computes product(X_c) while the ring brings X_{c-1}."""
    held, out = [], []
    for j in range(t):
        held.append(x)                                                      # X_c: [b, n, ...]
        y = product(x)
        if j < t - 1:
            x, y = fence(_next(x, t, a2a), y)                               # X_{c-1} [b, n, ...] arrived, y done
        out.append(y)
    return _in_order(out, t), _in_order(held, t)


def _summing_ring(part, t: int, a2a: bool, carry, own=None):
    """Chunk r of a sum over ranks: part(c, carry) [b, n, ...] is this rank's share of chunk c.
    Step k = 1, ..., t - 1 computes the share of chunk (r + k) mod t while the previous step's
    share travels k - 1 steps along the ring to its owner (`pass_along`), and the last step this
    rank's own share; the t shares of chunk r (its own and the t - 1 received) are added once, in
    fp32. `carry` (the parts' inputs) goes through each step, so that step k's matmul runs in step
    k. `own` [b, n, ...] (if given) is sent along with each share, the same k - 1 steps (XLA
    combines the two into one collective-permute): -> (chunk r [b, n, ...], the gathered `own`
    [b, s, ...] or None)."""
    r = lax.axis_index(TENSOR)
    held, got, sending = [own], [], None
    for k in list(range(1, t)) + [0]:
        y = part((r + k) % t, carry)
        sends = None if sending is None else tuple(                         # [b, n, ...] each -> the same
            None if v is None else pass_along(v, TENSOR, t, (k - 1) % t, a2a) for v in (sending, own))
        recv, y, carry = fence(sends, y, carry)
        if recv is not None:
            got.append(recv[0])
            held.append(recv[1])                                            # own of rank r - (k - 1)
        sending = y
    total = sum(g.astype(jnp.float32) for g in got) + y.astype(jnp.float32)
    return total.astype(y.dtype), None if own is None else _in_order(held, t)


def _joined(ws):
    """Kernels [h, *out_i] side by side: ([h, sum_i |out_i|], the split of the product's last axis
    back into [*out_i]): one matmul per step for all the layers that share X."""
    flat = [w.reshape(w.shape[0], -1) for w in ws]
    sizes = [f.shape[1] for f in flat]

    def split(y):                                                           # [..., sum] -> ([..., *out_i])
        edges = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return tuple(y[..., lo:hi].reshape(y.shape[:-1] + w.shape[1:]) for lo, hi, w in zip(edges, edges[1:], ws))
    return (flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=1)), split


# all_gather_matmul -----------------------------------------------------------------------------
def _gather_forward(x, ws, t: int, a2a: bool):
    """x [b, n, h] (this rank's chunk), ws ([h, *out_i]) -> ([b, s, *out_i]), by t ring steps."""
    w, split = _joined(ws)
    y, _ = _gather_ring(x, lambda xc: _x_times(xc, w), t, a2a)              # [b, s, sum_i |out_i|]
    return split(y)


def _gather_backward(x, ws, dys, t: int, a2a: bool):
    """The column layer's backward: (dX [b, n, h], the gathered X [b, s, h], dA_i [h, *out_i] as
    one matmul on them). Each step moves X's next chunk and a share sum_i dY_i[c] A_i^T of dX."""
    n, (w, split) = x.shape[SEQ], _joined(ws)
    dy = jnp.concatenate([d.reshape(d.shape[:2] + (-1,)) for d in dys], axis=-1)   # [b, s, sum_i |out_i|]
    dx, full = _summing_ring(lambda c, dy: _times_wT(_chunk(dy, c, n), w, 1), t, a2a, dy, x)
    return dx.astype(x.dtype), full, split(_xT_times(full, dy.astype(x.dtype)))     # (tapped: dA is dead code)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _all_gather_matmul(x, ws, t, a2a):
    return _gather_forward(x, ws, t, a2a)


def _agm_fwd(x, ws, t, a2a):
    return _gather_forward(x, ws, t, a2a), (x, ws)       # keeps the shard, not the gathered X


def _agm_bwd(t, a2a, res, dys):
    x, ws = res
    dx, _, grads = _gather_backward(x, ws, dys, t, a2a)
    return dx, tuple(g.astype(w.dtype) for g, w in zip(grads, ws))


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
    dx, full, _ = _gather_backward(x, ws, dys, t, a2a)
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
    n = x.shape[SEQ] // t
    return _summing_ring(lambda c, x: _x_times(_chunk(x, c, n), w), t, a2a, x)[0]


def _scatter_backward(w, dy, t: int, a2a: bool):
    """The row layer's backward: one ring of dY chunks [b, n, h] -> (dX [b, s, *in_r], the gathered
    dY [b, s, h])."""
    return _gather_ring(dy, lambda dyc: _times_wT(dyc, w, 1), t, a2a)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_reduce_scatter(x, w, t, a2a):
    return _scatter_forward(x, w, t, a2a)


def _mrs_fwd(x, w, t, a2a):
    return _scatter_forward(x, w, t, a2a), (x, w)


def _mrs_bwd(t, a2a, res, dy):
    x, w = res
    dx, full = _scatter_backward(w, dy, t, a2a)
    return dx.astype(x.dtype), _xT_times(x, full.astype(x.dtype)).astype(w.dtype)


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
    dx, full = _scatter_backward(w, dy, t, a2a)
    return dx.astype(x.dtype), jnp.zeros_like(w), (x, full.astype(x.dtype))


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

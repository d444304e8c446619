"""Sequence parallelism's column layers with their backward communication overlapped (Megatron's
`LinearWithGradAccumulationAndAsyncCommunication` under `--sequence-parallel`).

Shape legend: b micro-batch, s sequence, h hidden, t tensor size, n = s/t; a kernel is
[h, *out_i] (this rank's columns).

The column layers of a block share one input, gathered along s: Y_i = AllGather_s(X) A_i, with
X [b, n, h] this rank's rows. Their backward needs three things:

    X_full = AllGather_s(X)                    [s, b, h]   (regathered: the forward keeps X only)
    dX     = ReduceScatter_s(sum_i dY_i A_i^T) [b, n, h]   (dgrad: a partial sum on each rank)
    dA_i   = X_full^T dY_i                     [h, *out_i] (wgrad)

The regather does not depend on the dgrad matmul, nor the reduce-scatter on the wgrad matmuls, so
Megatron issues each collective asynchronously and computes the independent matmul while it runs:

    phase 1   AllGather_s(X)       while  dY A^T            (dgrad)
    phase 2   ReduceScatter_s(dX)  while  X_full^T dY_i     (wgrad)

Each phase is fenced (`ring.fence`: the collective and the matmul released together), so
XLA's scheduler cannot spend the wgrad matmuls on hiding another collective and leave the
reduce-scatter exposed, as it did with these matmuls free (Llama-2-13B shape at t = 8 on H100s,
predicted: 106 us of a layer's backward waited on the reduce-scatter). The layers sharing X are
one matmul in each phase, over their joined columns: the dgrad sum_i dY_i A_i^T = [dY_1 ...
dY_k] [A_1 ... A_k]^T (k products added by separate passes over the full-size [s, b, h] would
cost passes that do not shrink with t: two at Q, K, V), and the wgrad X_full^T [dY_1 ... dY_k],
split into the dA_i after (as k matmuls, XLA's scheduler put Q, K and V's before the
reduce-scatter's start at gpt1.3b, t = 8, where they hid nothing). Given the kernels joined
already (`model/joined_columns.py`: the step joins them once), there is neither the join nor the
split: the joined kernel's gradient is returned joined.

The activations are sequence-major, [s, b, ...] (`tensor_ops.SequenceMajor`): gathering and
scattering the major dim moves the shards as they lie, with no transpose of a full-size tensor.
The split backward (`taps.py`) keeps its form: `taps` ((X_full, Y_i) zeros, [s, b, ...]) get
(X_full, dY_i), and the wgrad is left to W; phase 2 then has nothing to hide the reduce-scatter.
"""
from __future__ import annotations

import itertools
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.mesh import TENSOR
from mtjax.parallel.ring import fence


def _gather(x):
    """[b, n, h] -> [s, b, h]: the shard made sequence-major, then gathered along its major dim."""
    return lax.all_gather(jnp.swapaxes(x, 0, 1), TENSOR, axis=0, tiled=True)      # [n, b, h] -> [s, b, h]


def _scatter(y):
    """partial [s, b, h] -> summed [b, n, h]."""
    return jnp.swapaxes(lax.psum_scatter(y, TENSOR, scatter_dimension=0, tiled=True), 0, 1)   # [s, b, h] -> [b, n, h]


def _products(full, ws, outs):
    """X_full [s, b, h] A_i [h, *out_i] -> ([s, b, *out_i]); the A_i given joined (one kernel
    [h, sum_i |out_i|], `model/joined_columns.py`): one product, split along its last axis."""
    if len(ws) == len(outs):
        return tuple(jnp.tensordot(full, w, axes=([2], [0])) for w in ws)
    y = jnp.tensordot(full, ws[0], axes=([2], [0]))                         # [s, b, sum_i |out_i|]
    return tuple(y[..., lo:hi].reshape(y.shape[:2] + out) for lo, hi, out in column_edges(outs))


def column_edges(outs) -> tuple:
    """(lo, hi, out_i) of each output's columns in the joined [.., sum_i |out_i|]."""
    sizes = [math.prod(out) for out in outs]
    ends = list(itertools.accumulate(sizes))
    return tuple(zip([0, *ends[:-1]], ends, outs))


def _joined(arrays, lead: int):
    """Arrays [*lead dims, *out_i] side by side along one flattened last axis: [*lead, sum_i |out_i|]."""
    flat = [a.reshape(a.shape[:lead] + (-1,)) for a in arrays]
    return flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=-1)


def _split(joined, ws, outs):
    """The weight gradient [h, sum_i |out_i|] as the kernels are given: split into ([h, *out_i]),
    or whole for one joined kernel."""
    if len(ws) < len(outs):
        return (joined,)
    return tuple(joined[:, lo:hi].reshape(joined.shape[:1] + out) for lo, hi, out in column_edges(outs))


def _backward(x, ws, dys, with_wgrad: bool, outs):
    """-> (dX [b, n, h], X_full [s, b, h], the dA_i or None), in two fenced phases. The layers
    sharing X are one matmul in each: their columns joined, [dY_1 ... dY_k] [A_1 ... A_k]^T for
    the dgrad and X_full^T [dY_1 ... dY_k] for the wgrad, split after (unless given joined)."""
    dy = _joined(dys, 2)                                                    # [s, b, sum_i |out_i|]
    full, dxp = fence(_gather(x), jnp.tensordot(dy, _joined(ws, 1), axes=([2], [1])))   # regather || dgrad
    grads = jnp.tensordot(full, dy.astype(full.dtype), axes=([0, 1], [0, 1])) if with_wgrad else None
    dx, grads = fence(_scatter(dxp.astype(x.dtype)), grads)                  # reduce-scatter || wgrad
    return dx, full, None if grads is None else _split(grads, ws, outs)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_matmul(x, ws, outs):
    return _products(_gather(x), ws, outs)


def _gm_fwd(x, ws, outs):
    return _products(_gather(x), ws, outs), (x, ws)     # keeps the shard, not the gathered X


def _gm_bwd(outs, res, dys):
    x, ws = res
    dx, _, grads = _backward(x, ws, dys, True, outs)
    return dx, tuple(g.astype(w.dtype) for g, w in zip(grads, ws))


_gather_matmul.defvjp(_gm_fwd, _gm_bwd)


@jax.custom_vjp
def _gather_matmul_tapped(x, ws, taps):
    del taps
    return _products(_gather(x), ws, _outs(ws))


def _gmt_fwd(x, ws, taps):
    del taps
    return _products(_gather(x), ws, _outs(ws)), (x, ws)


def _gmt_bwd(res, dys):
    x, ws = res
    dx, full, _ = _backward(x, ws, dys, False, _outs(ws))
    return dx, tuple(jnp.zeros_like(w) for w in ws), tuple((full, d.astype(full.dtype)) for d in dys)


_gather_matmul_tapped.defvjp(_gmt_fwd, _gmt_bwd)


def _outs(ws) -> tuple:
    """The output shapes of kernels given one per output, [h, *out_i]."""
    return tuple(tuple(w.shape[1:]) for w in ws)


def gather_matmul(x_shard, kernels, taps=None, outs=None):
    """Y_i = AllGather_s(X) A_i for column-parallel kernels sharing X (t > 1, inside `shard_map`).

    x_shard [b, s/t, h], kernels ([h, *out_i]) -> ([s, b, *out_i]), in x_shard's dtype. The
    backward returns dX [b, s/t, h] = ReduceScatter_s(sum_i dY_i A_i^T) and dA_i = X^T dY_i, each
    collective overlapped with the matmul that does not need it (module docstring). `outs` (the
    out_i): the kernels come joined, one [h, sum_i |out_i|] (`model/joined_columns.py`), and so
    does its gradient: no join before the dgrad, no split after the wgrad. `taps` ((X [s, b, h],
    Y_i [s, b, *out_i]) zeros per kernel; not with `outs`): the split backward's form, zero for
    the kernels and (X, dY_i) to each tap.
    """
    kernels = tuple(kernels)
    if taps is None:
        return _gather_matmul(x_shard, kernels, _outs(kernels) if outs is None else tuple(outs))
    assert outs is None, "taps take the kernels one per output"
    return _gather_matmul_tapped(x_shard, kernels, tuple(taps))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gathered_products(full, ws, x, outs):
    del x
    return _products(full, ws, outs)


def _gp_fwd(full, ws, x, outs):
    return _products(full, ws, outs), (x, ws)           # the shard, not the gathered X


def _gp_bwd(outs, res, dys):
    x, ws = res
    dy = _joined(dys, 2)                                                    # [s, b, sum_i |out_i|]
    full, dfull = _gather(x), jnp.tensordot(dy, _joined(ws, 1), axes=([2], [1]))   # regather, dgrad
    grads = _split(jnp.tensordot(full, dy.astype(full.dtype), axes=([0, 1], [0, 1])), ws, outs)
    return dfull.astype(full.dtype), tuple(g.astype(w.dtype) for g, w in zip(grads, ws)), None   # x: through the gather


_gathered_products.defvjp(_gp_fwd, _gp_bwd)


def gathered_matmul(full, kernels, x_shard, outs=None):
    """Y_i = X_full A_i for column-parallel kernels sharing X_full = AllGather_s(x_shard) [s, b, h],
    gathered by the caller -> ([s, b, *out_i]). The backward gathers X again while it computes
    dX_full (one matmul over the joined columns, phase 1 of the module docstring), then the dA_i
    (one matmul); dX_full's reduce-scatter is the caller's gather's transpose
    (`parallel/half_batches.py`: a stage of its own, hidden by the other half's work). `outs`:
    the kernels joined, as `gather_matmul`'s."""
    kernels = tuple(kernels)
    return _gathered_products(full, kernels, x_shard, _outs(kernels) if outs is None else tuple(outs))

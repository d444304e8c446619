"""Column- and row-parallel linear layers (Megatron's ColumnParallelLinear / RowParallelLinear).

Shape legend: b micro-batch, s sequence, h hidden, t tensor size; `n` is the
output dimension split over `tensor` (heads for attention, f for the MLP).

Both layers are local matrix products. The communication lives at the two
region boundaries (`enter_tensor_region` before the column layers of a
block, `exit_tensor_region` inside the row layer), so a block shares one
f/all-gather among its Q, K and V projections. Each product goes through `taps.linear`, the
split backward's hook (a plain einsum unless the model runs with taps).

With sequence parallelism the column layers of a block get the sequence shard (`SequenceShard`)
and `column_parallel` gathers it inside one matmul for all of them: one all-gather, with the
backward's regather and reduce-scatter each overlapped with the matmul that does not need it
(`async_linear.gather_matmul`, Megatron's async sequence-parallel linear). With
`parallel.tensor_overlap` that gather is a ring hidden behind the products (`collective_matmul.py`,
`all_gather_matmul`), and the row layer's matmul and reduce-scatter are one `matmul_reduce_scatter`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mtjax.parallel import taps
from mtjax.parallel.async_linear import gather_matmul, gathered_matmul
from mtjax.parallel.collective_matmul import SequenceShard, all_gather_matmul, matmul_reduce_scatter
from mtjax.parallel.reductions import ParamBox, tensor_model_parallel
from mtjax.parallel.tensor_ops import (SequenceMajor, exit_tensor_region, gather_to_sequence_major,
                                       reduce_scatter_from_sequence_major, tensor_rank)

Dtype = Any


def declare(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple, init,
            sequence_parallel: bool = False, shared_by_heads: bool = False) -> jnp.ndarray:
    """Declare one fp32 parameter with its logical axes (the only place shapes meet sharding).

    `sequence_parallel` (Megatron's attribute): the parameter is replicated over `tensor` and
    applied to data that sequence parallelism splits over `tensor`, so its gradient is then a
    partial sum over the ranks (`parallel/reductions.py` derives the reductions from this).
    `shared_by_heads`: replicated and applied to every attention head, which `tensor` splits
    (a QK-norm scale): a partial sum whenever t > 1.
    """
    assert not ((sequence_parallel or shared_by_heads) and tensor_model_parallel(axes)), (name, axes)

    def boxed(*args):
        return ParamBox(init(*args), tuple(axes), sequence_parallel=sequence_parallel,
                        shared_by_heads=shared_by_heads)
    return module.param(name, boxed, shape, jnp.float32)


def lead(p, ndim: int):
    """`p` with leading unit axes up to rank `ndim` (explicit broadcasting, no rank promotion)."""
    return p.reshape((1,) * (ndim - p.ndim) + p.shape)


def local(size: int, t: int) -> int:
    """The per-rank size of a dimension split over `tensor`."""
    assert size % t == 0, (size, t)
    return size // t


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A = [A_1 ... A_t] split by output columns; rank r computes Y_r = X A_r + b_r.

    X [b, s, h] (replicated) -> Y_r [b, s, *out_shape] with out_shape[0] divided by t. Given a
    `SequenceShard` (sequence parallelism: X still split along s) the layer declares its weights
    and returns them (`ColumnWeights`), for `column_parallel` to gather X and compute with.

    `pick_t` > 1 (with t = 1: k < t replicated kv heads): A [h, n, ...] is whole on every rank,
    and rank r of the `pick_t` tensor ranks uses only its entry j = r n / pick_t of out_shape[0]:
    A and b are sliced to it before the product, Y_r = X A[:, j] + b[j] -> [b, s, 1, ...] (2 b s h
    |out|/n FLOPs, not n times that). Their gradients are zero outside entry j on each rank; the
    psum over `tensor` of the replicated parameters adds the ranks' entries into the whole.
    """

    out_shape: tuple[int, ...]          # global output dims; the first is split over tensor
    out_axes: tuple[str | None, ...]    # their logical axes
    t: int = 1
    use_bias: bool = True
    std: float = 0.02
    dtype: Dtype = jnp.float32
    pick_t: int = 1                     # > 1: each rank uses one entry of the whole out_shape[0] (above)
    joined: bool = False                # the kernel comes joined with its group's (`column_parallel`): bias only

    @nn.compact
    def __call__(self, x):
        out = (local(self.out_shape[0], self.t),) + tuple(self.out_shape[1:])
        if isinstance(x, SequenceShard):
            return self._weights(x, out)
        w = declare(self, "kernel", (x.shape[-1],) + out, ("embed",) + tuple(self.out_axes),
                    nn.initializers.normal(self.std))
        w, place = self._pick(w, 1)
        y = taps.linear(self, "bsh,h...->bs...", x.astype(self.dtype), w.astype(self.dtype), place=place)
        if self.use_bias:
            b, _ = self._pick(declare(self, "bias", out, tuple(self.out_axes), nn.initializers.zeros), 0)
            y = y + lead(b, y.ndim).astype(self.dtype)
        return y                                         # [b, s, *out_r]

    def _pick(self, p, axis: int) -> tuple:
        """(p, ()) when pick_t = 1; else (p's entry j = r n / pick_t along `axis` [.., 1, ..], the
        tap's place: a one-hot of j over that axis shaped [1, .., n, .., 1] like p, where W puts
        the product's dA, `taps.placed_weight_gradient`)."""
        if self.pick_t == 1:
            return p, ()
        n = p.shape[axis]
        j = tensor_rank(self.pick_t) * n // self.pick_t
        mask = jax.nn.one_hot(j, n, dtype=self.dtype).reshape((1,) * axis + (n,) + (1,) * (p.ndim - axis - 1))
        return lax.dynamic_slice_in_dim(p, j, 1, axis=axis), (mask,)

    def _bias(self, out):
        """This rank's bias (its entry, `pick_t`) in the compute dtype, or None."""
        if not self.use_bias:
            return None
        b, _ = self._pick(declare(self, "bias", out, tuple(self.out_axes), nn.initializers.zeros), 0)
        return b.astype(self.dtype)

    def _weights(self, shard: SequenceShard, out) -> ColumnWeights:
        """Kernel and bias in the compute dtype (this rank's entry of them, `pick_t`), and the tap
        (X [b, s, h], Y [b, s, *out_r]) if tapping: with `pick_t` the (X, Y) view of the tap (X, Y,
        P) that hands W its place (`taps.with_place`)."""
        x = shard.x
        if self.joined:
            assert self.pick_t == 1 and not taps.tapping(self), "a joined kernel is sliced nowhere, tapped nowhere"
            return ColumnWeights(None, self._bias(out), None, out)
        w, place = self._pick(declare(self, "kernel", (x.shape[-1],) + out, ("embed",) + tuple(self.out_axes),
                                      nn.initializers.normal(self.std)), 1)
        w, b = w.astype(self.dtype), self._bias(out)
        tap = None
        if taps.tapping(self):     # (X, Y) over the whole sequence, in the layout the matmul makes
            rows = (x.shape[0], x.shape[1] * shard.t) if shard.ring else (x.shape[1] * shard.t, x.shape[0])
            tap = taps.tap_value(self, jax.ShapeDtypeStruct(rows + x.shape[2:], self.dtype),
                                 jax.ShapeDtypeStruct(rows + w.shape[1:], self.dtype), place=place)
            tap = taps.with_place(tap, *place) if place else tap
        return ColumnWeights(w, b, tap, tuple(w.shape[1:]))


class ColumnWeights(NamedTuple):
    """What a column layer hands `column_parallel` given a `SequenceShard`."""
    kernel: jax.Array | None     # [h, *out_r], compute dtype; None when joined with its group's
    bias: jax.Array | None       # [*out_r]
    tap: Any                     # (X, Y) zeros of the split backward, or None
    out: tuple[int, ...]         # out_r: the product's trailing dims


def column_parallel(x, *layers: ColumnParallelLinear, joined=None) -> tuple:
    """Y_i = X A_i + b_i for column-parallel layers sharing their input X.

    x [b, s, h] (inside the tensor region): each layer applied in turn. x a `SequenceShard` [b, s/t,
    h] (sequence parallelism): one gathered matmul for all the kernels, then each bias: by one
    all-gather, the backward's collectives overlapped (`async_linear.gather_matmul`), ->
    [s, b, *out_i] as `SequenceMajor`; or with `tensor_overlap` by a ring, the gather hidden
    behind the products (`all_gather_matmul`), -> [b, s, *out_i]. `joined` [h, sum_i |out_i|]:
    the layers' kernels side by side (`model/joined_columns.py`; the layers built `joined`)."""
    if not isinstance(x, SequenceShard):
        assert joined is None, "kernels come joined only to a sequence-parallel gathered matmul"
        return tuple(layer(x) for layer in layers)
    weights = [layer(x) for layer in layers]
    dtype = layers[0].dtype
    tapped = [w.tap is not None for w in weights]
    assert all(tapped) or not any(tapped), "every layer of a group is tapped, or none"
    # (k < t replicated kv heads: their layer has t = 1 and its kernel is this rank's one head; the
    # gather is still over the t ranks)
    kernels, layer_taps = [w.kernel for w in weights], [w.tap for w in weights] if all(tapped) else None
    outs = None if joined is None else tuple(w.out for w in weights)
    kernels = kernels if joined is None else [joined.astype(dtype)]
    if x.ring:
        assert joined is None, "the ring multiplies the kernels one by one"
        ys = all_gather_matmul(x.x.astype(dtype), kernels, x.t, layer_taps, x.by_all_to_all)   # [b, s, *out_i]
    elif x.fused:
        ys = gather_matmul(x.x.astype(dtype), kernels, layer_taps, outs)                        # [s, b, *out_i]
    else:   # half_batches: the gather a stage of its own (`parallel/half_batches.py`); no taps there
        shard = x.x.astype(dtype)                                                               # [b, s/t, h]
        ys = gathered_matmul(gather_to_sequence_major(shard, x.t), kernels, shard, outs)       # [s, b, *out_i]
    ys = tuple(y if w.bias is None else y + lead(w.bias, y.ndim) for y, w in zip(ys, weights))
    return ys if x.ring else tuple(SequenceMajor(y) for y in ys)


def batch_major(y):
    """A column layer's output as [b, s, ...] (a `SequenceMajor` [s, b, ...] transposed)."""
    return jnp.swapaxes(y.x, 0, 1) if isinstance(y, SequenceMajor) else y


def elementwise(fn, *ys):
    """fn over column layers' outputs, in their layout: SequenceMajor in, SequenceMajor out."""
    if isinstance(ys[0], SequenceMajor):
        return SequenceMajor(fn(*(y.x for y in ys)))
    return fn(*ys)


class RowParallelLinear(nn.Module):
    """Y = X A + b with A = [A_1; ...; A_t] split by input rows; Y = sum_r X_r A_r, then + b once.

    X_r [b, s, *in_shape/t] -> partial [b, s, h] -> exit (all-reduce, or
    reduce-scatter to [b, s/t, h] with sequence parallelism) -> + b. With sequence parallelism
    the partial sum is made as [s, b, h] from X_r as [s, b, ...] (a `SequenceMajor`, or X_r
    transposed: never the t-times larger sum, `tensor_ops`).
    """

    in_shape: tuple[int, ...]           # global input dims; the first is split over tensor
    in_axes: tuple[str | None, ...]
    features: int                       # h
    t: int = 1
    sp: bool = False
    use_bias: bool = True
    std: float = 0.02
    dtype: Dtype = jnp.float32
    overlap: bool = False               # tensor_overlap (with sp): matmul and reduce-scatter as one ring
    ring_by_all_to_all: bool = False    # that ring's steps as all-to-alls (`ring.pass_along`)

    @nn.compact
    def __call__(self, x):
        inp = (local(self.in_shape[0], self.t),) + tuple(self.in_shape[1:])
        w = declare(self, "kernel", inp + (self.features,), tuple(self.in_axes) + ("embed",),
                    nn.initializers.normal(self.std))
        if self.overlap:
            y = self._overlapped(x.astype(self.dtype), w.astype(self.dtype))     # [b, s/t, h]
        else:
            contract = "".join("ijk"[: len(inp)])
            major = self.sp and self.t > 1
            if major:                                        # -> [s, b, *in_r]
                x = x.x if isinstance(x, SequenceMajor) else jnp.swapaxes(x, 0, 1)
            partial = taps.linear(self, f"bs{contract},{contract}h->bsh", x.astype(self.dtype), w.astype(self.dtype))
            y = (reduce_scatter_from_sequence_major(partial, self.t) if major      # [b, s/t, h]
                 else exit_tensor_region(partial, self.t, self.sp))               # [b, s, h] or [b, s/t, h]
        if self.use_bias:  # after the reduction: added once, not t times
            # applied to [b, s/t, h] under sequence parallelism: each rank's gradient is partial
            b = declare(self, "bias", (self.features,), ("embed",), nn.initializers.zeros, sequence_parallel=True)
            y = y + lead(b, y.ndim).astype(self.dtype)
        return y

    def _overlapped(self, x, w):
        """x [b, s, *in_r] -> [b, s/t, h]: `matmul_reduce_scatter`, tapped (X, Y [b, s, h]) if tapping."""
        tap = None
        if taps.tapping(self):
            tap = taps.tap_value(self, x, jax.ShapeDtypeStruct(x.shape[:2] + (self.features,), self.dtype))
        return matmul_reduce_scatter(x, w, self.t, tap, self.ring_by_all_to_all)

"""Column- and row-parallel linear layers (Megatron's ColumnParallelLinear / RowParallelLinear).

Shape legend: b micro-batch, s sequence, h hidden, t tensor size; `n` is the
output dimension split over `tensor` (heads for attention, f for the MLP).

Both layers are local matrix products. The communication lives at the two
region boundaries (`enter_tensor_region` before the column layers of a
block, `exit_tensor_region` inside the row layer), so a block shares one
f/all-gather among its Q, K and V projections. Each product goes through `taps.linear`, the
split backward's hook (a plain einsum unless the model runs with taps).

With `parallel.tensor_overlap` the crossing points move into the matmuls (`collective_matmul.py`):
the column layers of a block get the sequence shard (`SequenceShard`) and `column_parallel` gathers
it inside one `all_gather_matmul` for all of them; the row layer's matmul and reduce-scatter are
one `matmul_reduce_scatter`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.parallel import taps
from mtjax.parallel.collective_matmul import SequenceShard, all_gather_matmul, matmul_reduce_scatter
from mtjax.parallel.reductions import ParamBox, tensor_model_parallel
from mtjax.parallel.tensor_ops import SequenceMajor, exit_tensor_region, reduce_scatter_from_sequence_major

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

    X [b, s, h] (replicated) -> Y_r [b, s, *out_shape] with out_shape[0] divided by t. Given X as
    a `SequenceMajor` [s, b, h] (sequence parallelism's gather), Y_r comes back as one too,
    [s, b, *out_r] (`tensor_ops`; `batch_major` turns it round). Given a `SequenceShard`
    instead, the layer declares its weights and returns them (`ColumnWeights`), for
    `column_parallel` to compute with.
    """

    out_shape: tuple[int, ...]          # global output dims; the first is split over tensor
    out_axes: tuple[str | None, ...]    # their logical axes
    t: int = 1
    use_bias: bool = True
    std: float = 0.02
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        out = (local(self.out_shape[0], self.t),) + tuple(self.out_shape[1:])
        if isinstance(x, SequenceShard):
            return self._weights(x, out)
        major = isinstance(x, SequenceMajor)
        x = x.x if major else x                          # [s, b, h] or [b, s, h]
        w = declare(self, "kernel", (x.shape[-1],) + out, ("embed",) + tuple(self.out_axes),
                    nn.initializers.normal(self.std))
        y = taps.linear(self, "bsh,h...->bs...", x.astype(self.dtype), w.astype(self.dtype))   # (s, b) alike
        if self.use_bias:
            b = declare(self, "bias", out, tuple(self.out_axes), nn.initializers.zeros)
            y = y + lead(b, y.ndim).astype(self.dtype)
        return SequenceMajor(y) if major else y          # [s, b, *out_r] or [b, s, *out_r]


    def _weights(self, shard: SequenceShard, out) -> ColumnWeights:
        """Kernel and bias in the compute dtype, and the tap (X [b, s, h], Y [b, s, *out]) if tapping."""
        x = shard.x
        w = declare(self, "kernel", (x.shape[-1],) + out, ("embed",) + tuple(self.out_axes),
                    nn.initializers.normal(self.std)).astype(self.dtype)
        b = declare(self, "bias", out, tuple(self.out_axes), nn.initializers.zeros) if self.use_bias else None
        tap = None
        if taps.tapping(self):
            s = x.shape[1] * shard.t
            tap = taps.tap_value(self, jax.ShapeDtypeStruct((x.shape[0], s, x.shape[2]), self.dtype),
                                 jax.ShapeDtypeStruct((x.shape[0], s) + out, self.dtype))
        return ColumnWeights(w, None if b is None else b.astype(self.dtype), tap)


class ColumnWeights(NamedTuple):
    """What a column layer hands `column_parallel` under `tensor_overlap`."""
    kernel: jax.Array            # [h, *out_r], compute dtype
    bias: jax.Array | None       # [*out_r]
    tap: Any                     # (X, Y) zeros of the split backward, or None


def column_parallel(x, *layers: ColumnParallelLinear) -> tuple:
    """Y_i = X A_i + b_i for column-parallel layers sharing their input X.

    x [b, s, h] (inside the tensor region), or its `SequenceMajor` [s, b, h]: each layer applied
    in turn, outputs in x's layout. x a `SequenceShard` [b, s/t, h] (`tensor_overlap`): one
    `all_gather_matmul` for all the kernels, the gather hidden behind the products, then each
    bias. -> (Y_i [b, s, *out_i], or [s, b, *out_i] as `SequenceMajor`)."""
    if not isinstance(x, SequenceShard):
        return tuple(layer(x) for layer in layers)
    weights = [layer(x) for layer in layers]
    dtype = layers[0].dtype
    tapped = [w.tap is not None for w in weights]
    assert all(tapped) or not any(tapped), "every layer of a group is tapped, or none"
    # (k < t replicated kv heads: their layer has t = 1, the gather is still over the t ranks)
    ys = all_gather_matmul(x.x.astype(dtype), [w.kernel for w in weights], x.t,
                           [w.tap for w in weights] if all(tapped) else None, x.by_all_to_all)
    return tuple(y if w.bias is None else y + lead(w.bias, y.ndim) for y, w in zip(ys, weights))


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

"""Megatron's conjugate communication operators on the `tensor` mesh axis.

Shape legend: b micro-batch, s sequence, h hidden, t tensor-parallel size.
Every operator but `gather_to_sequence_major` is a pair (forward, transpose) written with
`jax.custom_vjp` so that the backward pass communicates exactly what Megatron's does, with no
collective left to the autodiff system. Each takes `t` and emits no collective when t = 1: the
identity, or for the two sequence-major operators a transpose of dims 0 and 1. They must run
inside `shard_map` with `tensor` as a manual axis (`check_vma=False`).

Convention for a value replicated over `tensor`: every rank holds the full
value and the full cotangent (never a 1/t share).

    operator                              forward              backward
    copy_to_tensor_region (f)             identity             all-reduce
    reduce_from_tensor_region (g)         all-reduce           identity
    scatter_to_tensor_region              split last dim       all-gather last dim
    gather_from_tensor_region             all-gather last dim  split last dim
    scatter_to_sequence_region            split dim 1          all-gather dim 1
    gather_from_sequence_region           all-gather dim 1     reduce-scatter dim 1
    reduce_scatter_to_sequence_region     reduce-scatter dim 1 all-gather dim 1
    reduce_scatter_from_sequence_major    [s, b, h] -> reduce-scattered [b, s/t, h]  all-gather dim 0
    gather_to_sequence_major              [b, s/t, h] -> all-gathered [s, b, h]  reduce-scatter (autodiff's)

The last two are the row and column layers' crossing points under sequence parallelism
(`SequenceMajor`); the column layers' is usually their gathered matmul (`async_linear.gather_matmul`,
given a `SequenceShard`), `gather_to_sequence_major` only where half_batches stages the gather. A
collective gathers or scatters its operand's major dimension: gathering dim 1 of [b, s/t, h] makes
XLA gather [t, b, s/t, h] and transpose the whole result into [b, s, h] (when b > 1), and scattering
dim 1 transposes the whole [b, s, h] operand first, passes over full-size activations that do not
shrink with t (at gpt1.3b, t = 8, b = 8: 11 of them per layer, 17% of the step predicted on an
H100). The column layers take the gathered activation as [s, b, h] (Megatron's layout) and the row
layer makes its partial sum as [s, b, h], so only the t-times smaller shards and per-rank
activations are ever transposed.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.mesh import TENSOR
from mtjax.parallel.collective_matmul import SequenceShard

SEQ_DIM = 1  # activations are [b, s, h]


def _split(x, dim: int):
    """This rank's contiguous 1/t slice of `x` along `dim` (no communication)."""
    size = x.shape[dim] // lax.axis_size(TENSOR)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(TENSOR) * size, size, axis=dim)


def _all_gather(x, dim: int):
    return lax.all_gather(x, TENSOR, axis=dim, tiled=True)                 # [.., n/t, ..] -> [.., n, ..] at dim


def _reduce_scatter(x, dim: int):
    return lax.psum_scatter(x, TENSOR, scatter_dimension=dim, tiled=True)  # partial [.., n, ..] -> summed [.., n/t, ..]


# f: identity forward, all-reduce backward -----------------------------------
@jax.custom_vjp
def _copy(x):
    return x


_copy.defvjp(lambda x: (x, None), lambda _, g: (lax.psum(g, TENSOR),))    # partial dX [b, s, h] -> summed [b, s, h]


def copy_to_tensor_region(x, t: int):
    """f. Forward X -> X (X replicated); backward dL/dX = sum over ranks of the partial dL/dX_r."""
    return x if t == 1 else _copy(x)


# g: all-reduce forward, identity backward -----------------------------------
@jax.custom_vjp
def _reduce(x):
    return lax.psum(x, TENSOR)                                              # partial [b, s, h] -> summed [b, s, h]


_reduce.defvjp(lambda x: (lax.psum(x, TENSOR), None), lambda _, g: (g,))   # as `_reduce`


def reduce_from_tensor_region(x, t: int):
    """g. Forward Y = sum_r Y_r (partial sums -> replicated); backward passes dL/dY to every rank."""
    return x if t == 1 else _reduce(x)


# split / gather along the last dimension ------------------------------------
@jax.custom_vjp
def _scatter_last(x):
    return _split(x, x.ndim - 1)


_scatter_last.defvjp(lambda x: (_split(x, x.ndim - 1), None), lambda _, g: (_all_gather(g, g.ndim - 1),))


@jax.custom_vjp
def _gather_last(x):
    return _all_gather(x, x.ndim - 1)


_gather_last.defvjp(lambda x: (_all_gather(x, x.ndim - 1), None), lambda _, g: (_split(g, g.ndim - 1),))


def scatter_to_tensor_region(x, t: int):
    """Forward [..., n] -> [..., n/t] (this rank's slice); backward all-gathers the cotangent."""
    return x if t == 1 else _scatter_last(x)


def gather_from_tensor_region(x, t: int):
    """Forward all-gather [..., n/t] -> [..., n]; backward keeps this rank's slice of the cotangent."""
    return x if t == 1 else _gather_last(x)


# sequence parallelism: along dim 1 of [b, s, h] ------------------------------
@jax.custom_vjp
def _scatter_seq(x):
    return _split(x, SEQ_DIM)


_scatter_seq.defvjp(lambda x: (_split(x, SEQ_DIM), None), lambda _, g: (_all_gather(g, SEQ_DIM),))


@jax.custom_vjp
def _gather_seq(x):
    return _all_gather(x, SEQ_DIM)


_gather_seq.defvjp(lambda x: (_all_gather(x, SEQ_DIM), None), lambda _, g: (_reduce_scatter(g, SEQ_DIM),))


@jax.custom_vjp
def _reduce_scatter_seq(x):
    return _reduce_scatter(x, SEQ_DIM)


_reduce_scatter_seq.defvjp(lambda x: (_reduce_scatter(x, SEQ_DIM), None), lambda _, g: (_all_gather(g, SEQ_DIM),))


def scatter_to_sequence_region(x, t: int):
    """Forward [b, s, h] -> [b, s/t, h] (no communication); backward all-gathers along s."""
    return x if t == 1 else _scatter_seq(x)


def gather_from_sequence_region(x, t: int):
    """Forward all-gather [b, s/t, h] -> [b, s, h]; backward reduce-scatters the partial cotangents to [b, s/t, h].

    The backward is a reduce-scatter, not a split: after a column-parallel
    layer each rank holds only its partial dL/dX.
    """
    return x if t == 1 else _gather_seq(x)


def reduce_scatter_to_sequence_region(x, t: int):
    """Forward reduce-scatter partial [b, s, h] -> summed [b, s/t, h]; backward all-gathers along s."""
    return x if t == 1 else _reduce_scatter_seq(x)


# sequence parallelism, sequence-major: the column and row layers' side ---------
class SequenceMajor(NamedTuple):
    """A column layer's output over the gathered sequence, [s, b, ...] (`async_linear`)."""
    x: jax.Array


def _to_seq_major(x):
    return jnp.swapaxes(x, 0, SEQ_DIM)      # [b, s, ...] <-> [s, b, ...]


def _gather_major(x):
    return lax.all_gather(_to_seq_major(x), TENSOR, axis=0, tiled=True)         # [b, s/t, .] -> [s, b, .]


def _scatter_major(y):
    return _to_seq_major(lax.psum_scatter(y, TENSOR, scatter_dimension=0, tiled=True))   # [s, b, .] -> [b, s/t, .]


@jax.custom_vjp
def _scatter_seq_major(y):
    return _scatter_major(y)


_scatter_seq_major.defvjp(lambda y: (_scatter_major(y), None), lambda _, g: (_gather_major(g),))


def gather_to_sequence_major(x, t: int):
    """All-gather [b, s/t, h] -> [s, b, h] (its transpose, a reduce-scatter, is the backward). A
    plain `lax.all_gather`, so that a layer's recompute policy sees it and gathers again rather
    than keep the [s, b, h] result (`model/block._all_but_gathers`)."""
    return _to_seq_major(x) if t == 1 else _gather_major(x)


def reduce_scatter_from_sequence_major(y, t: int):
    """Forward reduce-scatter partial [s, b, h] -> summed [b, s/t, h]; backward all-gathers to [s, b, h]."""
    return _to_seq_major(y) if t == 1 else _scatter_seq_major(y)


def tensor_rank(t: int):
    """This rank along `tensor` (0 when t = 1, without touching the axis)."""
    return 0 if t == 1 else lax.axis_index(TENSOR)


def enter_tensor_region(x, t: int, sp: bool, overlap: bool = False, ring_by_all_to_all: bool = False,
                        sequence_major: bool = False, fused: bool = True):
    """Where a column-parallel layer begins: f, or with sequence parallelism an all-gather along s.

    [b, s, h] -> [b, s, h]  (f), or [b, s/t, h] -> [b, s, h]  (all-gather). With `sequence_major`
    (for column layers only, `layers.column_parallel`), sp and t > 1 the gather is left to the
    column layers' matmuls: x [b, s/t, h] comes back marked as a `SequenceShard`, gathered by one
    all-gather into [s, b, h] (`async_linear.gather_matmul`), or with `overlap` (tensor_overlap)
    by a ring hidden behind the products (`collective_matmul.all_gather_matmul`; its steps as
    all-to-alls with `ring_by_all_to_all`: `ring.pass_along`). `fused` False (half_batches): the
    all-gather is its own operation before the matmuls, hidden by the other half's work instead.
    """
    if sp and t > 1 and (overlap or sequence_major):
        return SequenceShard(x, t, ring_by_all_to_all, ring=overlap, fused=fused)
    return gather_from_sequence_region(x, t) if sp else copy_to_tensor_region(x, t)


def exit_tensor_region(y, t: int, sp: bool):
    """Where a row-parallel layer ends: g, or with sequence parallelism a reduce-scatter along s.

    partial [b, s, h] -> [b, s, h]  (g), or partial [b, s, h] -> [b, s/t, h]  (reduce-scatter)
    """
    return reduce_scatter_to_sequence_region(y, t) if sp else reduce_from_tensor_region(y, t)

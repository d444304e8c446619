"""Collectives that XLA's gloo backend gets wrong, written around.

XLA runs a CPU job of several processes through gloo. There its reduce-scatter intermittently
returns wrong values at the end of rank 0's block (jax-ml/jax#40830; seen with jaxlib 0.10.2).
Every gradient reduce-scatter over the replicas (the distributed optimizer's, FSDP's) goes
through `psum_scatter` here, which on gloo builds the same blocks from an all-to-all and a local
sum. Where gloo is not used (one process, or GPUs) it is `lax.psum_scatter` itself: the program
is unchanged.
"""
from __future__ import annotations

import jax
from jax import lax


def gloo_collectives() -> bool:
    """True where XLA runs the collectives through gloo: CPU devices of several processes."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu"


def psum_scatter(x, axis, dim: int):
    """`lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)`: this rank's 1/n block of
    the sum along `dim`. Through gloo: block i of every rank to rank i (an all-to-all), then a
    local sum in rank order, which moves the same bytes."""
    if not gloo_collectives():
        return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)   # [.., n, ..] -> [.., n/r, ..]
    n = lax.psum(1, axis)                                      # the ranks of `axis` (a name or a tuple)
    blocks = lax.all_to_all(x, axis, dim, dim, tiled=True)     # [.., n, ..]: r blocks of n/r, rank-major
    return blocks.reshape(x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:]).sum(dim)   # [.., n/r, ..]

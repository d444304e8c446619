"""One step along a ring of ranks on a mesh axis: the send that ring attention (`context`) and the
collective matmuls (`tensor`) are built from.

    pass_along(x, axis, n, step)   rank r sends x to rank r + step mod n, receives rank r - step's
    fence(*values)                 values released together: what a step sent and what it computed

It is a collective-permute of x's shape. XLA:CPU (jaxlib 0.10.2) cannot run one inside a pipeline
stage: there a stage's work runs under `lax.cond`, which only that stage's devices take, and the
CPU runtime's in-process collective-permute waits for every device the instruction names, the other
stages' too (the step hung under GPipe and 1F1B, and under zb paired sends of different ticks and
returned wrong values; all-gathers and reduce-scatters meet only their replica group and are
unaffected). There `by_all_to_all` sends the same values through an all-to-all of [n, ...] in which
only the block for rank r + step is non-zero: the same result, n times the bytes. The layout
(`ModelLayout.local_model`) asks for it on CPU meshes with pipe > 1 only; every GPU program uses
the permute.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def pass_along(x, axis: str, n: int, step: int = 1, by_all_to_all: bool = False):
    """x from rank r to rank r + step mod n along `axis` (n ranks); x itself at n = 1."""
    if n == 1:
        return x
    if not by_all_to_all:
        return lax.ppermute(x, axis, [(i, (i + step) % n) for i in range(n)])    # x's shape: rank r - step's x
    r = lax.axis_index(axis)
    out = jnp.zeros((n, *x.shape), x.dtype).at[(r + step) % n].set(x)           # [n, ...] one block set
    got = lax.all_to_all(out, axis, 0, 0, tiled=True)                            # [n, ...] block j from rank j
    return got[(r - step) % n]


def fence(*values):
    """`values` released together (`lax.optimization_barrier`): a collective's result and the work
    meant to hide it, so that whatever consumes either starts after both. XLA's scheduler then
    overlaps the collective with that work and cannot spend the work on another collective."""
    return lax.optimization_barrier(values)

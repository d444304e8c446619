"""Context parallelism's layout of a sequence over the `context` mesh axis (Megatron's CP split).

Shape legend: b micro-batch, s sequence (the whole row), c context size, L = s / 2c chunk length.

Causal attention gives late tokens more work than early ones (token i attends to i + 1 keys), so
a plain split of s into c contiguous pieces would leave the last rank with 2c - 1 times the
first's. Each row is cut into 2c chunks of L tokens instead, and context rank r holds

    chunk r and chunk 2c - 1 - r:   positions [r L, (r + 1) L) then [(2c - 1 - r) L, (2c - r) L)

so every rank holds one early and one late chunk and the same causal work (Megatron-Core's
`get_batch_on_this_cp_rank`). A rank's s/c rows are these two chunks, in this order; its tokens,
labels and loss mask are cut once, at the data, and every layer sees only them. Each token keeps
its true position (learned positions and RoPE read `context_positions`), and attention
reads the true positions for its causal mask.

c = 1 is the identity: rank 0 holds chunks 0 and 1, the whole row in order, and nothing here
touches the `context` axis.

Collective operators (inside `shard_map` with `context` manual, `check_vma=False`; identities at
c = 1, emitting no collective), in the style of `tensor_ops`:

    operator                     forward                        backward
    gather_from_context_region   all-gather dim 1, rank-major   reduce-scatter dim 1
    pass_to_next_rank            rank r sends to r + step mod c (autodiff's: the inverse permute)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.mesh import CONTEXT
from mtjax.parallel.ring import pass_along


def context_rank(c: int):
    """This rank along `context` (0 when c = 1, without touching the axis; inside shard_map)."""
    return 0 if c == 1 else lax.axis_index(CONTEXT)


def chunk_positions(s: int, c: int, rank):
    """The true positions [s/c] of context rank `rank`'s tokens in a row of s: chunk `rank`, then
    chunk 2c - 1 - `rank` (module docstring). `rank` may be traced."""
    L = s // (2 * c)
    first = jnp.arange(L, dtype=jnp.int32) + rank * L
    return jnp.concatenate([first, first + (2 * c - 1 - 2 * rank) * L])


def context_positions(s_local: int, c: int):
    """This rank's true positions [s_local] (s_local = s/c, the rows it holds); 0 .. s - 1 at c = 1."""
    return chunk_positions(s_local * c, c, context_rank(c))


def all_positions(s: int, c: int):
    """[c, s/c]: every rank's positions, rank-major (the order an all-gather over `context` returns
    its pieces in)."""
    return jnp.stack([chunk_positions(s, c, r) for r in range(c)])


def split_row(x, c: int, axis: int = 1):
    """This rank's s/c entries of x along `axis` (a row of s tokens, labels or mask values), in
    the order of `context_positions`; x itself at c = 1."""
    if c == 1:
        return x
    s = x.shape[axis]
    return jnp.take(x, chunk_positions(s, c, context_rank(c)), axis=axis)


def gather_rows(x, c: int, axis: int = 1):
    """The inverse of `split_row` for values every rank computed on its own s/c rows: all-gather
    [.., s/c, ..] over `context` -> [.., s, ..] in true position order (for logits, not in the
    training step; the backward is autodiff's). x itself at c = 1."""
    if c == 1:
        return x
    pieces = lax.all_gather(x, CONTEXT, axis=axis, tiled=True)        # [.., s, ..] rank-major chunks
    order = jnp.argsort(all_positions(pieces.shape[axis], c).reshape(-1))
    return jnp.take(pieces, order, axis=axis)


def _all_gather_seq(x):
    return lax.all_gather(x, CONTEXT, axis=1, tiled=True)                   # [b, s/c, ...] -> [b, s, ...]


@jax.custom_vjp
def _gather_context(x):
    return _all_gather_seq(x)


def _gather_context_forward(x):
    return _all_gather_seq(x), None


def _gather_context_backward(_, g):
    return (lax.psum_scatter(g, CONTEXT, scatter_dimension=1, tiled=True),)  # partial [b, s, ...] -> [b, s/c, ...]


_gather_context.defvjp(_gather_context_forward, _gather_context_backward)


def gather_from_context_region(x, c: int):
    """Forward all-gather along s: [b, s/c, ...] -> [b, s, ...], rank r's rows at [r s/c, (r+1) s/c)
    (rank-major: the positions `all_positions` flattened); backward reduce-scatters the partial
    cotangents [b, s, ...] -> [b, s/c, ...] (every rank's queries read every rank's K and V, so
    each holds a part of every rank's dK, dV)."""
    return x if c == 1 else _gather_context(x)


def pass_to_next_rank(x, c: int, step: int = 1, by_all_to_all: bool = False):
    """The ring step over `context`: rank r sends x to rank r + step mod c and receives rank
    r - step's (one collective-permute of x's shape; step -1 turns the ring the other way; as an
    all-to-all with `by_all_to_all`, `ring.pass_along`); x itself at c = 1."""
    return pass_along(x, CONTEXT, c, step, by_all_to_all)

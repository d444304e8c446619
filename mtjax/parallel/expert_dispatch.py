"""Tokens to their experts and back: slot assignment, capacity, the all-to-all over the expert
ranks, and the combine in the tokens' own order.

Shape legend: b micro-batch rows, s tokens of a row (this rank's: s/c with context parallelism),
k experts per token, n = s k routed entries of a row (token-major, choice-minor), E experts, e
expert ranks, E_r = E/e experts per rank, C capacity (slots per expert and row), h hidden.

Slots. Capacity is per expert and per row (sequence), so a layout that keeps rows whole (every
(d, m, b) split) drops exactly what one device drops. Within a row the entries routed to expert x
are ordered by (score descending, entry ascending): that is the drop order, the lowest-scored
entry first, ties by position, and entry j's slot is its rank in that order. Slots >= C are
dropped (their token gets nothing from that expert). Dropless: C = s, the worst case (every token
of the row picks x), so nothing is ever dropped on any input.

Exchange. Each rank fills a buffer [E, b, C, h] (empty slots zero), cuts it along E into e blocks
of E_r experts and sends block j to the j-th rank of its expert group (`lax.all_to_all`, static
sizes, so it runs on XLA:CPU, where `ragged_all_to_all` does not); rank j receives [e, E_r, b, C,
h]: its experts' slots from every rank of the group. The outputs go back by the same all-to-all,
and each token sums its k experts' outputs in choice order: the combine is a gather, no
scatter-add, so it is deterministic.

Cost (per MoE layer and rank): the buffer holds E b C h values each way; dropless that is E/k
times the b s k h routed values (the price of static shapes). A GPU path would send only the
routed entries (`ragged_all_to_all`) and run the experts as one grouped matmul (`ragged_dot`).
"""
from __future__ import annotations

import math
from fractions import Fraction

import jax.numpy as jnp
from jax import lax


def capacity(factor: float, s: int, k: int, num_experts: int) -> int:
    """C slots per expert and row: ceil(factor s k / E), at most s; factor 0 (dropless): s.

    Exact: the factor is read as the decimal it was written as (the shortest decimal that rounds
    to the float, `repr`), and the ceiling taken of a fraction. In binary floats 1.1 * 100 * 2 / 4
    is 55.00000000000001, one slot too many."""
    if factor == 0:
        return s
    return max(1, min(s, math.ceil(Fraction(repr(float(factor))) * s * k / num_experts)))


def slots(expert, score, num_experts: int, entry=None):
    """expert [b, n] int, score [b, n] (no gradient) -> pos [b, n] int32: each entry's rank among
    its row's entries routed to the same expert, ordered by (score descending, entry ascending).
    `entry` [n]: each column's index in the row (default 0 .. n - 1; context parallelism gathers
    its ranks' columns out of row order)."""
    b, n = expert.shape
    entry = jnp.broadcast_to(jnp.arange(n) if entry is None else entry, (b, n))
    order = jnp.lexsort((entry, -score, expert), axis=-1)                     # [b, n]: by expert, then rank
    counts = jnp.sum(jnp.arange(num_experts)[None, None, :] == expert[..., None], axis=1)   # [b, E]
    starts = jnp.cumsum(counts, axis=-1) - counts                             # first sorted index per expert
    in_order = jnp.arange(n)[None, :] - jnp.take_along_axis(starts, jnp.take_along_axis(expert, order, -1), -1)
    rows = jnp.arange(b)[:, None]
    return jnp.zeros((b, n), jnp.int32).at[rows, order].set(in_order.astype(jnp.int32))


def dispatch(x, expert, pos, num_experts: int, cap: int, k: int):
    """x [b, s, h] -> buffer [E, b, C, h]: slot (x, i, c) (expert, row, slot) holds the token routed
    there, zero if empty."""
    b, s, h = x.shape
    token = jnp.broadcast_to(jnp.arange(expert.shape[1]) // k, expert.shape)
    rows = jnp.arange(b)[:, None]
    src = jnp.full((b, num_experts, cap), s, jnp.int32).at[rows, expert, pos].set(token, mode="drop")
    padded = jnp.concatenate([x, jnp.zeros((b, 1, h), x.dtype)], axis=1)     # row s: the empty slot's zero
    taken = jnp.take_along_axis(padded, src.reshape(b, num_experts * cap)[..., None], axis=1)
    return taken.reshape(b, num_experts, cap, h).transpose(1, 0, 2, 3)


def combine(out, expert, pos, gate, k: int):
    """out [E, b, C, h] (this rank's slots, back from the experts), gate [b, n] fp32 -> [b, s, h]
    fp32: y_t = sum over t's k choices (in order) of gate x its expert's output, dropped ones 0."""
    num_experts, b, cap, h = out.shape
    flat = out.transpose(1, 0, 2, 3).reshape(b, num_experts * cap, h)
    slot = expert * cap + jnp.minimum(pos, cap - 1)
    y = jnp.take_along_axis(flat, slot[..., None], axis=1).astype(jnp.float32)   # [b, n, h]
    weight = jnp.where(pos < cap, gate, 0.0)
    return (y * weight[..., None]).reshape(b, -1, k, h).sum(axis=2)


def expert_rank(e: int, axes):
    """This rank's place in its expert group: the replica index (over `axes`) mod e."""
    return 0 if e == 1 else lax.axis_index(axes) % e


def exchange(buf, e: int, axes, replicas: int):
    """[E, ...] by destination expert -> [E, ...] by source: block j (E_r experts) to the group's
    j-th rank, received blocks stacked in source order; the same call sends the outputs back.
    Groups are e consecutive replicas of `axes`."""
    if e == 1:
        return buf
    groups = None if e == replicas else [list(range(g * e, (g + 1) * e)) for g in range(replicas // e)]
    return lax.all_to_all(buf, axes, 0, 0, tiled=True, axis_index_groups=groups)   # [E, b, C, h] -> [e E_r, b, C, h]

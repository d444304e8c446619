"""Two halves of a micro-batch through one layer, each half's collectives hidden behind the other
half's matmuls (batch-split overlap, as in Domino, Wang et al. 2024; DeepSeek-V3 overlaps two
micro-batches the same way).

Shape legend: b micro-batch, s sequence, h hidden, t tensor size; a half is [b/2, ...] (or, halving
the sequence, [b, s/2, ...]).

Within one micro-batch a layer's tensor-parallel collectives sit on its critical path: each
all-gather feeds the matmul after it and each reduce-scatter follows the matmul before it. The two
halves of the micro-batch, A = x[:b/2] and B = x[b/2:], are independent, so B's matmuls can run
while A's collectives move and the other way round. XLA's scheduler, given both chains in one
program, does not do this on its own (it places a collective's start and done around whatever is
ready, often nothing of the other half), so the layer is written out as windows:

    layer(A), layer(B) traced into one program, then cut at their collectives into stages:
        G  collectives, with the computation between them that has no matmul (norms, residual adds)
        M  a run between two collectives with a matmul (projections, attention core, MLP)
    each half alternates  G M G M ... ; the halves are merged, A one stage ahead:
        [G_A]  [G_B | M_A]  [G_A | M_B]  [G_B | M_A]  ...  [G_B]
    a pair [G | M] is cut into windows of one collective each, M into runs of about equal matmul
    FLOPs, one per window (XLA keeps one collective in flight: given two in a window, it hid the
    second and left the first exposed); each window's two parts are fenced (`ring.fence`): their
    inputs released together before, their outputs together after, so the collective can only
    hide behind the other half's matmuls, and those cannot slip elsewhere.

Halves of the sequence (`block.halved`) are not independent: causal attention lets the second
half's queries read the first half's keys, so the lead (A) passes its keys and values to the
trail (B), whose stage that reads them comes after A's that made them (A is a stage ahead); the
backward runs B's pullback ahead, since it makes the cotangents of what A passed (`interleaved`,
`split_layer(..., passes=True)`).

The backward (`split_layer`, a `jax.custom_vjp`) is scheduled the same way from the two halves'
pullbacks, cut at their own collectives: the transposed ones and the gathers that a recompute
policy repeats (a mirror of the forward's windows would put a regather and a reduce-scatter in
one window). Its windows hold twice the matmul work for the same bytes. The values are the
layer's on each half: only the order of the operations and their fences change. Exposed per call
(a layer or a unit of layers, `block.halved`), given enough matmul work: the first window's
collective of the forward and of the backward, `docs/design.md` "Half-batch overlap".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import tree_util
from jax.extend import core        # Var

from mtjax.parallel.jaxpr_walk import (COLLECTIVES, communicates, inline_calls, matmul_flops, multiplies,
                                       run_windows, taint)

__all__ = ["COLLECTIVES", "interleaved", "split_layer"]

def _stages(eqns) -> list[tuple[str, list]]:
    """One half's equations (in program order) as alternating stages: ("G", ...) its collectives
    with the computation between them that has no matmul, ("M", ...) a run between two
    collectives that has one."""
    runs: list[tuple[bool, list]] = []               # (communicates, equations)
    for eqn in eqns:
        talks = communicates(eqn)
        if runs and runs[-1][0] == talks and not talks:
            runs[-1][1].append(eqn)
        else:
            runs.append((talks, [eqn]))
    stages: list[tuple[str, list]] = []
    for talks, run in runs:
        kind = "G" if talks or not any(multiplies(e) for e in run) else "M"
        if stages and stages[-1][0] == kind:
            stages[-1][1].extend(run)
        else:
            stages.append((kind, run))
    for (kind, g), (_, m) in zip(stages, stages[1:]):   # what consumes a G's last collective starts
        talk = [i for i, e in enumerate(g) if communicates(e)] if kind == "G" else []   # the next M
        if talk:
            m[:0], g[talk[-1] + 1:] = g[talk[-1] + 1:], []
    return stages


def _windows(sa, sb) -> list[tuple]:
    """The halves' stages merged: each G of one half with the other half's M (`_paired`); the
    first G of A and the last stage of B alone."""
    out, i, j = [], 0, 0
    while i < len(sa) or j < len(sb):
        a, b = (sa[i] if i < len(sa) else None), (sb[j] if j < len(sb) else None)
        if a is not None and b is not None and a[0] != b[0]:
            g, m = (a, b) if a[0] == "G" else (b, a)
            out.extend(_paired(g[1], m[1]))
            i, j = i + 1, j + 1
        elif a is not None:
            out.append((a[1],))
            i += 1
        else:
            out.append((b[1],))
            j += 1
    return out


def _paired(g: list, m: list) -> list[tuple]:
    """Windows of one collective each: G cut after each of its collectives (what consumes one starts
    the next piece), M cut into as many runs of about equal matmul FLOPs. (XLA keeps one collective in flight: given
    two in a window, its scheduler hid the second behind the matmuls and left the first exposed.)"""
    pieces: list[list] = [[]]
    for eqn in g:
        pieces[-1].append(eqn)
        if communicates(eqn):
            pieces.append([])
    if len(pieces) > 1 and not any(communicates(e) for e in pieces[-1]):
        pieces[-2].extend(pieces.pop())  # matmul-free work after the last one (a final G) stays with it
    total, done, parts = sum(matmul_flops(e) for e in m), 0.0, [[] for _ in pieces]
    for eqn in m:
        k = min(int(done * len(pieces) / total), len(pieces) - 1) if total else 0
        parts[k].append(eqn)
        done += matmul_flops(eqn)
    return [(piece, part) if part else (piece,) for piece, part in zip(pieces, parts)]


def interleaved(first, second, lead, trail, shared):
    """(out_lead, out_trail), out_lead, passed = first(lead, shared) and out_trail = second(trail,
    shared, passed), their stages fenced window by window, the lead one stage ahead (module
    docstring). `shared` (weights, tables) is read by both; `passed` (None for halves of the batch)
    is what the trail reads of the lead's work: the first half's keys and values, which the second
    half of a sequence attends to (`block.halved`). An operation that reads both halves, or only
    what the lead passed, is the trail's; the lead being a stage ahead, what it passes is made in
    the stage of the same index as the trail's that reads it, or an earlier one."""
    flat_l, tree_l = tree_util.tree_flatten(lead)
    flat_t, tree_t = tree_util.tree_flatten(trail)
    flat_s, tree_s = tree_util.tree_flatten(shared)
    n_l, n_t = len(flat_l), len(flat_t)
    trees = []

    def both(*leaves):
        s = tree_util.tree_unflatten(tree_s, leaves[n_l + n_t:])
        out_l, passed = first(tree_util.tree_unflatten(tree_l, leaves[:n_l]), s)
        out_t = second(tree_util.tree_unflatten(tree_t, leaves[n_l:n_l + n_t]), s, passed)
        flat_out, tree_out = tree_util.tree_flatten((out_l, out_t))
        flat_lead = tree_util.tree_leaves((out_l, passed))
        trees.append((tree_out, len(flat_out), len(tree_util.tree_leaves(out_l))))
        return [*flat_out, *flat_lead]             # (the lead's outputs again: what it must compute)

    args = [*flat_l, *flat_t, *flat_s]
    traced = jax.make_jaxpr(both)(*args)
    closed = jax.make_jaxpr(lambda *a: inline_calls(traced.jaxpr, traced.consts, *a))(*args)
    jaxpr, marks = closed.jaxpr, taint(closed.jaxpr, n_l, n_t)
    tree_out, n_out, n_lead = trees[0]
    parts = _parts(jaxpr, marks, jaxpr.outvars[n_out:], mixing=len(jaxpr.outvars) > n_out + n_lead)
    windows = [(parts[""],)] + _windows(_stages(parts["A"]), _stages(parts["B"]))
    halves = {v for v, m in marks.items() if m}
    flat = run_windows(jaxpr, closed.consts, args, halves, windows)
    return tree_util.tree_unflatten(tree_out, flat[:n_out])


def _parts(jaxpr, marks: dict, lead_outs, mixing: bool) -> dict[str, list]:
    """The equations as "" (of neither half: run first), "A" (the lead's) and "B" (the trail's).
    An operation that reads the trail's values is the trail's; one that reads only the lead's is
    the lead's, but for the trail's own work on what the lead passed: what the trail's outputs
    need and the lead's outputs (`lead_outs`: its results and what it passes) do not. Without
    anything passed (`mixing` False) no operation may read both halves."""
    for_lead, for_any = _needed(jaxpr, lead_outs), _needed(jaxpr, jaxpr.outvars) if mixing else set()
    parts = {"": [], "A": [], "B": []}
    for eqn in jaxpr.eqns:
        got = frozenset().union(*(marks.get(v, frozenset()) for v in eqn.invars if isinstance(v, core.Var)))
        if len(got) > 1 and not mixing:
            raise ValueError(f"half_batches: an operation ({eqn.primitive.name}) mixes the two halves")
        trails = "B" in got or bool(got and id(eqn) in for_any and id(eqn) not in for_lead)
        parts["B" if trails else "A" if got else ""].append(eqn)
    return parts


def _needed(jaxpr, outs) -> set[int]:
    """ids of the equations that `outs` depend on."""
    needed, wanted = set(), {v for v in outs if isinstance(v, core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in wanted for v in eqn.outvars):
            needed.add(id(eqn))
            wanted.update(v for v in eqn.invars if isinstance(v, core.Var))
    return needed


def split_layer(layer, passes: bool = False):
    """layer(x, rest, shared, passed) -> (y, passes), run on two halves: paired((x_a, rest_a),
    (x_b, rest_b), shared) -> (y_a, y_b), differentiable in x and `shared`. With `passes` the
    second half's layer reads what the first's passes (`interleaved`; None otherwise, and the first
    half's passes are dropped), and the backward runs the second half's pullback ahead (it makes
    the cotangent of what was passed, which the first half's pullback reads). Forward and backward
    are each `interleaved`: the backward's stages are cut at its own collectives (the transposed
    ones, and the gathers a recompute policy repeats), not only mirrored from the forward's."""
    @jax.custom_vjp
    def paired(a, b, shared):
        return interleaved(lambda half, s: layer(*half, s, None),
                           lambda half, s, passed: layer(*half, s, passed)[0], a, b, shared)

    def first(half, s):
        x, rest = half
        if not passes:
            y, pull = jax.vjp(lambda x, s: layer(x, rest, s, None)[0], x, s)
            return (y, pull), None
        (y, passed), pull = jax.vjp(lambda x, s: layer(x, rest, s, None), x, s)
        return (y, pull), passed

    def second(half, s, passed):
        x, rest = half
        if not passes:
            return jax.vjp(lambda x, s: layer(x, rest, s, None)[0], x, s)
        return jax.vjp(lambda x, s, p: layer(x, rest, s, p)[0], x, s, passed)

    def forward(a, b, shared):
        (ya, pull_a), (yb, pull_b) = interleaved(first, second, a, b, shared)
        leaves_a, tree_a = tree_util.tree_flatten(pull_a)
        leaves_b, tree_b = tree_util.tree_flatten(pull_b)
        kept, how = _keep(leaves_a, leaves_b)
        return (ya, yb), (kept, _Static((tree_a, tree_b, how)))

    def backward(res, dys):
        kept, static = res
        tree_a, tree_b, how = static.value
        leaves_a, leaves_b = _unkeep(kept, how)
        pull_a, pull_b = tree_util.tree_unflatten(tree_a, leaves_a), tree_util.tree_unflatten(tree_b, leaves_b)
        if not passes:
            (dxa, dsa), (dxb, dsb) = interleaved(lambda half, _: (half[0](half[1]), None),
                                                 lambda half, _, __: half[0](half[1]),
                                                 (pull_a, dys[0]), (pull_b, dys[1]), ())
        else:       # B's pullback ahead: it makes the cotangent of what A passed
            (dxb, dsb), (dxa, dsa) = interleaved(lambda half, _: _pull_passing(*half),
                                                 lambda half, _, d_passed: half[0]((half[1], d_passed)),
                                                 (pull_b, dys[1]), (pull_a, dys[0]), ())
        return (dxa, None), (dxb, None), jax.tree.map(jnp.add, dsa, dsb)

    paired.defvjp(forward, backward)
    return paired


def _keep(leaves_a, leaves_b) -> tuple[list, tuple]:
    """The two halves' residuals as the stash keeps them: a pair at one index as one [2, ...] array
    where their shapes agree (one stash row write and read, not two: every pair, when the halves
    are the batch's), what both hold (the weights) once, any other alone. -> (kept, how)."""
    kept, how = [], []
    for i in range(max(len(leaves_a), len(leaves_b))):
        la, lb = (leaves_a[i] if i < len(leaves_a) else None), (leaves_b[i] if i < len(leaves_b) else None)
        if la is not None and la is lb:
            kept.append(la)
            how.append("once")
        elif la is not None and lb is not None and (la.shape, la.dtype) == (lb.shape, lb.dtype):
            kept.append(jnp.stack([la, lb]))
            how.append("stacked")
        else:
            kept.append((la, lb))
            how.append(("apart", la is not None, lb is not None))
    return kept, tuple(how)


def _unkeep(kept, how) -> tuple[list, list]:
    """`_keep`'s inverse: (the first half's residuals, the second's)."""
    leaves_a, leaves_b = [], []
    for k, h in zip(kept, how, strict=True):
        if h == "once":
            leaves_a.append(k)
            leaves_b.append(k)
        elif h == "stacked":
            leaves_a.append(k[0])
            leaves_b.append(k[1])
        else:
            leaves_a.extend(k[:1] if h[1] else [])
            leaves_b.extend(k[1:] if h[2] else [])
    return leaves_a, leaves_b


def _pull_passing(pull, dy):
    """The second half's pullback: ((dx, d_shared), d_passed)."""
    dx, ds, d_passed = pull(dy)
    return (dx, ds), d_passed


class _Static:
    """A value carried through a custom_vjp's residuals as static data (no leaves)."""
    def __init__(self, value):
        self.value = value


tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda value, _: _Static(value))


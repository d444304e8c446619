"""Two halves of a micro-batch through one layer, each half's collectives hidden behind the other
half's matmuls (batch-split overlap, as in Domino, Wang et al. 2024; DeepSeek-V3 overlaps two
micro-batches the same way).

Shape legend: b micro-batch, s sequence, h hidden, t tensor size; a half is [b/2, ...].

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

The backward (`split_layer`, a `jax.custom_vjp`) is scheduled the same way from the two halves'
pullbacks, cut at their own collectives: the transposed ones and the gathers that a recompute
policy repeats (a mirror of the forward's windows would put a regather and a reduce-scatter in
one window). Its windows hold twice the matmul work for the same bytes. The values are the
layer's on each half: only the order of the operations and their fences change. Exposed per call
(a layer or a unit of layers, `block.halved`), given enough matmul work: the first window's
collective of the forward and of the backward, `docs/design.md` "Half-batch overlap".
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util
from jax.extend import core        # Literal, Var, ClosedJaxpr, jaxprs_in_params

from mtjax.parallel.ring import fence

# primitives that move data between devices (inside `shard_map`)
COLLECTIVES = frozenset({"all_gather", "all_gather_invariant", "reduce_scatter", "psum", "psum_invariant", "pmax",
                         "pmin", "ppermute", "all_to_all", "ragged_all_to_all"})
# calls whose equations are inlined when they communicate: jitted calls, and the checkpoint that
# a layer's recompute policy puts around its pullback (all of a backward is inside it)
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat2"})


def _any_eqn(eqn, test) -> bool:
    """test(e) for eqn or an equation of any jaxpr nested in it."""
    return test(eqn) or any(_any_eqn(e, test) for j in core.jaxprs_in_params(eqn.params) for e in j.eqns)


def communicates(eqn) -> bool:
    return _any_eqn(eqn, lambda e: e.primitive.name in COLLECTIVES)


def multiplies(eqn) -> bool:
    """eqn is or holds a matmul (a dot, or a fused attention kernel: `_flops`)."""
    return _flops(eqn) > 0


def _read(env, v):
    return v.val if isinstance(v, core.Literal) else env[v]


def _bind(eqn, env):
    """eqn evaluated on env's values, its outputs written to env (as `core.eval_jaxpr`)."""
    ctx = getattr(eqn, "ctx", None)       # the equation's own context (as `jax.core.eval_jaxpr`)
    with (ctx.manager if ctx is not None else contextlib.nullcontext()):
        out = eqn.primitive.bind(*(_read(env, v) for v in eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
    for var, val in zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]):
        env[var] = val


def _inline(jaxpr, consts, *args):
    """jaxpr evaluated with its jitted calls that communicate inlined (their collectives become
    this jaxpr's own equations, so the stages can be cut at them)."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if eqn.primitive.name in _CALLS and communicates(eqn):
            inner = inner if isinstance(inner, core.ClosedJaxpr) else core.ClosedJaxpr(inner, ())
            for var, val in zip(eqn.outvars, _inline(inner.jaxpr, inner.consts, *(_read(env, v) for v in eqn.invars))):
                env[var] = val
        else:
            _bind(eqn, env)
    return [_read(env, v) for v in jaxpr.outvars]


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
    total, done, parts = sum(_flops(e) for e in m), 0.0, [[] for _ in pieces]
    for eqn in m:
        k = min(int(done * len(pieces) / total), len(pieces) - 1) if total else 0
        parts[k].append(eqn)
        done += _flops(eqn)
    return [(piece, part) if part else (piece,) for piece, part in zip(pieces, parts)]


def _flops(eqn) -> float:
    """The matmul FLOPs of eqn and the jaxprs nested in it (loops counted once); a fused attention
    kernel (cuDNN's, `model/core_attention.py`) as its two products, 4 b s_q s_k n d (halved when
    causal), and its backward as 2.5 times that (five products)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        k = np.prod([eqn.invars[0].aval.shape[d] for d in contract]) if contract else 1
        return 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * float(k)
    if name.startswith("dot_product_attention_"):             # q [b, s_q, n, d], k [b, s_k, k, d]
        q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
        fwd = 4.0 * float(np.prod(q)) * k[1] * (0.5 if "CAUSAL" in str(eqn.params.get("mask_type")) else 1.0)
        return fwd * (2.5 if "bwd" in name else 1.0)
    return sum(_flops(e) for j in core.jaxprs_in_params(eqn.params) for e in j.eqns)


def _fenceable(val) -> bool:
    dtype = getattr(val, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _vars_in(eqns) -> list:
    defined = {v for e in eqns for v in e.outvars}
    seen, out = set(), []
    for e in eqns:
        for v in e.invars:
            if isinstance(v, core.Var) and v not in defined and v not in seen:
                seen.add(v)
                out.append(v)
    return out


def _run_windows(jaxpr, consts, args, halves: set, windows):
    """jaxpr evaluated window by window; a window of two parts is fenced on its inputs and its
    outputs that belong to a half (the weights and what is made from them alone stay unfenced: a
    fenced copy of a weight would be a new residual)."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    later: list[set] = [set(jaxpr.outvars) - {None}]
    for window in reversed(windows[1:]):
        later.insert(0, later[0] | {v for part in window for e in part for v in e.invars if isinstance(v, core.Var)})
    for window, used_after in zip(windows, later):
        eqns = [e for part in window for e in part]
        if len(window) == 2:
            _fence(env, [v for v in _vars_in(eqns) if v in halves])
        for eqn in eqns:
            _bind(eqn, env)
        if len(window) == 2:
            _fence(env, [v for e in eqns for v in e.outvars if v in used_after and v in halves])
    return [_read(env, v) for v in jaxpr.outvars]


def _fence(env, variables):
    variables = [v for v in variables if _fenceable(env[v])]
    if variables:
        for var, val in zip(variables, fence(*(env[v] for v in variables))):
            env[var] = val


def _taint(jaxpr, n_a: int, n_b: int) -> dict:
    """var -> frozenset of the halves ("A", "B") it depends on."""
    marks = {v: frozenset("A") for v in jaxpr.invars[:n_a]} | {v: frozenset("B") for v in jaxpr.invars[n_a:n_a + n_b]}
    for eqn in jaxpr.eqns:
        got = frozenset().union(*(marks.get(v, frozenset()) for v in eqn.invars if isinstance(v, core.Var)))
        for v in eqn.outvars:
            marks[v] = got
    return marks


def interleaved(fn, half_a, half_b, shared):
    """(fn(half_a, shared), fn(half_b, shared)), their stages fenced window by window (module
    docstring). The halves are pytrees with the same number of leaves; `shared` (weights, tables)
    is used by both."""
    flat_a, tree_a = tree_util.tree_flatten(half_a)
    flat_b, tree_b = tree_util.tree_flatten(half_b)
    flat_s, tree_s = tree_util.tree_flatten(shared)
    n_a, n_b = len(flat_a), len(flat_b)
    out_tree = []

    def both(*leaves):
        s = tree_util.tree_unflatten(tree_s, leaves[n_a + n_b:])
        outs = (fn(tree_util.tree_unflatten(tree_a, leaves[:n_a]), s),
                fn(tree_util.tree_unflatten(tree_b, leaves[n_a:n_a + n_b]), s))
        flat, treedef = tree_util.tree_flatten(outs)
        out_tree.append(treedef)
        return flat

    args = [*flat_a, *flat_b, *flat_s]
    traced = jax.make_jaxpr(both)(*args)
    closed = jax.make_jaxpr(lambda *a: _inline(traced.jaxpr, traced.consts, *a))(*args)
    jaxpr, marks = closed.jaxpr, _taint(closed.jaxpr, n_a, n_b)
    parts = {"": [], "A": [], "B": []}
    for eqn in jaxpr.eqns:
        got = frozenset().union(*(marks.get(v, frozenset()) for v in eqn.invars if isinstance(v, core.Var)))
        if len(got) > 1:
            raise ValueError(f"half_batches: an operation ({eqn.primitive.name}) mixes the two halves")
        parts["".join(got)].append(eqn)
    windows = [(parts[""],)] + _windows(_stages(parts["A"]), _stages(parts["B"]))
    halves = {v for v, m in marks.items() if m}
    flat = _run_windows(jaxpr, closed.consts, args, halves, windows)
    return tree_util.tree_unflatten(out_tree[0], flat)


def split_layer(layer):
    """layer(x, rest, shared) -> y, run on two halves: paired((x_a, rest_a), (x_b, rest_b), shared)
    -> (y_a, y_b), differentiable in x and `shared`. Forward and backward are each `interleaved`:
    the backward's stages are cut at its own collectives (the transposed ones, and the gathers
    a recompute policy repeats), not only mirrored from the forward's."""
    @jax.custom_vjp
    def paired(a, b, shared):
        return interleaved(lambda half, shared: layer(*half, shared), a, b, shared)

    def forward(a, b, shared):
        def with_pullback(half, shared):
            x, rest = half
            return jax.vjp(lambda x, shared: layer(x, rest, shared), x, shared)
        (ya, pull_a), (yb, pull_b) = interleaved(with_pullback, a, b, shared)
        leaves_a, tree_a = tree_util.tree_flatten(pull_a)
        leaves_b, tree_b = tree_util.tree_flatten(pull_b)
        # each residual of the halves as one [2, ...] array (one stash row write and read, not two);
        # what both pullbacks hold (the weights) once
        kept = [la if la is lb else jnp.stack([la, lb]) for la, lb in zip(leaves_a, leaves_b)]
        shared_leaf = tuple(la is lb for la, lb in zip(leaves_a, leaves_b))
        return (ya, yb), (kept, _Static((tree_a, tree_b, shared_leaf)))

    def backward(res, dys):
        kept, static = res
        tree_a, tree_b, shared_leaf = static.value
        pull_a = tree_util.tree_unflatten(tree_a, [k if s else k[0] for k, s in zip(kept, shared_leaf)])
        pull_b = tree_util.tree_unflatten(tree_b, [k if s else k[1] for k, s in zip(kept, shared_leaf)])
        (dxa, dsa), (dxb, dsb) = interleaved(lambda half, _: half[0](half[1]), (pull_a, dys[0]), (pull_b, dys[1]), ())
        return (dxa, None), (dxb, None), jax.tree.map(jnp.add, dsa, dsb)

    paired.defvjp(forward, backward)
    return paired


class _Static:
    """A value carried through a custom_vjp's residuals as static data (no leaves)."""
    def __init__(self, value):
        self.value = value


tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda value, _: _Static(value))

"""Reading and running a traced layer equation by equation (for `half_batches.py`): which
equations communicate or multiply, their matmul FLOPs, which inputs they depend on, and a jaxpr
evaluated with its communicating calls inlined, so that a schedule can be cut at their collectives,
then run window by window with fences.
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.extend import core        # Literal, Var, ClosedJaxpr, jaxprs_in_params

from mtjax.parallel.ring import fence

# primitives that move data between devices (inside `shard_map`)
COLLECTIVES = frozenset({"all_gather", "all_gather_invariant", "reduce_scatter", "psum", "psum_invariant", "pmax",
                         "pmin", "ppermute", "all_to_all", "ragged_all_to_all"})
# calls whose equations are inlined when they communicate: jitted calls, and the checkpoint that
# a layer's recompute policy puts around its pullback (all of a backward is inside it)
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat2"})


def any_eqn(eqn, test) -> bool:
    """test(e) for eqn or an equation of any jaxpr nested in it."""
    return test(eqn) or any(any_eqn(e, test) for j in core.jaxprs_in_params(eqn.params) for e in j.eqns)


def communicates(eqn) -> bool:
    return any_eqn(eqn, lambda e: e.primitive.name in COLLECTIVES)


def multiplies(eqn) -> bool:
    """eqn is or holds a matmul (a dot, or a fused attention kernel: `_flops`)."""
    return matmul_flops(eqn) > 0


def read(env, v):
    return v.val if isinstance(v, core.Literal) else env[v]


def bind(eqn, env):
    """eqn evaluated on env's values, its outputs written to env (as `core.eval_jaxpr`)."""
    ctx = getattr(eqn, "ctx", None)       # the equation's own context (as `jax.core.eval_jaxpr`)
    with (ctx.manager if ctx is not None else contextlib.nullcontext()):
        out = eqn.primitive.bind(*(read(env, v) for v in eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
    for var, val in zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]):
        env[var] = val


def inline_calls(jaxpr, consts, *args):
    """jaxpr evaluated with its jitted calls that communicate inlined (their collectives become
    this jaxpr's own equations, so the stages can be cut at them)."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if eqn.primitive.name in _CALLS and communicates(eqn):
            inner = inner if isinstance(inner, core.ClosedJaxpr) else core.ClosedJaxpr(inner, ())
            for var, val in zip(eqn.outvars, inline_calls(inner.jaxpr, inner.consts, *(read(env, v) for v in eqn.invars))):
                env[var] = val
        else:
            bind(eqn, env)
    return [read(env, v) for v in jaxpr.outvars]


def matmul_flops(eqn) -> float:
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
    return sum(matmul_flops(e) for j in core.jaxprs_in_params(eqn.params) for e in j.eqns)


def free_vars(eqns) -> list:
    defined = {v for e in eqns for v in e.outvars}
    seen, out = set(), []
    for e in eqns:
        for v in e.invars:
            if isinstance(v, core.Var) and v not in defined and v not in seen:
                seen.add(v)
                out.append(v)
    return out


def taint(jaxpr, n_a: int, n_b: int) -> dict:
    """var -> frozenset of the halves ("A", "B") it depends on."""
    marks = {v: frozenset("A") for v in jaxpr.invars[:n_a]} | {v: frozenset("B") for v in jaxpr.invars[n_a:n_a + n_b]}
    for eqn in jaxpr.eqns:
        got = frozenset().union(*(marks.get(v, frozenset()) for v in eqn.invars if isinstance(v, core.Var)))
        for v in eqn.outvars:
            marks[v] = got
    return marks


def _fenceable(val) -> bool:
    dtype = getattr(val, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def run_windows(jaxpr, consts, args, halves: set, windows):
    """jaxpr evaluated window by window; a window of two parts is fenced on its inputs and its
    outputs that belong to a half (the weights and what is made from them alone stay unfenced: a
    fenced copy of a weight would be a new residual). The jaxpr's own inputs are not fenced either:
    they are ready before the first window, and a fenced stash row (a backward's residual) is a
    copy, where unfenced XLA:GPU reads it inside the GEMM that uses it (13B, t 8, b 2, predicted:
    710.8 -> 695.2 ms; the outputs' fences stay: without them 720.2 ms, 47 ms exposed)."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    given = set(jaxpr.invars)
    later: list[set] = [set(jaxpr.outvars) - {None}]
    for window in reversed(windows[1:]):
        later.insert(0, later[0] | {v for part in window for e in part for v in e.invars if isinstance(v, core.Var)})
    for window, used_after in zip(windows, later):
        eqns = [e for part in window for e in part]
        if len(window) == 2:
            fence_vars(env, [v for v in free_vars(eqns) if v in halves and v not in given])
        for eqn in eqns:
            bind(eqn, env)
        if len(window) == 2:
            fence_vars(env, [v for e in eqns for v in e.outvars if v in used_after and v in halves])
    return [read(env, v) for v in jaxpr.outvars]


def fence_vars(env, variables):
    variables = [v for v in variables if _fenceable(env[v])]
    if variables:
        for var, val in zip(variables, fence(*(env[v] for v in variables))):
            env[var] = val

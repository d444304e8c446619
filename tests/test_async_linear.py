"""The sequence-parallel column layers' gathered matmul (`mtjax/parallel/async_linear.py`).

- Values and every gradient equal the plain composition it replaces (all-gather along s, then one
  einsum per kernel, autodiff's backward) on a 4-rank `tensor` mesh, fp32 and bf16; the tapped
  form hands W the (X, dY) whose X^T dY is the plain dA.
- The backward's structure, from its jaxpr: two fences, the regather with the one dgrad matmul
  (the kernels' columns joined: a single product of the gathered shape), then the reduce-scatter
  with the one wgrad matmul (over the same joined columns). (The model-level equality of every sequence-parallel layout against
  tests/reference.py runs through it: test_equivalence, test_pipeline, test_context_parallel, ...)
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mtjax.mesh import TENSOR
from mtjax.parallel import tensor_ops
from mtjax.parallel.async_linear import gather_matmul
from test_equivalence import relative

T, B, S, H = 4, 2, 8, 6
SHAPES = [(B, S, H), (H, 2 * T, 3), (H, 5)]          # x, a split kernel [h, a, d], a replicated one [h, k]


def _net(fused: bool):
    """x [b, s/t, h] -> the two column layers' outputs over the whole sequence, [s, b, ...]."""
    def f(x, wq, wk):
        if fused:
            return gather_matmul(x, [wq, wk])
        xf = jnp.swapaxes(tensor_ops.gather_from_sequence_region(x, T), 0, 1)   # [s, b, h]
        return jnp.einsum("sbh,had->sbad", xf, wq), jnp.einsum("sbh,hk->sbk", xf, wk)
    return f


def _args(dtype, seed=0):
    rng = np.random.RandomState(seed)
    return [jnp.asarray(rng.randn(*shape), dtype) for shape in SHAPES]


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_gathered_matmul_matches_gather_then_einsums(dtype, tol):
    mesh = Mesh(np.array(jax.devices()[:T]), (TENSOR,))
    args = _args(dtype)
    specs = (P(None, TENSOR), P(None, TENSOR), P())
    out_specs = (P(None, None, TENSOR), P())

    def run(fused):
        f = jax.shard_map(_net(fused), mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)

        def loss(*a):
            q, k = f(*a)
            return jnp.sum(jnp.sin(q.astype(jnp.float32))) + jnp.sum(jnp.cos(k.astype(jnp.float32)) * k)
        return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1, 2))(*a)))(*args)

    (ys, grads), (ys_ref, grads_ref) = run(True), run(False)
    f32 = lambda a: a.astype(jnp.float32)                                   # noqa: E731
    for y, y_ref in zip(ys, ys_ref):
        assert y.dtype == dtype and relative(f32(y), f32(y_ref)) < tol
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == dtype and relative(f32(g), f32(g_ref)) < tol


def test_tapped_form_hands_W_what_the_plain_backward_computes():
    mesh = Mesh(np.array(jax.devices()[:T]), (TENSOR,))
    x, wq, wk = _args(jnp.float32, 1)
    wq = wq[:, :2]                                                          # one rank's columns
    dq = jnp.asarray(np.random.RandomState(2).randn(S, B, 2, 3), jnp.float32)
    dk = jnp.asarray(np.random.RandomState(3).randn(S, B, 5), jnp.float32)

    def per_rank(x, wq, wk, dq, dk):
        _, pull = jax.vjp(lambda *a: gather_matmul(*a[:1], a[1:]), x, wq, wk)
        plain = pull((dq, dk))
        zeros = lambda *shape: jnp.zeros(shape, jnp.float32)              # noqa: E731
        taps = [(zeros(S, B, H), zeros(S, B, 2, 3)), (zeros(S, B, H), zeros(S, B, 5))]
        _, pull = jax.vjp(lambda x, wq, wk, taps: gather_matmul(x, [wq, wk], taps), x, wq, wk, taps)
        dx, dwq, dwk, tap_grads = pull((dq, dk))
        w_grads = [jnp.tensordot(xt, dyt, axes=([0, 1], [0, 1])) for xt, dyt in tap_grads]
        return [a[None] for a in [plain[0], dx, *plain[1:], *w_grads, dwq, dwk]]

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=(P(None, TENSOR), P(), P(), P(), P()),
                      out_specs=P(TENSOR), check_vma=False)
    dx_plain, dx, *rest = jax.jit(f)(x, wq, wk, dq, dk)
    assert relative(dx, dx_plain) < 1e-6
    for w_grad, plain in zip(rest[2:4], rest[:2]):
        assert relative(w_grad, plain) < 1e-6
    assert all(float(jnp.abs(d).max()) == 0 for d in rest[4:])


def _eqns(jaxpr):
    """Every equation, nested jaxprs (custom_vjp bodies, shard_map, pjit) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_backward_fences_each_collective_with_the_matmul_that_does_not_need_it():
    mesh = Mesh(np.array(jax.devices()[:T]), (TENSOR,))
    args = _args(jnp.float32)
    f = jax.shard_map(_net(True), mesh=mesh, in_specs=(P(None, TENSOR), P(None, TENSOR), P()),
                      out_specs=(P(None, None, TENSOR), P()), check_vma=False)
    loss = lambda *a: sum(jnp.sum(jnp.sin(y)) for y in f(*a))              # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args).jaxpr
    eqns = list(_eqns(jaxpr))
    producer = {id(v): e for e in eqns for v in e.outvars}
    fences = [e for e in eqns if e.primitive.name == "optimization_barrier"]
    assert len(fences) == 2, [e.primitive.name for e in fences]

    def origin(v):      # through the reshapes, transposes and casts around a product
        e = producer.get(id(v))
        while e is not None and e.primitive.name in ("reshape", "transpose", "convert_element_type"):
            e = producer.get(id(e.invars[0]))
        return e.primitive.name if e is not None else None

    def made_by(fence):
        return {origin(v) for v in fence.invars}
    regather, scatter = fences
    assert {"all_gather", "dot_general"} <= made_by(regather)
    assert {"reduce_scatter", "dot_general"} <= made_by(scatter)
    # the two kernels sharing X are one matmul in each phase: one dgrad shaped like the gathered X,
    # and one wgrad over their joined columns, which rides with the reduce-scatter
    gathered = (S, B, H)
    dgrads = [e for e in eqns if e.primitive.name == "dot_general" and e.outvars[0].aval.shape == gathered]
    assert len(dgrads) == 1
    joined = (H, 2 * 3 + 5)
    wgrads = [e for e in eqns if e.primitive.name == "dot_general" and e.outvars[0].aval.shape == joined]
    assert len(wgrads) == 1
    assert joined in {tuple(v.aval.shape) for v in scatter.invars}

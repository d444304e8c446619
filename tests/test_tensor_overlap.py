"""Tensor-parallel overlap (`parallel.tensor_overlap`, `mtjax/parallel/collective_matmul.py`).

- The operators against the collectives they replace (gather then matmul; matmul then
  reduce-scatter), forward and backward, on a 4-rank `tensor` mesh, fp32 and bf16: no step compiles.
- Equality with one device (tests/reference.py, fp32, 1e-5): logits, loss, every gradient leaf,
  one AdamW step, at tensor 2 and 4 with sequence parallelism, GPT and Llama (k = 2 < t = 4:
  replicated kv heads), pipe 2 with the split backward (zb: W's matmuls), data 2 with ZeRO-1.
- The compiled step: no all-gather or reduce-scatter over `tensor` is left in the layer scan, and
  the collective-permutes move the bytes of those they replace (docs/design.md, "Tensor-parallel
  overlap").
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import reference
from layouts import VOCAB, ZERO_GRADIENT, build, leaf_errors, random_batch, tiny_config
from mtjax.mesh import TENSOR
from mtjax.parallel import tensor_ops
from mtjax.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from test_equivalence import reference_adamw_step, relative

TOL = 1e-5
OVERLAP = "parallel.tensor_overlap=true"


# ---------------------------------------------------------------- the operators alone
def _sublayer(overlap: bool, t: int):
    """Column (a split kernel and a replicated one, sharing X) -> tanh -> row, on [b, s/t, h]."""
    def f(x, wq, wk, wo):
        if overlap:
            q, k = all_gather_matmul(x, [wq, wk], t)
        else:
            xf = tensor_ops.gather_from_sequence_region(x, t)
            q, k = jnp.einsum("bsh,had->bsad", xf, wq), jnp.einsum("bsh,hk->bsk", xf, wk)
        z = jnp.tanh(q * k[..., :1, None])                                   # [b, s, a/t, d]
        if overlap:
            return matmul_reduce_scatter(z, wo, t)
        return tensor_ops.reduce_scatter_to_sequence_region(jnp.einsum("bsad,adh->bsh", z, wo), t)
    return f


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_operators_match_the_collectives_they_replace(dtype, tol):
    t, b, s, h = 4, 2, 8, 6
    mesh = Mesh(np.array(jax.devices()[:t]), (TENSOR,))
    rng = np.random.RandomState(0)
    args = [jnp.asarray(rng.randn(*shape), dtype) for shape in [(b, s, h), (h, 2 * t, 3), (h, 5), (2 * t, 3, h)]]
    specs = (P(None, TENSOR), P(None, TENSOR), P(), P(TENSOR))
    weights = jnp.cos(jnp.arange(b * s * h)).reshape(b, s, h)

    def run(overlap):
        f = jax.shard_map(_sublayer(overlap, t), mesh=mesh, in_specs=specs, out_specs=P(None, TENSOR),
                          check_vma=False)
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * weights)      # noqa: E731
        return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(*args)

    (y, grads), (y_ref, grads_ref) = run(True), run(False)
    assert y.dtype == dtype and all(g.dtype == dtype for g in grads)
    f32 = lambda a: a.astype(jnp.float32)                                   # noqa: E731
    assert relative(f32(y), f32(y_ref)) < tol
    for g, g_ref in zip(grads, grads_ref):
        assert relative(f32(g), f32(g_ref)) < tol


# ---------------------------------------------------------------- equality with one device
CASES = [  # (arch, data, pipe, tensor, extra)
    ("gpt", 1, 1, 2, []),
    ("llama", 1, 1, 2, []),
    ("gpt", 1, 1, 4, []),
    ("llama", 1, 1, 4, []),                                     # k = 2 < t = 4: replicated kv heads
    ("llama", 1, 2, 2, ["parallel.schedule=zb"]),               # split backward: W from the taps
    ("gpt", 2, 1, 2, ["parallel.distributed_optimizer=true"]),
]


@pytest.mark.parametrize("arch,data,pipe,tensor,extra", CASES,
                         ids=[f"{c[0]}-d{c[1]}p{c[2]}t{c[3]}{'-' + c[4][0].split('.')[1] if c[4] else ''}" for c in CASES])
def test_overlap_matches_reference(arch, data, pipe, tensor, extra):
    cfg = tiny_config(arch, tensor, pipe, data, True, micro_batch=1, extra=[OVERLAP, *extra])
    trainer = build(cfg, data, pipe, tensor)
    state = trainer.init_state()
    batch = random_batch()
    params = jax.device_get(state.params)

    logits = trainer.logits_fn(state.params, trainer.put_batch(batch[:, :-1]))
    assert relative(logits, reference.logits(params, batch[:, :-1], cfg.model, VOCAB)) < TOL

    grads, loss = trainer.grad_fn(state.params, trainer.put_batch(batch), state.rng)
    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < TOL
    errs = leaf_errors(jax.device_get(grads), ref_grads, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}

    new_state, metrics = trainer.train_step(state, trainer.put_batch(batch))
    errs = leaf_errors(jax.device_get(new_state.params), reference_adamw_step(cfg, params, ref_grads),
                       skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
    assert abs(float(metrics["loss"]) - float(ref_loss)) / float(ref_loss) < TOL

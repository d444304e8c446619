"""Context parallelism's attention cores (all_gather, ring) against one device's einsum attention:
outputs and the gradients of sum(O * T) w.r.t. Q, K, V (T a random cotangent) at fp32, and the
collectives their compiled programs hold."""
import re
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mtjax.hlo_report.collectives import collective_report
from mtjax.mesh import CONTEXT, make_mesh
from mtjax.model.context_attention import all_gather_attention, ring_attention
from mtjax.model.core_attention import einsum_attention
from mtjax.model.recompute import saving_inputs_only
from mtjax.parallel.context_ops import chunk_positions

B, S, KV, D = 2, 16, 2, 8
CORES = {"ring": lambda q, k, v, c: ring_attention(q, k, v, c),
         "gather": lambda q, k, v, c: all_gather_attention(q, k, v, c),
         "gather_dot": lambda q, k, v, c: all_gather_attention(q, k, v, c, kernel="dot_product")}


def inputs(g: int):
    """Q [b, s, k, g, d], K, V [b, s, k, d] and a cotangent T like Q, over the whole sequence."""
    keys = jax.random.split(jax.random.key(g), 4)
    q = jax.random.normal(keys[0], (B, S, KV, g, D))
    k, v = (jax.random.normal(key, (B, S, KV, D)) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape)


def rank_order(c: int):
    """The row permutation that lays the sequence out rank after rank (each rank's two chunks)."""
    return np.concatenate([np.asarray(chunk_positions(S, c, r)) for r in range(c)])


@cache
def sharded(core: str, c: int):
    """The core over `context` = c: Q, K, V [b, s, ...] in rank order -> O [b, s, k, g, d]."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:c], context=c)
    spec = P(None, CONTEXT)
    return jax.shard_map(lambda q, k, v: CORES[core](q, k, v, c), mesh=mesh, in_specs=(spec,) * 3,
                         out_specs=spec, check_vma=False)


def loss_and_grads(fn):
    """(q, k, v, t) -> (O, dQ, dK, dV) of sum(O * t)."""
    def run(q, k, v, t):
        out, pull = jax.vjp(fn, q, k, v)
        return (out, *pull(t))
    return jax.jit(run)


@cache
def reference(g: int):
    return loss_and_grads(einsum_attention)(*inputs(g))


@cache
def distributed(core: str, c: int, g: int):
    """The compiled (O, dQ, dK, dV) of the core over `context` = c on rank-ordered inputs."""
    return loss_and_grads(sharded(core, c)).lower(*inputs(g)).compile()


@pytest.mark.parametrize("core", list(CORES))
@pytest.mark.parametrize("c", [2, 4])
@pytest.mark.parametrize("g", [1, 2])
def test_matches_one_device(core, c, g):
    order = rank_order(c)
    got = distributed(core, c, g)(*(x[:, order] for x in inputs(g)))
    for name, want, have in zip(("out", "dq", "dk", "dv"), reference(g), got):
        np.testing.assert_allclose(have, want[:, order], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("core", ["ring", "gather"])
def test_one_rank_is_the_plain_core(core):
    """c = 1: today's core itself (the same program, no collective)."""
    q, k, v, _ = inputs(2)
    plain = jax.make_jaxpr(einsum_attention)(q, k, v)
    assert str(jax.make_jaxpr(partial(CORES[core], c=1))(q, k, v)) == str(plain)


def kept(fn, c: int = 4, g: int = 2) -> list:
    """The shapes the backward of `fn` keeps, run by c ranks (a vmap over a named `context` axis:
    [c, ...] per tensor), traced only."""
    order = rank_order(c)
    args = [jnp.moveaxis(x[:, order].reshape(B, c, S // c, *x.shape[2:]), 1, 0) for x in inputs(g)[:3]]
    vjp = lambda *a: jax.tree_util.tree_leaves(jax.vjp(jax.vmap(fn, axis_name=CONTEXT), *a)[1])  # noqa: E731
    return sorted(x.shape for x in jax.eval_shape(vjp, *args))


def test_the_backward_keeps_this_ranks_tensors_only():
    """Ring: Q, K, V, O and the fp32 lse of the rank's s/c rows. All-gather under selective
    recomputation (the caller's `saving_inputs_only`): its Q, K, V, not the gathered K, V."""
    c, g, s_l = 4, 2, S // 4
    q, kv, lse = (c, B, s_l, KV, g, D), (c, B, s_l, KV, D), (c, B, s_l, KV, g)
    assert kept(lambda q, k, v: ring_attention(q, k, v, c)) == sorted([q, kv, kv, q, lse])
    for kernel in ("xla", "dot_product"):
        core = saving_inputs_only(partial(all_gather_attention, c=c, kernel=kernel))
        assert kept(core) == sorted([q, kv, kv])
    # the fused route's causal blocks (`gathered_attention`) need no wrapper: the ring's set
    assert kept(partial(all_gather_attention, c=c, kernel="dot_product")) == sorted([q, kv, kv, q, lse])


def collectives(program) -> dict:
    """{kind: count} of the collectives over `context` in a compiled program (c = 4; the
    backward's trivial all-reduces over the mesh's axes of size 1 are not counted)."""
    text = program.as_text()
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:4], context=4)
    return {kind: n["count"] for kind, n in collective_report(text, mesh)["by_axes"].get(CONTEXT, {}).items()}


def forward(core: str, c: int):
    return jax.jit(sharded(core, c)).lower(*inputs(2)[:3]).compile()


def test_ring_passes_kv_around_without_gathering():
    """Forward: c - 1 permutes of the K/V pair, no all-gather. Backward: c - 1 more of K/V (the
    other way round) and c of the dK/dV accumulators (the last one takes them home)."""
    c = 4
    assert collectives(forward("ring", c)) == {"collective-permute": c - 1}
    assert collectives(distributed("ring", c, 2)) == {"collective-permute": 3 * c - 2}


def test_all_gather_gathers_kv_and_reduce_scatters_their_gradients():
    c = 4
    assert collectives(forward("gather", c)) == {"all-gather": 2}
    assert collectives(distributed("gather", c, 2)) == {"all-gather": 2, "reduce-scatter": 2}


CUDNN_MASKS = {"gather": ["CAUSAL"] * 2 + ["NO_MASK"] * 4,    # forward and backward: prefix, diagonal, rest
               "ring": ["CAUSAL"] * 4 + ["NO_MASK"] * 4}      # own step: 3 blocks; the other step: 1 call


@pytest.mark.parametrize("kind", list(CUDNN_MASKS))
def test_cudnn_kernel_is_causal_cudnn_attention_without_a_bias(monkeypatch, kind):
    """kernel "cudnn" (bf16, GQA) exported for a CUDA GPU from this CPU machine, cuDNN's version and
    the GPU's capability stood in for (an H100): cuDNN's fused attention forward and backward with
    no bias (the causal structure as blocks: `gathered_attention`, the ring's steps), the diagonal
    blocks CAUSAL."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    for name, value in (("check_cudnn_version", lambda: 91000), ("check_compute_capability", lambda c: True),
                        ("is_cuda_compute_capability_equal", lambda c: False)):
        if not hasattr(cudnn, name):
            pytest.skip(f"this jax's cuDNN attention has no {name} to stand in for")
        monkeypatch.setattr(cudnn, name, value)
    c = 2
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:c], context=c)
    fn = {"gather": partial(all_gather_attention, kernel="cudnn"), "ring": partial(ring_attention, kernel="cudnn")}[kind]
    core = jax.shard_map(lambda q, k, v: fn(q, k, v, c), mesh=mesh,
                         in_specs=(P(None, CONTEXT),) * 3, out_specs=P(None, CONTEXT), check_vma=False)
    calls = [f"__cudnn$fmhaSoftmax{suffix}" for suffix in ("", "Backward")]
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in calls]
    exported = jax.export.export(loss_and_grads(core), platforms=["cuda"], disabled_checks=checks)
    text = exported(*(jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in inputs(2))).mlir_module()
    assert sorted(set(re.findall(r"custom_call @([\w$]+)", text))) == calls
    masks = re.findall(r"mask_type\\22: \\22(\w+)\\22", text)     # each call's backend config
    assert sorted(masks) == CUDNN_MASKS[kind]

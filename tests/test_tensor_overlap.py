"""Tensor-parallel overlap (`parallel.tensor_overlap`, `mtjax/parallel/collective_matmul.py`).

- The operators against the collectives they replace (gather then matmul; matmul then
  reduce-scatter), forward and backward, on a 4-rank `tensor` mesh, fp32 and bf16: no step compiles.
- Equality with one device (tests/reference.py, fp32, 1e-5): logits, loss, every gradient leaf,
  one AdamW step, at tensor 2 and 4 with sequence parallelism, GPT and Llama (k = 2 < t = 4:
  replicated kv heads), full recomputation with FSDP, data 2 with ZeRO-1 under a 1F1B pipeline,
  and a zb pipeline of 2 stages (MQA, k = 1 < t = 2; the rings inside a stage run as all-to-alls on the CPU,
  `ring.py`); context parallelism in tests/test_context_parallel.py; the split backward's tapped forms are
  also checked alone.
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

from layouts import build, tiny_config
from mtjax.mesh import TENSOR
from mtjax.parallel import tensor_ops
from mtjax.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from test_equivalence import assert_matches_reference, relative

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


def test_tapped_forms_hand_W_what_the_plain_backward_computes():
    """The split backward's forms: the same dX, zero for the kernels, and taps (X, dY) over the whole
    sequence whose X^T dY (W, `taps.local_weight_gradient`) is the plain backward's dA, rank by rank."""
    t, b, s, h = 4, 2, 8, 6
    mesh = Mesh(np.array(jax.devices()[:t]), (TENSOR,))
    rng = np.random.RandomState(1)
    x, wq, wk, wo = [jnp.asarray(rng.randn(*shape), jnp.float32)
                     for shape in [(b, s, h), (h, 2, 3), (h, 5), (2, 3, h)]]   # kernels: one rank's
    dy = jnp.asarray(rng.randn(b, s, h), jnp.float32)

    def per_rank(x, wq, wk, wo, dy):
        def net(x, wq, wk, wo, tap_q, tap_k, tap_o):
            taps = None if tap_q is None else [tap_q, tap_k]
            q, k = all_gather_matmul(x, [wq, wk], t, taps)
            z = jnp.tanh(q * k[..., :1, None])
            return matmul_reduce_scatter(z, wo, t, tap_o)
        _, pull = jax.vjp(lambda *a: net(*a, None, None, None), x, wq, wk, wo)
        plain = pull(dy)
        zeros = lambda *shape: jnp.zeros(shape, jnp.float32)              # noqa: E731
        taps = (zeros(b, s, h), zeros(b, s, 2, 3)), (zeros(b, s, h), zeros(b, s, 5)), \
            (zeros(b, s, 2, 3), zeros(b, s, h))
        _, pull = jax.vjp(net, x, wq, wk, wo, *taps)
        dx, dwq, dwk, dwo, *tap_grads = pull(dy)
        w_grads = [jnp.tensordot(xt, dyt, axes=([0, 1], [0, 1])) for xt, dyt in tap_grads]
        out = [plain[0], dx, *plain[1:], *w_grads, dwq, dwk, dwo]
        return [a[None] for a in out]                                       # [1, ...]: one row per rank

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=(P(None, TENSOR), P(), P(), P(), P(None, TENSOR)),
                      out_specs=P(TENSOR), check_vma=False)
    dx_plain, dx, *rest = jax.jit(f)(x, wq, wk, wo, dy)
    assert relative(dx, dx_plain) < 1e-6
    for w_grad, plain in zip(rest[3:6], rest[:3]):
        assert relative(w_grad, plain) < 1e-6
    assert all(float(jnp.abs(d).max()) == 0 for d in rest[6:])


# ---------------------------------------------------------------- equality with one device
# Cut: GPT and Llama at t = 2 alone and GPT at t = 4 alone. GPT's layers (its biases, MHA) under
# the overlap run at t = 2 in the recompute=full + FSDP and data 2 + 1F1B cases, Llama's at t = 2
# in the zb case; the rings of 4 ranks are the same operators for either model (the Llama t = 4 case, with the
# harder replicated kv heads).
CASES = [  # (arch, data, pipe, tensor, extra)
    ("llama", 1, 1, 4, []),                                     # k = 2 < t = 4: replicated kv heads
    # the forward's rings run again in the backward; FSDP gathers the layers' weights over data
    ("gpt", 2, 1, 2, ["train.recompute=full", "parallel.fsdp=true"]),
    # data 2 + ZeRO-1 under a 1F1B pipeline of 2 stages
    ("gpt", 2, 2, 2, ["parallel.distributed_optimizer=true", "train.micro_batches=2"]),
    # a pipeline: the rings run inside the stages' conditionals, as all-to-alls on CPU (`ring.py`); zb's W;
    # MQA (k = 1 < t = 2): the ring's taps of the replicated kv head's sliced kernels (`taps.with_place`)
    ("llama", 1, 2, 2, ["parallel.schedule=zb", "train.micro_batches=2", "model.num_kv_heads=1"]),
]


def _case_id(case):
    arch, data, pipe, tensor, extra = case
    return f"{arch}-d{data}p{pipe}t{tensor}" + "".join("-" + e.split(".")[1] for e in extra)


@pytest.mark.parametrize("arch,data,pipe,tensor,extra", CASES, ids=[_case_id(c) for c in CASES])
def test_overlap_matches_reference(arch, data, pipe, tensor, extra):
    micro_batch = None if any(e.startswith("train.micro_batches") for e in extra) else 1    # None: m's b
    cfg = tiny_config(arch, tensor, pipe, data, True, micro_batch=micro_batch, extra=[OVERLAP, *extra])
    trainer = build(cfg, data, pipe, tensor)
    ref_loss, metrics = assert_matches_reference(trainer, cfg)
    assert abs(float(metrics["loss"]) - float(ref_loss)) / float(ref_loss) < TOL

# ---------------------------------------------------------------- the compiled step
MICRO_BATCH = 2      # tiny_config: B = 8, so m = 4 micro-batches; 2 layers


def _layer_collectives(arch, tensor, overlap):
    """{kind: [ops]} over `tensor` inside the layer scan (executed layers x micro-batches times; the
    model ends run once per micro-batch), and the config."""
    from mtjax.hlo_report import collective_report
    from mtjax.inspect import compile_train_step
    cfg = tiny_config(arch, tensor, 1, 1, True, micro_batch=MICRO_BATCH, extra=[OVERLAP] if overlap else [])
    trainer = build(cfg, 1, 1, tensor)
    report = collective_report(compile_train_step(trainer).as_text(), trainer.mesh)
    per_layer = cfg.model.num_layers * cfg.train.global_batch // MICRO_BATCH
    kinds = {}
    for op in report["ops"]:
        if tuple(op["axes"]) == (TENSOR,) and op["multiplicity"] == per_layer:
            kinds.setdefault(op["kind"], []).append(op)
    return kinds, cfg


def _bytes(ops):
    return sum(op["bytes"] for op in ops)


def _chunk_bytes(cfg, tensor):
    """b (s/t) h e: one sequence chunk of the residual stream (fp32)."""
    return MICRO_BATCH * cfg.model.seq_len // tensor * cfg.model.hidden_size * 4


@pytest.mark.parametrize("arch,tensor", [("gpt", 2), ("llama", 4)])
def test_no_sequence_collective_left_in_the_layers_and_permutes_move_the_same_bytes(arch, tensor):
    """docs/design.md, "Tensor-parallel overlap": 10 (t - 1) permutes of b (s/t) h per layer and
    micro-batch, (t - 1)/t of the 6 all-gathers and 4 reduce-scatters of b s h they replace."""
    on, cfg = _layer_collectives(arch, tensor, True)
    assert set(on) == {"collective-permute"}, {k: len(v) for k, v in on.items()}
    permutes = on["collective-permute"]
    assert len(permutes) == 10 * (tensor - 1)
    assert _bytes(permutes) == 10 * (tensor - 1) * _chunk_bytes(cfg, tensor)


def test_the_replaced_collectives_move_what_the_formula_says():
    """Without the flag (gpt, t = 2): 6 all-gathers and 4 reduce-scatters of b s h per layer, no
    permute, so the permutes above move (t - 1)/t of their bytes."""
    off, cfg = _layer_collectives("gpt", 2, False)
    assert {k: len(v) for k, v in off.items()} == {"all-gather": 6, "reduce-scatter": 4}
    full = 2 * _chunk_bytes(cfg, 2)                                          # b s h e
    assert _bytes(off["all-gather"] + off["reduce-scatter"]) == 10 * full
    assert 10 * (2 - 1) * _chunk_bytes(cfg, 2) == (2 - 1) / 2 * 10 * full


def test_the_bound_scripts_ring_passes_are_the_formula():
    """scripts/tp_overlap_bound.py's backward passes (docs/design.md, "What bounds it at t = 2"):
    P = 2 e b s (4h + k_out + k_fc2), by hand for gpt1.3b at (2, 2, 2), b 2, bf16 (218 MB), and
    for a Llama shape at t 4 (k_out = h/t, fc2's k = f/t), at the H100 record's HBM bandwidth."""
    import os
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(repo, "scripts"))
    import tp_overlap_bound
    from mtjax.config import load_config
    from mtjax.hlo_report.hardware import H100
    base = ["parallel.sequence_parallel=true", "train.precision=bf16"]
    gpt = load_config(os.path.join(repo, "configs", "gpt1.3b.yaml"), ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
                                               "train.micro_batch=2", *base])
    r = tp_overlap_bound.bound(gpt, 8)
    assert r["ring_pass_bytes"] == 2 * 2 * 2 * 2048 * (4 * 2048 + 2048 // 2 + 8192 // 2) == 218_103_808
    assert r["ring_pass_s"] == r["ring_pass_bytes"] / H100.memory_bandwidth
    llama = load_config(None, ["model.arch=llama", "model.hidden_size=256", "model.num_heads=8",
                               "model.ffn_hidden_size=704", "model.seq_len=64", "parallel.tensor=4",
                               "train.micro_batch=1", "train.global_batch=2", *base])
    assert tp_overlap_bound.bound(llama, 8)["ring_pass_bytes"] == 2 * 2 * 1 * 64 * (4 * 256 + 64 + 176)
    # the operators' widths: a rank's a/t query heads and its k/t kv heads, or the one it uses
    # when k < t replicates them, of d = kv_channels (here not h/a)
    gqa = load_config(None, ["model.arch=llama", "model.hidden_size=48", "model.num_heads=12", "model.num_kv_heads=2",
                             "model.kv_channels=8", "parallel.tensor=4"])
    widths = tp_overlap_bound.operator_widths(gqa.model, 4)
    assert widths["qkv"] == (48, (3 + 2 * 1) * 8) and widths["out"] == (12 * 8 // 4, 48)
    assert tp_overlap_bound.operator_widths(gqa.model, 2)["qkv"] == (48, (6 + 2 * 1) * 8)

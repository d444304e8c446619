"""The gradient reductions over `tensor` come from the parameters' declarations, and they are right.

The step runs `shard_map` with check_vma=False, so JAX checks nothing about them. The detector
here measures instead: it runs each tensor rank's micro-batch gradient code (the step's own,
before any reduction) and stacks every rank's local gradient of each tensor-replicated leaf.
A leaf applied to identical data on every rank has identical local gradients, and its
declarations must ask for no sum; a leaf applied to different data (sequence-split tokens,
another rank's query heads) has different ones, its declarations must ask for the `psum`, and
the sum over ranks must be the reference gradient (tests/reference.py).
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reference
from layouts import VOCAB, build, random_batch, tiny_config
from mtjax.layout import abstract_params
from mtjax.mesh import DATA, TENSOR
from mtjax.model import norms, transformer
from mtjax.model.transformer import Transformer
from mtjax.parallel import layers
from mtjax.parallel.reductions import ParamBox, tensor_reductions
from mtjax.parallel.vocab import padded_vocab_size
from mtjax.partitioning import rules_for, uses_axis
from mtjax.training.step import _accumulated_grads, local_model

TOL = 1e-5
SPREAD = 1e-4     # relative spread between ranks above which local gradients "differ"
is_spec = lambda x: isinstance(x, P)  # noqa: E731


def by_path(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def local_tensor_grads(trainer, batch):
    """{path: rank r's gradient of the tensor-replicated leaf, stacked [t, *shape]}, as the step's
    micro-batch code computes them before any reduction over `tensor` (data = pipe = 1)."""
    plan, specs = trainer.plan, trainer.param_specs
    assert plan.data == plan.pipe == 1
    model = local_model(trainer.cfg.model, plan, deterministic=True)
    replicated = jax.tree.map(lambda s: not uses_axis(s, TENSOR), specs, is_leaf=is_spec)

    def body(params, batch):
        mbs = batch.reshape(plan.micro_batches, plan.micro_batch, -1)                  # [m, b, s+1]
        keys = jax.random.split(jax.random.key(0), plan.micro_batches)                 # unused: no dropout
        grads, _, _ = _accumulated_grads(model, params, mbs, keys, plan, 1.0)   # data = 1: nothing reduced
        return jax.tree.map(lambda g, r: g[None] if r else jnp.zeros(()), grads, replicated)  # [1, *local]

    out_specs = jax.tree.map(lambda s, r: P(TENSOR, *s) if r else P(), specs, replicated, is_leaf=is_spec)
    fn = jax.jit(jax.shard_map(body, mesh=trainer.mesh, in_specs=(specs, P(DATA, None)), out_specs=out_specs,
                               check_vma=False))
    local = jax.device_get(fn(trainer.init_state().params, trainer.put_batch(batch)))   # [t, *shape] leaves
    return {p: g for p, g in by_path(local).items() if by_path(replicated)[p]}


def contradictions(local, reductions):
    """{path: 'missing' | 'spurious'} where the declared reduction contradicts the ranks: their
    local gradients differ but no sum is declared (each rank keeps a partial sum), or they agree
    but a sum is declared (the gradient would come out t times too large)."""
    declared = by_path(reductions)
    found = {}
    for path, g in local.items():
        spread = float(np.max(np.abs(g - g[:1]))) / max(float(np.max(np.abs(g))), 1e-30)
        if spread > SPREAD and not declared[path]:
            found[path] = "missing"
        elif spread <= SPREAD and declared[path]:
            found[path] = "spurious"
    return found


@functools.cache
def measured(arch, tensor, sp):
    """(trainer, its local replicated-leaf gradients, the reference gradients by path) for one layout."""
    cfg = tiny_config(arch, tensor=tensor, sp=sp, micro_batch=2)
    trainer = build(cfg, 1, 1, tensor)
    batch = random_batch()
    params = jax.device_get(trainer.init_state().params)
    ref = jax.grad(reference.loss)(params, batch, cfg.model, VOCAB)
    return trainer, local_tensor_grads(trainer, batch), by_path(ref)


LAYOUTS = [("gpt", 2, True), ("gpt", 4, False), ("llama", 4, True), ("llama", 2, True)]


@pytest.mark.parametrize("arch,tensor,sp", LAYOUTS)
def test_declared_reductions_match_what_the_ranks_compute(arch, tensor, sp):
    trainer, local, ref = measured(arch, tensor, sp)
    assert contradictions(local, trainer.plan.params.tensor_sums) == {}
    # the reduced gradients (the sum where declared, any rank's where not) are the reference's
    declared = by_path(trainer.plan.params.tensor_sums)
    reduced = {p: g.sum(0) if declared[p] else g[0] for p, g in local.items()}
    errs = {p: np.linalg.norm(g - ref[p]) / np.linalg.norm(ref[p]) for p, g in reduced.items()}
    assert max(errs.values()) < TOL, errs
    assert any(declared.values()) == (sp or arch == "llama" and tensor == 4)
    # and the detector bites the other way: declare a sum everywhere, and exactly the leaves
    # whose ranks agree are flagged (their sums would be t times too large)
    everywhere = jax.tree.map(lambda _: True, trainer.plan.params.tensor_sums)
    assert contradictions(local, everywhere) == {p: "spurious" for p in local if not declared[p]}


def forgetting(module, target):
    """`module.declare`, except that the parameter `target` = (module name, parameter name) is
    declared without its `sequence_parallel` flag."""
    original = module.declare

    def declare(mod, name, *args, **kwargs):
        if (mod.name, name) == target:
            kwargs["sequence_parallel"] = False
        return original(mod, name, *args, **kwargs)
    return declare


@pytest.mark.parametrize("arch,tensor,sp,module,target,path", [
    ("gpt", 2, True, transformer, (None, "pos_embedding"), "['pos_embedding']"),
    ("llama", 4, True, norms, ("ln_final", "scale"), "['ln_final']['scale']"),
    ("gpt", 2, True, layers, ("o", "bias"), "['layers']['attn']['o']['bias']"),
])
def test_detector_flags_a_missing_sequence_parallel_flag(monkeypatch, arch, tensor, sp, module, target, path):
    trainer, local, ref = measured(arch, tensor, sp)
    monkeypatch.setattr(module, "declare", forgetting(module, target))
    forgot = build(trainer.cfg, 1, 1, tensor)          # declared anew, under the patch
    assert contradictions(local, forgot.plan.params.tensor_sums) == {path: "missing"}
    assert not by_path(forgot.plan.params.tensor_sums)[path]
    # what the step would then return for it, rank 0's partial sum, is wrong
    assert np.linalg.norm(local[path][0] - ref[path]) > 0.1 * np.linalg.norm(ref[path])


def declared_params(arch, tensor, kv_heads=None, extra=()):
    cfg = tiny_config(arch, extra=([] if kv_heads is None else [f"model.num_kv_heads={kv_heads}"]) + list(extra))
    model = Transformer(cfg.model, padded_vocab_size(VOCAB, cfg.model.vocab_multiple, tensor))
    return abstract_params(model, cfg.model.seq_len), cfg.model.kv_heads


def summed(arch, tensor, sp, kv_heads=None, extra=()):
    """The paths whose gradients the derivation sums over `tensor`."""
    boxed, k = declared_params(arch, tensor, kv_heads, extra)
    tree = tensor_reductions(boxed, rules_for(k, tensor), tensor, sp)
    return {jax.tree_util.keystr(p) for p, r in jax.tree_util.tree_leaves_with_path(tree) if r}


GPT_SP = {"['ln_final']['bias']", "['ln_final']['scale']", "['pos_embedding']",
          "['layers']['ln_attn']['bias']", "['layers']['ln_attn']['scale']",
          "['layers']['ln_mlp']['bias']", "['layers']['ln_mlp']['scale']",
          "['layers']['attn']['o']['bias']", "['layers']['mlp']['fc2']['bias']"}
LLAMA_SP = {"['ln_final']['scale']", "['layers']['ln_attn']['scale']", "['layers']['ln_mlp']['scale']"}
LLAMA_KV = {"['layers']['attn']['k']['kernel']", "['layers']['attn']['v']['kernel']"}
KV_BIAS = {"['layers']['attn']['k']['bias']", "['layers']['attn']['v']['bias']"}


@pytest.mark.parametrize("arch,tensor,sp,kv_heads,expected", [
    ("gpt", 1, True, None, set()),                 # t = 1: nothing to sum
    ("llama", 1, True, 1, set()),
    ("gpt", 2, False, None, set()),                # no SP, kv heads split: every gradient complete
    ("llama", 2, False, 2, set()),
    ("gpt", 4, True, None, GPT_SP),                # SP: the sequence_parallel parameters
    ("llama", 2, True, 2, LLAMA_SP),
    ("llama", 4, False, 2, LLAMA_KV),              # k % t != 0: kv heads replicated, partial
    ("llama", 4, True, 2, LLAMA_SP | LLAMA_KV),
    ("llama", 2, False, 1, LLAMA_KV),
])
def test_derivation(arch, tensor, sp, kv_heads, expected):
    assert summed(arch, tensor, sp, kv_heads) == expected


@pytest.mark.parametrize("tensor,sp,kv_heads,expected", [
    (2, True, 2, LLAMA_SP),                        # Q/K/V biases split with their heads: complete
    (4, False, 2, LLAMA_KV | KV_BIAS),             # replicated kv heads: their biases are partial too
    (4, True, 2, LLAMA_SP | LLAMA_KV | KV_BIAS),
])
def test_derivation_with_qkv_bias(tensor, sp, kv_heads, expected):
    assert summed("llama", tensor, sp, kv_heads, ["model.qkv_bias=true"]) == expected


QK_NORM = {"['layers']['attn']['q_norm']['scale']", "['layers']['attn']['k_norm']['scale']"}


@pytest.mark.parametrize("tensor,sp,kv_heads,expected", [
    (1, True, 2, set()),
    (2, False, 2, QK_NORM),                        # one scale for the heads of every rank: partial, SP or not
    (4, True, 2, LLAMA_SP | LLAMA_KV | QK_NORM),
])
def test_derivation_with_qk_norm(tensor, sp, kv_heads, expected):
    assert summed("llama", tensor, sp, kv_heads, ["model.qk_norm=true"]) == expected


def test_every_parameter_is_declared():
    """A parameter boxed some other way has no declared usage: the derivation refuses it."""
    boxed, _ = declared_params("gpt", 2)
    assert all(isinstance(b, ParamBox) for b in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, ParamBox)))
    boxed = {**boxed, "extra": nn.LogicallyPartitioned(jnp.zeros(3), ("norm",))}
    with pytest.raises(TypeError):
        tensor_reductions(boxed, rules_for(0, 2), 2, True)

"""The layers' column kernels joined once per step (`model/joined_columns.py`): Q, K, V (when
every rank holds its own kv heads) and a gated MLP's gate and up, handed to the sequence-parallel
gathered matmul side by side. The values are the reference's in every such layout; the step
joins the stacks outside the micro-batch loop and no layer joins or splits a kernel."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core    # jaxprs_in_params

from layouts import ZERO_GRADIENT, build, leaf_errors, random_batch, tiny_config
from mtjax.model.joined_columns import COLLECTION, join_model, split_model
from test_equivalence import assert_matches_reference

CASES = {  # name: (arch, tensor, extra): what is joined
    "qkv_and_gate_up": ("llama", 2, ["model.qkv_bias=true", "train.micro_batches=2"]),   # both, with Q/K/V biases
    "gate_up_only": ("llama", 2, ["model.num_kv_heads=1"]),        # k < t: each rank picks its K, V head
    "qkv_only_moe": ("llama", 2, ["model.num_experts=4", "model.moe_top_k=2"]),   # the experts have no gate/up pair
    "gpt_qkv": ("gpt", 4, ["train.recompute=selective"]),           # GPT's fc1 is alone
}


def _tree(rng, shapes):
    return {k: _tree(rng, v) if isinstance(v, dict) else rng.randn(*v).astype(np.float32) for k, v in shapes.items()}


def test_split_undoes_join():
    """split_model(join_model(p)) is p, leaf for leaf; the joined stacks are the kernels' columns
    side by side, [n, h, sum_i |out_i|]; nothing else moves."""
    n, h = 3, 4
    shapes = {"embed": {"embedding": (7, h)}, "layers": {
        "attn": {"q": {"kernel": (n, h, 2, 3), "bias": (n, 2, 3)}, "k": {"kernel": (n, h, 1, 3)},
                 "v": {"kernel": (n, h, 1, 3)}, "o": {"kernel": (n, 2, 3, h)}},
        "mlp": {"gate": {"kernel": (n, h, 5)}, "up": {"kernel": (n, h, 5)}, "fc2": {"kernel": (n, 5, h)}}}}
    params = _tree(np.random.RandomState(0), shapes)
    joined = join_model(params, kv_split=True)
    stacks = joined[COLLECTION]["layers"]
    assert stacks["attn"]["qkv"].shape == (n, h, 12) and stacks["mlp"]["gate_up"].shape == (n, h, 10)
    np.testing.assert_array_equal(stacks["attn"]["qkv"][:, :, 6:9], params["layers"]["attn"]["k"]["kernel"][..., 0, :])
    assert "kernel" not in joined["params"]["layers"]["attn"]["q"] and "bias" in joined["params"]["layers"]["attn"]["q"]
    back = split_model(joined, params)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    assert list(join_model(params, kv_split=False)[COLLECTION]["layers"]) == ["mlp"]     # k < t: Q, K, V apart


@pytest.mark.parametrize("name", list(CASES))
def test_joined_columns_match_reference(name):
    """Logits, loss, every gradient leaf and an AdamW step against the reference, t > 1 with
    sequence parallelism, wherever something is joined."""
    arch, tensor, extra = CASES[name]
    cfg = tiny_config(arch, tensor, 1, 1, True, micro_batch=None if "train.micro_batches=2" in extra else 1,
                      extra=extra)
    assert_matches_reference(build(cfg, 1, 1, tensor), cfg)


def _concatenates(jaxpr, loops: int = 0):
    """(output shape, enclosing scan/while count) of every concatenate, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is lax.concatenate_p:
            out.append((tuple(eqn.outvars[0].aval.shape), loops))
        inner = loops + (eqn.primitive.name in ("scan", "while"))
        for sub in core.jaxprs_in_params(eqn.params):
            out.extend(_concatenates(sub, inner))
    return out


def test_the_step_joins_once_and_no_layer_joins():
    """The training step's program: the joined stacks [l, h, N] are made outside every loop (once
    per step, not per micro-batch or layer), and no loop makes a joined kernel [h, N] (the
    dgrad's join of the kernels and the wgrad's split were each layer's, in its backward)."""
    cfg = tiny_config("llama", 2, 1, 1, True, extra=["train.micro_batches=2"])
    trainer = build(cfg, 1, 1, 2)
    state = trainer.init_state()
    local = jax.tree.map(lambda a: np.zeros(a.sharding.shard_shape(a.shape), np.float32), state.params)
    stacks = jax.tree.leaves(join_model(local, kv_split=True)[COLLECTION])
    assert len(stacks) == 2
    jaxpr = jax.make_jaxpr(trainer.grad_fn)(state.params, trainer.put_batch(random_batch()), state.rng).jaxpr
    made = _concatenates(jaxpr)
    for stack in stacks:
        assert [loops for shape, loops in made if shape == stack.shape] and \
            all(loops == 0 for shape, loops in made if shape == stack.shape), (stack.shape, made)
        assert not [m for m in made if m[0] == stack.shape[1:]], (stack.shape[1:], made)


def test_offloaded_layers_take_their_kernels_apart():
    """Activation offload's layer loop is a plain scan, which takes no joined kernels: with
    offload the step does not join, and its gradients are the plain step's (CPU: the host moves
    are no-ops; validation refuses offload there, so the config is built past it)."""
    base = tiny_config("llama", 2, 1, 1, True, micro_batch=1, extra=["train.recompute=none"])
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, offload_activations=True))
    offload, plain = build(cfg, 1, 1, 2), build(base, 1, 1, 2)
    params, rng, batch = plain.init_state().params, jnp.zeros(2, jnp.uint32), random_batch(3)
    got, _ = jax.jit(offload.grad_fn)(params, offload.put_batch(batch), rng)
    want, _ = jax.jit(plain.grad_fn)(params, plain.put_batch(batch), rng)
    errs = leaf_errors(jax.device_get(got), jax.device_get(want), skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < 1e-6, errs

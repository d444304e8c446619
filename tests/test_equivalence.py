"""Every layout computes what one device computes: logits, loss, every gradient leaf, one AdamW step.

The oracle is tests/reference.py, a plain single-device model. fp32, relative error < 1e-5.
Covers data parallelism (data=1 vs data=8), tensor parallelism t in {1, 2, 4}, sequence
parallelism, GPT (tied embeddings, MHA) and Llama (untied, GQA with k=2 < t=4).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import reference
from layouts import VOCAB, ZERO_GRADIENT, build, leaf_errors, random_batch, tiny_config, tree_norm

TOL = 1e-5

LAYOUTS = [  # (data, pipe, tensor, sequence_parallel)
    (1, 1, 1, False), (8, 1, 1, False), (1, 1, 2, False), (1, 1, 2, True),
    (1, 1, 4, False), (1, 1, 4, True), (2, 1, 4, True), (2, 2, 2, False),
]


def reference_adamw_step(cfg, params, grads):
    """Plain optax AdamW (+ global-norm clip), decay on everything but norms and biases."""
    op = cfg.optim
    mask = jax.tree_util.tree_map_with_path(lambda p, _: p[-1].key not in ("bias", "scale"), params)
    tx = optax.chain(optax.clip_by_global_norm(op.clip_grad),
                     optax.adamw(op.lr, b1=op.beta1, b2=op.beta2, eps=op.eps, weight_decay=op.weight_decay,
                                 mask=mask))
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("data,pipe,tensor,sp", LAYOUTS)
def test_layout_matches_reference(arch, data, pipe, tensor, sp):
    cfg = tiny_config(arch, tensor, pipe, data, sp, micro_batch=1)
    trainer = build(cfg, data, pipe, tensor)
    state = trainer.init_state()
    batch = random_batch()
    params = jax.device_get(state.params)

    logits = trainer.logits_fn(state.params, trainer.put_batch(batch[:, :-1]))
    ref_logits = reference.logits(params, batch[:, :-1], cfg.model, VOCAB)
    assert float(jnp.linalg.norm(logits - ref_logits) / jnp.linalg.norm(ref_logits)) < TOL

    grads, loss = trainer.grad_fn(state.params, trainer.put_batch(batch), state.rng)
    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < TOL
    grads = jax.device_get(grads)
    errs = leaf_errors(grads, ref_grads, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
    if arch == "gpt":
        assert tree_norm(grads["layers"]["attn"]["k"]["bias"]) < 1e-6 * tree_norm(ref_grads)

    new_state, metrics = trainer.train_step(state, trainer.put_batch(batch))
    expected = reference_adamw_step(cfg, params, ref_grads)
    errs = leaf_errors(jax.device_get(new_state.params), expected, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
    assert abs(float(metrics["loss"]) - float(ref_loss)) / float(ref_loss) < TOL
    assert int(new_state.step) == 1 and int(new_state.data_position) == batch.shape[0]


def test_parameters_live_with_their_shardings():
    """The arrays carry the PartitionSpecs the rule table derives from the logical axes."""
    cfg = tiny_config("llama", tensor=2, pipe=2, data=2)
    trainer = build(cfg, 2, 2, 2)
    state = trainer.init_state()
    p = state.params
    assert p["layers"]["attn"]["q"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("pipe", None, "tensor", None)
    assert p["layers"]["mlp"]["fc2"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("pipe", "tensor", None)
    assert p["embed"]["embedding"].sharding.spec == jax.sharding.PartitionSpec("tensor", "pipe")   # the shared state is split over pipe
    for leaf, spec in zip(jax.tree.leaves(p), jax.tree.leaves(trainer.specs.params,
                                                               is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        assert leaf.sharding.spec == spec
        # each device holds exactly its shard
        shard = leaf.addressable_shards[0].data.shape
        expect = tuple(n // (trainer.mesh.shape[a] if a else 1) for n, a in zip(leaf.shape, tuple(spec) + (None,) * 9))
        assert shard == expect
    # the first Adam moment follows its parameter
    mu = state.opt_state[1][0].mu if hasattr(state.opt_state[1][0], "mu") else None
    if mu is not None:
        assert mu["embed"]["embedding"].sharding.spec == jax.sharding.PartitionSpec("tensor", "pipe")


def test_same_model_on_every_layout():
    """Initialisation draws global shapes from one key: identical parameters whatever the mesh."""
    a = jax.device_get(build(tiny_config("gpt"), 1, 1, 1).init_state().params)
    b = jax.device_get(build(tiny_config("gpt", tensor=2, data=2, pipe=2), 2, 2, 2).init_state().params)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        n = min(x.shape[0], y.shape[0])   # the padded vocabulary differs with t
        np.testing.assert_array_equal(x[:n], y[:n])

"""Megatron's state layout (`train.state_layout=megatron`): the persistent compute-dtype weights
and fp32 main_grad buffer change what lives on a device between steps, not what a step computes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from layouts import VOCAB, ZERO_GRADIENT, build, leaf_errors, random_batch, tiny_config
from mtjax.inspect import report

LAYOUTS = [  # (data, pipe, tensor), extra overrides, compared with the lean layout's run
    ((2, 2, 2), ["parallel.distributed_optimizer=true", "model.num_layers=4", "parallel.schedule=interleaved",
                 "parallel.virtual_stages=2", "train.micro_batch=1"], False),
    ((4, 1, 2), ["parallel.sequence_parallel=true"], True),
]


def unpad(tree):
    return {**tree, "embed": {"embedding": tree["embed"]["embedding"][:VOCAB]}}


def steps(trainer, n):
    state = trainer.init_state()
    for i in range(n):
        state, _ = trainer.train_step(state, trainer.put_batch(random_batch(i)))
    return state


@pytest.mark.parametrize("shape,extra,compare", LAYOUTS, ids=["2x2x2-zero-interleaved", "4x1x2-sp"])
def test_megatron_layout_makes_the_updates_of_the_lean_one(shape, extra, compare):
    """main_grad summed over the data ranks is the gradient of the independent reference model at
    the step's weights; on one layout (a compile each way is costly) two fp32 steps of each
    state layout give the same master weights and moments."""
    d, p, t = shape
    cfg = tiny_config("gpt", t, p, d, extra=[*extra, "train.state_layout=megatron"])
    trainer = build(cfg, d, p, t)
    before = unpad(jax.device_get(steps(trainer, 1).params))
    state = steps(trainer, 2)
    if compare:
        lean = jax.device_get(steps(build(tiny_config("gpt", t, p, d, extra=extra), d, p, t), 2))
        got = jax.device_get(state)
        errs = leaf_errors(unpad(got.params), unpad(lean.params), skip=(ZERO_GRADIENT,))
        assert max(errs.values()) < 1e-6, {k: v for k, v in errs.items() if v >= 1e-6}
        mu = lambda s: unpad(s.opt_state[1][0].mu)  # noqa: E731
        errs = leaf_errors(mu(got), mu(lean), skip=(ZERO_GRADIENT,))
        assert max(errs.values()) < 1e-6, {k: v for k, v in errs.items() if v >= 1e-6}

    # fp32 without the distributed optimizer: the master weights are the compute weights, no copy
    assert (state.buffers.model_params is None) == (not trainer.cfg.parallel.distributed_optimizer)
    main_grad = state.buffers.main_grad
    assert all(g.shape[0] == d and g.sharding.spec[0] == "data" for g in jax.tree.leaves(main_grad))
    total = unpad(jax.tree.map(lambda g: np.asarray(g).sum(0), main_grad))
    want = jax.grad(reference.loss)(before, random_batch(1), cfg.model, VOCAB)
    errs = leaf_errors(total, want, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < 1e-5, {k: v for k, v in errs.items() if v >= 1e-5}
    # every rank holds its own share: no row is the whole sum (d > 1 ranks saw different data)
    w = np.asarray(main_grad["embed"]["embedding"])
    assert not np.allclose(w[0], w.sum(0))


def test_bf16_model_params_are_the_cast_master_gathered_over_data():
    """With the distributed optimizer the compute copy is whole over `data`, in bf16, and after a
    step equals the updated master weights cast (the end-of-step all-gather)."""
    cfg = tiny_config("gpt", 2, 1, 4, micro_batch=1, extra=[
        "parallel.distributed_optimizer=true", "train.precision=bf16", "train.state_layout=megatron"])
    state = steps(build(cfg, 4, 1, 2), 1)
    for w, c in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.buffers.model_params)):
        assert c.dtype == jnp.bfloat16 and "data" not in str(c.sharding.spec)
        np.testing.assert_array_equal(np.asarray(w.astype(jnp.bfloat16)), np.asarray(c))


@pytest.mark.parametrize("precision,dist", [("bf16", False), ("bf16", True), ("fp32", True)])
def test_persistent_bytes_per_parameter_of_the_megatron_layout(precision, dist):
    """XLA's argument bytes per parameter and device: Megatron's 18 and 6 + 12/d under bf16; 8 + 12/d
    under fp32 with the distributed optimizer (the fp32 weights are kept whole beside the master
    shard; fp32 without it keeps no copy, which the 4x1x2 run above exercises)."""
    d = 4
    cfg = tiny_config("gpt", 2, 1, d, micro_batch=1, extra=[
        f"parallel.distributed_optimizer={dist}", f"train.precision={precision}", "train.state_layout=megatron"])
    per = report(build(cfg, d, 1, 2))["persistent_bytes_per_parameter"]
    formula = {("bf16", False): 18.0, ("bf16", True): 6 + 12 / d, ("fp32", False): 16.0,
               ("fp32", True): 8 + 12 / d}[precision, dist]
    assert per["expected"] == formula
    if precision == "bf16":
        assert per["megatron_formula"] == formula
    assert abs(per["measured"] - formula) < 0.01 * formula     # plus the batch and counters

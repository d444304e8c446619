"""Megatron's state layout (`train.state_layout=megatron`): the persistent compute-dtype weights
and fp32 main_grad buffer change what lives on a device between steps, not what a step computes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from layouts import VOCAB, ZERO_GRADIENT, build, leaf_errors, random_batch, tiny_config, unpad
from mtjax.inspect import report
from mtjax.pipeline.layer_order import layer_order as interleave_order

INTERLEAVED = ["parallel.distributed_optimizer=true", "model.num_layers=4", "parallel.schedule=interleaved",
               "parallel.virtual_stages=2", "parallel.sequence_parallel=true", "train.micro_batch=1"]


def steps(trainer, n):
    state = trainer.init_state()
    for i in range(n):
        state, _ = trainer.train_step(state, trainer.put_batch(random_batch(i)))
    return state


def layer_order(main_grad, trainer):
    """main_grad with its `layers` axis (axis 1) put back in layer order (the interleaved schedule
    keeps the order it runs the layers in)."""
    cfg = trainer.cfg
    order = interleave_order(cfg.model.num_layers, trainer.layout.pipe, cfg.parallel.virtual_stages)
    back = np.argsort(order)
    return {**main_grad, "layers": jax.tree.map(lambda g: np.take(np.asarray(g), back, axis=1), main_grad["layers"])}


def test_main_grad_holds_each_data_rank_own_gradient_sum():
    """(2, 2, 2), distributed optimizer, interleaved (v = 2), sequence parallel, fp32: main_grad
    summed over the data ranks is the gradient of the independent reference model at the step's
    weights, and no rank's row is the whole sum."""
    cfg = tiny_config("gpt", 2, 2, 2, extra=[*INTERLEAVED, "train.state_layout=megatron"])
    trainer = build(cfg, 2, 2, 2)
    before = unpad(jax.device_get(trainer.canonical(steps(trainer, 1).params)))   # stored in run order
    state = steps(trainer, 2)
    main_grad = state.buffers.main_grad
    assert all(g.shape[0] == 2 and g.sharding.spec[0] == "data" for g in jax.tree.leaves(main_grad))
    main_grad = layer_order(jax.device_get(main_grad), trainer)
    total = unpad(jax.tree.map(lambda g: g.sum(0), main_grad))
    want = jax.grad(reference.loss)(before, random_batch(1), cfg.model, VOCAB)
    errs = leaf_errors(total, want, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < 1e-5, {k: v for k, v in errs.items() if v >= 1e-5}
    w = main_grad["embed"]["embedding"]            # the two ranks saw different sequences
    assert not np.allclose(w[0], w.sum(0))


def test_megatron_layout_makes_the_updates_of_the_lean_one():
    """(4, 1, 2) with sequence parallelism, no distributed optimizer, bf16: two steps of each
    state layout give the same master weights and moments. Both compute with the same rounded
    weights (norm scales and biases too), one from its persistent copy, one from a cast."""
    extra = ["parallel.sequence_parallel=true", "train.precision=bf16"]
    runs = {}
    for layout in ("lean", "megatron"):
        trainer = build(tiny_config("gpt", 2, 1, 4, extra=[*extra, f"train.state_layout={layout}"]), 4, 1, 2)
        runs[layout] = jax.device_get(steps(trainer, 2))
    lean, got = runs["lean"], runs["megatron"]
    errs = leaf_errors(unpad(got.params), unpad(lean.params), skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < 1e-6, {k: v for k, v in errs.items() if v >= 1e-6}
    mu = lambda s: unpad(s.opt_state[1][0].mu)  # noqa: E731
    errs = leaf_errors(mu(got), mu(lean), skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < 1e-6, {k: v for k, v in errs.items() if v >= 1e-6}


def test_bf16_model_params_are_the_cast_master_gathered_over_data():
    """With the distributed optimizer the compute copy is whole over `data`, in bf16, and after a
    step equals the updated master weights cast (the end-of-step all-gather)."""
    cfg = tiny_config("gpt", 2, 1, 4, micro_batch=1, extra=[
        "parallel.distributed_optimizer=true", "train.precision=bf16", "train.state_layout=megatron"])
    state = steps(build(cfg, 4, 1, 2), 1)
    for w, c in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.buffers.model_params)):
        assert c.dtype == jnp.bfloat16 and "data" not in str(c.sharding.spec)
        np.testing.assert_array_equal(np.asarray(w.astype(jnp.bfloat16)), np.asarray(c))


@pytest.mark.parametrize("precision,dist", [("bf16", False), ("bf16", True), ("fp32", False), ("fp32", True)])
def test_persistent_bytes_per_parameter_of_the_megatron_layout(precision, dist):
    """XLA's argument bytes per parameter and device: Megatron's 18 and 6 + 12/d under bf16; 16 and
    8 + 12/d under fp32 (no copy without the distributed optimizer; with it the fp32 weights are
    kept whole beside the master shard)."""
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

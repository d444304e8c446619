"""Every layout computes what one device computes: logits, loss, every gradient leaf, one AdamW step.

The oracle is tests/reference.py, a plain single-device model. fp32, relative error < 1e-5.
Covers one device, tensor parallelism t in {2, 4}, sequence parallelism, the (2, 2, 2) mesh of
data x pipe x tensor, GPT (tied embeddings, MHA) and Llama (untied, GQA with k=2 < t=4), and the model
options of the Hugging Face families (GPT-2's tanh GeLU, Qwen2's Q/K/V biases, a head dimension
other than h/a, linear and Llama 3.1 rotary scaling, either output layer) and the
`jax.nn.dot_product_attention` kernel on t = 4.
"""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import reference
from layouts import (SEQ, VOCAB, ZERO_GRADIENT, applied_gradients, build, clipped, leaf_errors, random_batch, relative,
                     tiny_config, tree_norm)
from mtjax.config import load_config
from mtjax.model.rotary import rope_frequencies

TOL = 1e-5

# One device, t = 2 with SP (GPT: MHA, tied head), t = 4 with SP (Llama: GQA k = 2 < t = 4,
# replicated) and the (2, 2, 2) mesh (data x pipe x tensor, a prefix through the stages, the AdamW
# step); the cut cases were each architecture on every layout: tensor without SP is in the options
# below and tests/test_pipeline.py, data = 8 / data x tensor in tests/test_distributed_optimizer.py,
# tests/test_pipeline.py and the (2, 2, 2) case here.
LAYOUTS = [  # (data, pipe, tensor, sequence_parallel, arch)
    (1, 1, 1, False, "llama"), (1, 1, 2, True, "gpt"), (1, 1, 4, True, "llama"), (2, 2, 2, False, "llama"),
]


# STEP_ON_OWN_GRADIENTS: the new weights are checked against AdamW on the gradients the step
# applied, which are themselves checked against the reference's (leaf-norm relative error < TOL),
# not against AdamW on the reference's gradients. AdamW's first step moves each entry by
# lr g / (|g| + eps), about lr whatever the entry's size, so an entry whose gradient is near
# eps = 1e-8 brings its own relative error into the leaf, not its share of the leaf's norm. GPT's
# zero-initialised fc1 bias has such entries: at l 8 (B 8, s 16, h 32, seed 0) one entry sums 128
# token terms (largest 2.2e-4, absolute sum 7.5e-3) to -1.8e-8 in float64, 1.1e-8 after the clip;
# each fp32 computation of it is about 7e-10 off after the clip (6%; the leaf 4e-7). The fp32
# reference's own step is then 5.1e-4 from the float64 step on that leaf, and one device's (m 1
# or 2), data 2 x pipe 2's (t 1 or 2) 3.3e-4 to 5.0e-4: two fp32 steps differ by 1.3e-5 to 1.9e-4
# there, whichever way each rounds. The gradients carry the comparison with the reference; the
# step checks the optimizer (lr, masks, clip, decay) on them.


@partial(jax.jit, static_argnums=0)      # one compile, not one per optax operation and leaf shape
def reference_adamw_step(cfg, params, grads):
    """Plain optax AdamW (+ global-norm clip), decay on everything but norms and biases."""
    op = cfg.optim
    mask = jax.tree_util.tree_map_with_path(lambda p, _: p[-1].key not in ("bias", "scale"), params)
    tx = optax.chain(optax.clip_by_global_norm(op.clip_grad),
                     optax.adamw(op.lr, b1=op.beta1, b2=op.beta2, eps=op.eps, weight_decay=op.weight_decay,
                                 mask=mask))
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


def assert_prefix_logits(trainer, params, batch, full_logits, length=SEQ // 2):
    """Causal attention: the logits of the first `length` tokens alone are the full sequence's there."""
    short = trainer.logits_fn(params, trainer.put_batch(batch[:, :length]))
    assert short.shape == full_logits[:, :length].shape
    assert relative(short, full_logits[:, :length]) < TOL


def assert_matches_reference(trainer, cfg, evaluate: bool = False, logits: bool = True):
    """`trainer` on `random_batch()` against the reference (fp32, TOL): the logits (unless `logits`
    is False: a setting the logits function does not see), with `evaluate` the eval step's loss,
    then one train step: its loss, every gradient leaf it applied (read back from AdamW's first
    moment, `applied_gradients`; GPT's zero key-bias gradient skipped) and the AdamW step.
    -> (the reference loss, the step's metrics)."""
    state = trainer.init_state()
    batch = random_batch()
    params = jax.device_get(trainer.canonical(state.params))     # interleaved: stored in run order

    if logits:
        out = trainer.logits_fn(state.params, trainer.put_batch(batch[:, :-1]))
        assert relative(out, reference.logits(params, batch[:, :-1], cfg.model, VOCAB)) < TOL
    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)
    if evaluate:    # before the step, which donates the state: the validation loss is the same mean
        assert abs(float(trainer.eval_step(state.params, trainer.put_batch(batch))) - float(ref_loss)) \
            < TOL * float(ref_loss)
    _, metrics = assert_step_matches(trainer, cfg, state, batch, params, ref_loss, ref_grads)
    return ref_loss, metrics


def assert_step_matches(trainer, cfg, state, batch, params, ref_loss, ref_grads, skip=(ZERO_GRADIENT,)):
    """One train step from `state` on `batch` against the reference's loss and gradients: the
    loss, the logged gradient norm, every clipped gradient leaf the step applied, and the new
    weights: plain AdamW on the gradients the step applied (`STEP_ON_OWN_GRADIENTS`).
    `params` and `ref_grads` in canonical layer order. -> (new state, metrics)."""
    new_state, metrics = trainer.train_step(state, trainer.put_batch(batch))
    assert abs(float(metrics["loss"]) - float(ref_loss)) / float(ref_loss) < TOL
    # the logged grad_norm: every parameter once, whatever is replicated or split (Megatron's)
    assert abs(float(metrics["grad_norm"]) - tree_norm(ref_grads)) < TOL * tree_norm(ref_grads)
    grads = applied_gradients(trainer, new_state.opt_state)
    errs = leaf_errors(grads, clipped(cfg, ref_grads), skip=skip)
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
    expected = reference_adamw_step(cfg, params, grads)      # STEP_ON_OWN_GRADIENTS
    errs = leaf_errors(jax.device_get(trainer.canonical(new_state.params)), expected, skip=skip)
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
    return new_state, metrics


@pytest.mark.parametrize("data,pipe,tensor,sp,arch", LAYOUTS)
def test_layout_matches_reference(arch, data, pipe, tensor, sp):
    cfg = tiny_config(arch, tensor, pipe, data, sp, micro_batch=1)
    trainer = build(cfg, data, pipe, tensor)
    state = trainer.init_state()
    batch = random_batch()
    params = jax.device_get(state.params)

    logits = trainer.logits_fn(state.params, trainer.put_batch(batch[:, :-1]))
    ref_logits = reference.logits(params, batch[:, :-1], cfg.model, VOCAB)
    assert relative(logits, ref_logits) < TOL
    if pipe > 1:    # a shorter input through the stages
        assert_prefix_logits(trainer, state.params, batch, logits)

    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)
    new_state, _ = assert_step_matches(trainer, cfg, state, batch, params, ref_loss, ref_grads)
    if arch == "gpt":
        grads = applied_gradients(trainer, new_state.opt_state)
        assert tree_norm(grads["layers"]["attn"]["k"]["bias"]) < 1e-6 * tree_norm(ref_grads)
    assert int(new_state.step) == 1 and int(new_state.data_position) == batch.shape[0]


# Each option of the Hugging Face families, several to a model: (arch, overrides, layouts). Each
# option once on a tensor-parallel layout (GQA's k = 2 replicated at t = 4, the harder split); the
# cut t = 1 and t = 2 cases computed the same option with less or the plain split of the heads.
LLAMA3_ROPE = ["model.rope_scaling=llama3", "model.rope_theta=100", "model.rope_scaling_factor=8",
               "model.rope_low_freq_factor=2", "model.rope_high_freq_factor=4", "model.rope_original_positions=64"]
OPTIONS = {
    # GPT-2's tanh GeLU, d = 8 != h/a = 4, an untied output layer; weights large enough that the
    # MLP's inputs reach where the two GeLUs differ (|x| ~ 2)
    "gpt_gelu_tanh": ("gpt", ["model.activation=gelu_tanh", "model.kv_channels=8", "model.tie_embeddings=false",
                              "model.init_std=0.3"],
                      [(1, 1, 2, True)]),
    # linear rotary scaling, a tied output layer, the activation named
    "llama_linear": ("llama", ["model.rope_scaling=linear", "model.rope_scaling_factor=4", "model.activation=swiglu",
                               "model.tie_embeddings=true"],
                     [(1, 1, 2, False)]),
    # Qwen2's Q/K/V biases with GQA (k = 2 replicated at t = 4), d = 8 != h/a = 4, and
    # Llama 3.1's rotary scaling with theta and the bands chosen so that d/2 = 4 frequencies fall
    # in all three bands (wavelengths 6.3, 19.9 | 62.8, 199 against L/high = 16, L/low = 32);
    # tie_embeddings null: llama's default, untied
    "llama_qkv_bias_llama3": ("llama", ["model.qkv_bias=true", "model.kv_channels=8", "model.tie_embeddings=null",
                                        *LLAMA3_ROPE],
                              [(1, 1, 4, False)]),
    # jax.nn.dot_product_attention (its XLA lowering here; cuDNN's on a GPU) with GQA, k = 2
    # replicated at t = 4, and selective recomputation wrapping it; Qwen3's QK-norm (its scales'
    # gradients summed over the ranks' heads)
    "llama_dot_product": ("llama", ["model.attention=dot_product", "model.qk_norm=true"],
                          [(1, 1, 4, False)]),
    "gpt_dot_product_selective": ("gpt", ["model.attention=dot_product", "train.recompute=selective"],
                                  [(1, 1, 4, True)]),
}


@pytest.mark.parametrize("name,data,pipe,tensor,sp", [(name, *layout) for name, (_, _, layouts) in OPTIONS.items()
                                                      for layout in layouts])
def test_model_options_match_reference(name, data, pipe, tensor, sp):
    """Logits (also of a prefix), loss and every gradient leaf against the reference, which
    implements each option itself; the parameter tree holds what the options say."""
    arch, extra, _ = OPTIONS[name]
    cfg = tiny_config(arch, tensor, pipe, data, sp, micro_batch=1, extra=extra)
    trainer = build(cfg, data, pipe, tensor)
    state = trainer.init_state()
    batch = random_batch()
    params = jax.device_get(state.params)

    logits = trainer.logits_fn(state.params, trainer.put_batch(batch[:, :-1]))
    assert relative(logits, reference.logits(params, batch[:, :-1], cfg.model, VOCAB)) < TOL
    assert_prefix_logits(trainer, state.params, batch, logits)
    with pytest.raises(ValueError, match="longer than model.seq_len"):
        trainer.logits_fn(state.params, trainer.put_batch(jnp.zeros((batch.shape[0], SEQ + 2), jnp.int32)))
    if sp:
        with pytest.raises(ValueError, match="multiple of it"):
            trainer.logits_fn(state.params, trainer.put_batch(batch[:, :tensor + 1]))

    grads, loss = trainer.grad_fn(state.params, trainer.put_batch(batch), state.rng)
    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < TOL
    # gpt's key bias only shifts each score row, which softmax ignores; rotated, llama's does not
    skip = (ZERO_GRADIENT,) if arch == "gpt" else ()
    errs = leaf_errors(jax.device_get(grads), ref_grads, skip=skip)
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}


@pytest.mark.parametrize("scaling,extra", [("none", []), ("linear", ["model.rope_scaling_factor=8"]),
                                           ("llama3", ["model.rope_scaling_factor=8", "model.rope_theta=500000"])])
def test_rope_frequencies_match_reference(scaling, extra):
    """Llama 3.1 8B's rotary frequencies (d = 128, theta 5e5, factor 8, bands 1 and 4 over 8192
    positions): kept below wavelength 2048, divided by 8 above 8192, interpolated between;
    linear scaling divides every frequency (the reference divides the positions)."""
    m = load_config(None, ["model.arch=llama", "model.hidden_size=4096", "model.num_heads=32",
                           f"model.rope_scaling={scaling}", *extra]).model
    got = np.asarray(rope_frequencies(m), np.float64)
    expected = np.array([reference.rope_frequency(i, 128, m) for i in range(64)]) / (8 if scaling == "linear" else 1)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    if scaling == "llama3":
        base = m.rope_theta ** (-np.arange(0, 128, 2) / 128)
        wavelength = 2 * np.pi / base
        high, low = wavelength < 2048, wavelength > 8192
        np.testing.assert_allclose(got[high], base[high], rtol=1e-6)
        np.testing.assert_allclose(got[low], base[low] / 8, rtol=1e-6)
        between = ~high & ~low
        assert between.sum() > 0 and np.all((got[between] < base[between]) & (got[between] > base[between] / 8))


# transformers 5.24.0's `_compute_yarn_parameters(LlamaConfig(hidden_size=64, num_attention_heads=4,
# head_dim=16, max_position_embeddings=8192, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
# "factor": 4.0, "original_max_position_embeddings": 2048}))`: (inv_freq, attention_factor). Default
# betas 32, 1: the ramp runs over pairs 2 .. 6, so pairs 3, 4, 5 are blends.
HF_YARN_INV_FREQ = [1.0, 0.3162277638912201, 0.10000000149011612, 0.025693506002426147, 0.00624999962747097,
                    0.0013834965648129582, 0.0002500000118743628, 7.905694656074047e-05]
HF_YARN_ATTENTION_FACTOR = 1.138629436111989


@pytest.mark.parametrize("attention", [0.0, 1.5])
def test_yarn_frequencies_match_transformers_and_reference(attention):
    """rope_frequencies and the cos/sin factor for yarn against transformers' numbers and the
    reference; an attention factor given is used as it is."""
    from mtjax.model.rotary import attention_factor, rope_tables
    m = load_config(None, ["model.arch=llama", "model.hidden_size=64", "model.num_heads=4", "model.kv_channels=16",
                           "model.rope_scaling=yarn", "model.rope_scaling_factor=4",
                           "model.rope_original_positions=2048", f"model.rope_attention_factor={attention}"]).model
    got = np.asarray(rope_frequencies(m), np.float64)
    np.testing.assert_allclose(got, HF_YARN_INV_FREQ, rtol=1e-6)
    np.testing.assert_allclose(got, [reference.rope_frequency(i, 16, m) for i in range(8)], rtol=1e-6)
    factor = attention or HF_YARN_ATTENTION_FACTOR
    assert attention_factor(m) == pytest.approx(factor, rel=1e-12) == reference.rope_magnitude(m)
    cos, sin = rope_tables(jnp.arange(3), m)
    np.testing.assert_allclose(np.asarray(cos[0]), factor, rtol=1e-6)
    np.testing.assert_allclose(np.hypot(np.asarray(cos), np.asarray(sin)), factor, rtol=1e-6)


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

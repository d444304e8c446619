"""Mixed precision (fp16 dynamic loss scaling) and activation recomputation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from layouts import BATCH, SEQ, VOCAB, ZERO_GRADIENT, build, leaf_errors, random_batch, tiny_config
from mtjax.config import validate
from mtjax.config.errors import ConfigError
from mtjax.model.block import REMAT_POLICIES, layer_plan
from mtjax.training.loss_scale import LossScale, init_loss_scale, step_scale, update_loss_scale
from mtjax.training.optimizer import learning_rate, make_optimizer


def scaler(scale, good=0, hysteresis=2):
    return LossScale(jnp.float32(scale), jnp.int32(good), jnp.int32(hysteresis), jnp.int32(0))


def test_loss_scale_follows_megatrons_rule():
    cfg = tiny_config(extra=["train.precision=fp16"])          # window 1000, hysteresis 2, min 1
    s = update_loss_scale(scaler(1024.0), jnp.bool_(False), cfg)
    assert float(s.scale) == 1024.0 and int(s.hysteresis) == 1 and int(s.skipped) == 1   # tolerated once
    s = update_loss_scale(s, jnp.bool_(False), cfg)
    assert float(s.scale) == 512.0 and int(s.skipped) == 2                                 # then halved
    s = update_loss_scale(scaler(1.0, hysteresis=0), jnp.bool_(False), cfg)
    assert float(s.scale) == 1.0                                                            # never below min
    s = update_loss_scale(scaler(8.0, good=999, hysteresis=0), jnp.bool_(True), cfg)
    assert float(s.scale) == 16.0 and int(s.good_steps) == 0 and int(s.hysteresis) == 2    # grows, refills


def test_a_static_loss_scale_never_changes():
    """train.loss_scale (Megatron's --loss-scale, ConstantGradScaler): S is the config's at every
    step, whatever the state holds (a resumed run's), neither halved by overflows (still counted
    as skipped) nor doubled by a window of finite steps."""
    cfg = tiny_config(extra=["train.precision=fp16", "train.loss_scale=256"])
    assert float(init_loss_scale(cfg).scale) == 256.0 and float(step_scale(scaler(8.0), cfg)) == 256.0
    s = update_loss_scale(scaler(256.0, hysteresis=0), jnp.bool_(False), cfg)
    assert float(s.scale) == 256.0 and int(s.skipped) == 1
    s = update_loss_scale(scaler(256.0, good=999), jnp.bool_(True), cfg)
    assert float(s.scale) == 256.0 and int(s.skipped) == 0
    dynamic = tiny_config(extra=["train.precision=fp16"])
    assert float(step_scale(scaler(8.0), dynamic)) == 8.0 and float(init_loss_scale(dynamic).scale) == 2.0 ** 32
    for bad, words in [("train.loss_scale=-1", "must be a finite number >= 0"), ("train.loss_scale=inf", "finite"),
                       ("train.hysteresis=1", "hysteresis = 1 needs train.loss_scale=0 (dynamic scaling")]:
        with pytest.raises(ConfigError) as e:
            validate(tiny_config(extra=["train.precision=fp16", "train.loss_scale=8", bad]), 1)
        assert e.value.key == bad.split("=")[0] and words in str(e.value), str(e.value)


def test_the_optimizer_state_has_one_structure_whatever_the_clip():
    """optim.clip_grad = 0 or > 0: the same state tree, so a run resumes across a change of it."""
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    trees = [jax.tree.structure(make_optimizer(tiny_config(extra=[f"optim.clip_grad={c}"])).init(params))
             for c in (0, 1.0)]
    assert trees[0] == trees[1]


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    """An overflowing scale: the step is skipped (nothing moves) and S halves. The same trainer
    then given a sane S takes its step, with the reference's loss up to fp16 rounding. One
    compiled step (S is state, not a constant of the program)."""
    cfg = tiny_config(extra=["train.precision=fp16", "train.hysteresis=1", "train.initial_loss_scale=1e30"])
    trainer = build(cfg, 2, 1, 2)
    state = trainer.init_state()
    before = jax.device_get((state.params, state.opt_state))
    state, metrics = trainer.train_step(state, trainer.put_batch(random_batch(0)))
    after = jax.device_get(state.params)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((after, jax.device_get(state.opt_state)))):
        np.testing.assert_array_equal(a, b)              # skipped: no weight, moment or count moved
    assert float(metrics["loss_scale"]) == float(np.float32(1e30) / 2) and int(metrics["skipped_steps"]) == 1
    assert int(state.step) == 1 and int(state.data_position) == 8    # as Megatron's iteration, the batch is used up
    before = before[0]

    # a sane scale takes the step; its loss is the fp32 reference's up to fp16 rounding
    sane = state.loss_scale.replace(scale=jax.device_put(jnp.float32(1024.0), state.loss_scale.scale.sharding))
    state, metrics = trainer.train_step(state.replace(loss_scale=sane), trainer.put_batch(random_batch(0)))
    assert int(metrics["skipped_steps"]) == 1 and float(metrics["loss_scale"]) == 1024.0
    # the lr it reports is the one it applies: the schedule at the steps applied so far (0), as
    # the optimizer's count stood still at the skipped step; not at the steps taken (1)
    lr = learning_rate(cfg)
    assert float(metrics["lr"]) == pytest.approx(float(lr(0)), rel=1e-6) and float(lr(0)) != float(lr(1))
    ref_loss = reference.loss(jax.device_get(trainer.canonical(before)), random_batch(0), cfg.model, VOCAB)
    assert abs(float(metrics["loss"]) - float(ref_loss)) < 1e-2, (float(metrics["loss"]), float(ref_loss))
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(jax.device_get(state.params)))]
    assert sum(moved) > len(moved) // 2


RECOMPUTE_MODES = ["train.recompute=selective", "train.recompute=full"]


BLOCK_1 = "train.recompute=block train.recompute_layers=1"


# Each mode is one more compile, so the pipelined layout checks only what differs there: full
# and block with N = all of a stage's one layer (selective is the same code on every layout).
@pytest.mark.parametrize("data,pipe,tensor,sp,modes", ids=["tensor2-sp", "pipe2"], argvalues=[
    (1, 1, 2, True, [*RECOMPUTE_MODES, BLOCK_1]),
    (1, 2, 1, False, ["train.recompute=full", BLOCK_1])])
def test_every_recompute_mode_gives_the_gradients_of_none(data, pipe, tensor, sp, modes):
    """Same gradients, dropout on: every mode runs layer i with the same dropout key. Block mode
    with N = 1 of a stage's 2 layers (no pipeline) or of its 1 layer (pipe = 2); N = all
    layers is one run, as full, and is compared with full in the memory test below."""
    batch = random_batch(3)
    modes = ["train.recompute=none", *modes]
    grads = {}
    for mode in modes:
        extra = [*mode.split(), "model.dropout=0.1", "model.attention_dropout=0.1"]
        cfg = tiny_config("llama", tensor, pipe, data, sp, micro_batch=2, extra=extra)
        validate(cfg, data * pipe * tensor)
        trainer = build(cfg, data, pipe, tensor)
        state = trainer.init_state()
        grads[mode], _ = trainer.grad_fn(state.params, trainer.put_batch(batch), state.rng)
    for mode in modes[1:]:
        errs = leaf_errors(jax.device_get(grads[mode]), jax.device_get(grads[modes[0]]), skip=(ZERO_GRADIENT,))
        assert max(errs.values()) < 1e-6, (mode, errs)


def grad_temp_bytes(mode: str, n: int = 0) -> int:
    """XLA temp bytes of the compiled gradient function: a 4-layer GPT, one device, one micro-batch."""
    cfg = tiny_config(micro_batch=BATCH, extra=["model.num_layers=4", "model.hidden_size=64", "model.num_heads=4",
                                                f"train.recompute={mode}", f"train.recompute_layers={n}"])
    trainer = build(cfg, 1, 1, 1)
    params = jax.eval_shape(trainer.init_state).params
    batch, rng = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.uint32)
    return jax.jit(trainer.grad_fn).lower(params, batch, rng).compile().memory_analysis().temp_size_in_bytes


def test_block_recomputation_saves_memory_between_none_and_full():
    """Recomputing more of the first layers keeps fewer activations. N = 1 is left out: its
    remat run is one layer, a loop of one that XLA inlines, and then the recomputed layer's
    activations are scheduled alongside the other layers' (no saving on XLA:CPU)."""
    temp = [grad_temp_bytes("none"), grad_temp_bytes("block", 2), grad_temp_bytes("block", 3),
            grad_temp_bytes("full")]
    assert temp == sorted(temp, reverse=True) and len(set(temp)) == 4, temp
    assert grad_temp_bytes("block", 4) == temp[-1]                    # N = l is full


def test_layer_plans_and_offload_policies():
    """Block splits the stack into a recomputed run and a kept run; each (mode, offload) pair
    that validate lets through has a checkpoint policy (offload itself needs a GPU)."""
    full, none = REMAT_POLICIES["full", False], REMAT_POLICIES["none", False]
    assert layer_plan("block", 4, 1) == [(1, full), (3, none)]
    assert layer_plan("block", 4, 4) == [(4, full)] and layer_plan("block", 4, 0) == [(4, none)]
    assert layer_plan("block", 4, 1, offload=True)[1][1] is REMAT_POLICIES["none", True]
    for mode in ("none", "selective"):
        assert callable(REMAT_POLICIES[mode, True])
    for pipe in (1, 2):   # CPU: refused, with or without pipelining
        with pytest.raises(ConfigError, match="train.offload_activations: needs host memory on an accelerator"):
            validate(tiny_config(pipe=pipe, extra=["train.offload_activations=true"]), pipe)
    with pytest.raises(ConfigError, match="train.recompute_layers"):
        validate(tiny_config(pipe=2, extra=["train.recompute=block", "train.recompute_layers=2"]), 2)


def host_placements(trainer) -> dict:
    """{memory kind: count} of the buffer-placement annotations in the train step as lowered for
    a CUDA GPU (jax.export lowers for a platform it is not running on; XLA:CPU would drop them)."""
    import collections
    import re

    from mtjax.inspect import abstract_state
    from mtjax.training.step import batch_sharding
    batch = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32, sharding=batch_sharding(trainer.mesh))
    exported = jax.export.export(trainer.train_step, platforms=["cuda"])(abstract_state(trainer), batch)
    return collections.Counter(re.findall(r'_xla_buffer_placement = "(\w+)"', exported.mlir_module()))


# none (its policy's placements and gradients) and block (the offloaded kept run beside a recomputed
# one); the cut selective is the other offload policy on the same path (both policies:
# test_layer_plans_and_offload_policies).
@pytest.mark.parametrize("mode", ["none", "block"])
def test_offload_moves_residuals_to_host_in_the_gpu_program(mode):
    """With offload_activations the GPU lowering of the step sends residuals to pinned host memory
    and back (not proven here: that the GPU's memory drops, which needs one); without it, nothing
    moves. On CPU (where the moves are no-ops) the gradients are those of plain `none`."""
    import dataclasses
    extra = [f"train.recompute={mode}"] + (["train.recompute_layers=1"] if mode == "block" else [])
    base = tiny_config(tensor=2, data=2, extra=extra)
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, offload_activations=True))
    offload, plain = build(cfg, 2, 1, 2), build(base, 2, 1, 2)
    moved = host_placements(offload)
    assert moved["pinned_host"] > 0 and moved["device"] >= moved["pinned_host"], moved
    assert host_placements(plain)["pinned_host"] == 0
    if mode in ("none", "selective"):        # the two offload policies
        reference = build(tiny_config(tensor=2, data=2), 2, 1, 2)
        params, rng = reference.init_state().params, jnp.zeros(2, jnp.uint32)
        batch = random_batch(3)
        got, _ = offload.grad_fn(params, offload.put_batch(batch), rng)
        want, _ = reference.grad_fn(params, reference.put_batch(batch), rng)
        errs = leaf_errors(got, want, skip=(ZERO_GRADIENT,))
        assert max(errs.values()) < 1e-6, errs


# none only: with pipe > 1 the stash goes to the host whatever the layers' policy (the cut selective
# offloads nothing more of its own).
@pytest.mark.parametrize("mode", ["none"])
def test_pipelined_offload_keeps_the_stash_on_the_host_in_the_gpu_program(mode):
    """With pipe > 1 the executor's stash ring is what goes to pinned host memory (the layers'
    own checkpoint policy then offloads nothing: their residuals leave as the stash): the CUDA
    lowering of the step places buffers on the host and back, plain pipelining places none, and
    on CPU (where the moves are no-ops) the gradients are plain pipelining's."""
    import dataclasses
    base = tiny_config(pipe=2, extra=[f"train.recompute={mode}"])
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, offload_activations=True))
    offload, plain = build(cfg, 1, 2, 1), build(base, 1, 2, 1)
    moved = host_placements(offload)
    assert moved["pinned_host"] > 0 and moved["device"] > 0, moved
    assert host_placements(plain)["pinned_host"] == 0
    params, rng, batch = plain.init_state().params, jnp.zeros(2, jnp.uint32), random_batch(5)
    # under jit, as the train step runs it (eager shard_map refuses a move to a memory space)
    got, _ = jax.jit(offload.grad_fn)(params, offload.put_batch(batch), rng)
    want, _ = jax.jit(plain.grad_fn)(params, plain.put_batch(batch), rng)
    errs = leaf_errors(got, want, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < 1e-6, errs


def test_validation_evaluates_the_16_bit_weights_the_step_computes_with():
    """bf16: `eval_step` (val_loss) runs the model on the master weights' bf16 copy, as the train
    step, `mtjax.load` and Megatron's 16-bit model do, not on the fp32 master. A norm scale of
    1.003 is 1 in bf16, so evaluating the master instead gives another loss. Distributed
    optimizer at data 2: the master is split where the compute copy is whole."""
    cfg = tiny_config(extra=["train.precision=bf16", "parallel.distributed_optimizer=true", "train.micro_batches=1"],
                      data=2)
    trainer = build(cfg, 2, 1, 1)
    state = trainer.init_state()
    scale = state.params["ln_final"]["scale"]
    master = {**state.params, "ln_final": {**state.params["ln_final"],
                                           "scale": jax.device_put(scale * 1.003 + 0.05, scale.sharding)}}
    batch = trainer.put_batch(random_batch(0))
    run_model = jax.jit(trainer.loss_fn)
    computed = float(run_model(trainer.compute_params(master), batch))
    assert float(trainer.eval_step(master, batch)) == computed
    assert float(run_model(master, batch)) != computed         # the test tells the two apart


def bias_alone_chooses(extra):
    """(trainer, state, bias [l, E]) of a Llama with 4 top-1 sigmoid experts whose router weights
    are 0 (every score 0.5) and whose balancing biases 0.300 .. 0.303 alone choose the expert."""
    cfg = tiny_config("llama", extra=["model.num_experts=4", "model.moe_top_k=1", "model.moe_score=sigmoid",
                                      "model.moe_router_bias=true", *extra])
    trainer = build(cfg, 1, 1, 1)
    state = trainer.init_state()
    moe = state.params["layers"]["moe"]
    bias = np.broadcast_to(np.asarray([0.300, 0.301, 0.302, 0.303], np.float32), moe["bias"].shape)
    moe = {**moe, "router": jnp.zeros_like(moe["router"]), "bias": jax.device_put(bias, moe["bias"].sharding)}
    return trainer, state.replace(params={**state.params, "layers": {**state.params["layers"], "moe": moe}}), bias


def test_the_router_bias_chooses_in_fp32_under_bf16():
    """The aux-loss-free bias stays fp32 in the 16-bit compute copy, as Megatron keeps its
    `expert_bias` fp32 (bf16's spacing near 0.3 is 2^-9, coarser than a bias step of 1e-3). Router
    weights 0 make every score 0.5, so the bias alone chooses: in fp32 expert 3 (0.303) takes every
    token and its bias steps down; rounded to bf16, 0.302 and 0.303 tie and expert 2 would."""
    trainer, state, bias = bias_alone_chooses(["train.precision=bf16", "optim.lr=0"])
    state, _ = trainer.train_step(state, trainer.put_batch(random_batch(0)))
    moved = np.sign(np.asarray(state.params["layers"]["moe"]["bias"]) - bias)
    np.testing.assert_array_equal(moved, np.broadcast_to([1.0, 1.0, 1.0, -1.0], moved.shape))


def test_the_router_bias_moves_on_a_step_skipped_for_overflow():
    """fp16 with a static loss scale that overflows the gradients: the optimizer step is skipped
    (every weight as it was) and S stays, but the balancing bias still follows the forward's loads,
    as Megatron moves its `expert_bias` in finalize_model_grads before the optimizer sees the
    overflow. Router weights 0 and the bias alone choosing (as above): expert 3 takes every
    token, so its bias steps down and the others' up."""
    trainer, state, bias = bias_alone_chooses(["train.precision=fp16", f"train.loss_scale={2.0 ** 100}"])
    before = jax.device_get(state.params)                   # the step donates its state
    new, metrics = trainer.train_step(state, trainer.put_batch(random_batch(0)))
    assert int(metrics["skipped_steps"]) == 1 and np.isfinite(float(metrics["loss"]))
    assert float(metrics["loss_scale"]) == 2.0 ** 100                    # static: not halved
    moved = np.sign(np.asarray(new.params["layers"]["moe"]["bias"]) - bias)
    np.testing.assert_array_equal(moved, np.broadcast_to([1.0, 1.0, 1.0, -1.0], moved.shape))
    old_leaves, new_leaves = jax.tree.leaves_with_path(before), jax.tree.leaves_with_path(new.params)
    for (path, old), (_, kept) in zip(old_leaves, new_leaves):
        if "bias" not in jax.tree_util.keystr(path) or "moe" not in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(np.asarray(kept), np.asarray(old), err_msg=jax.tree_util.keystr(path))

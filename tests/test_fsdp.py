"""FSDP (`parallel.fsdp`, ZeRO-3): the layer stack held as shards over data x context, each layer
gathered inside the layer scan and its gradient reduce-scattered in the backward, computes what
one device computes.

Oracle: tests/reference.py (fp32, relative error < 1e-5): the loss, every gradient leaf and one
AdamW step on each layout, one compiled step each:
  data 4 (GPT, recompute none, m = 1), also three steps and, from the same compiled program, each
    layer leaf's bytes per gather and reduce-scatter;
  data 2 x context 2 x pipe 2 1F1B (Llama, selective, kept gathered, gathered per micro-batch,
    m = 2), also the eval step through the stages;
  data 2 x pipe 2, m = 2, each stage's layers gathered once per step (`fsdp_pipeline_gather`
    step): 1F1B (GPT, l = 8, the data reduction overlapped in the last tick; also the eval step) and
    interleaved (Llama, v = 2, l = 4; loss and gradients), also the collectives of the compiled
    program: one all-gather and one reduce-scatter's bytes per layer leaf and step;
  data 2 x pipe 2 zbv (Llama, l = 4; loss and gradients), gathered per micro-batch (the W slot's
    reduce-scatter);
  data 2 x pipe 2 zb (GPT, dense, full recomputation, gathered per step; loss and gradients);
  data 2 x pipe 2 zb x tensor 2 + SP (Llama, full, m = 4, with experts, gathered per step):
    tests/test_moe.py's `e2_pipe2_zb_tensor2_sp_llama_fsdp_full_m4_shared_sigmoid_bias`.
(`logits_fn` gathers the weights whole: not fsdp's path, and not compared here.) The state (and so
a checkpoint) is the distributed optimizer's; the peak memory is the formula's; bad input is one line.
"""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import reference
from layouts import VOCAB, ZERO_GRADIENT, applied_gradients, build, clipped, leaf_errors, random_batch, tiny_config
from mtjax.config import ConfigError, load_config, validate
from test_equivalence import assert_step_matches

TOL = 1e-5
reference_value_and_grad = jax.jit(jax.value_and_grad(reference.loss), static_argnums=(2, 3))
CONSTANT_LR = ["optim.min_lr=0.001"]     # = optim.lr: three steps against a constant-rate reference


def fsdp_config(arch, data, pipe, tensor, sp, context, extra=()):
    extra = ["parallel.fsdp=true", f"parallel.context={context}", *CONSTANT_LR, *extra]
    micro_batch = None if any(e.startswith("train.micro_batches") for e in extra) else 2   # None: m's b
    cfg = tiny_config(arch, tensor, pipe, data, sp, micro_batch=micro_batch, extra=extra)
    validate(cfg, data * pipe * tensor * context)
    return cfg


WIDER = ["model.hidden_size=128", "model.num_heads=4"]     # the memory check's model


def reference_adamw(cfg, params):
    """optax's AdamW (+ global-norm clip, decay on all but norms and biases): (init, jitted update)."""
    op = cfg.optim
    mask = jax.tree_util.tree_map_with_path(lambda p, _: p[-1].key not in ("bias", "scale"), params)
    tx = optax.chain(optax.clip_by_global_norm(op.clip_grad),
                     optax.adamw(op.lr, b1=op.beta1, b2=op.beta2, eps=op.eps, weight_decay=op.weight_decay, mask=mask))

    def update(grads, opt, params):   # one program, not an eager op per leaf shape
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt
    return jax.jit(tx.init)(params), jax.jit(update)


def test_data_4_matches_reference_for_three_steps_and_gathers_each_layer_whole():
    """data 4 (GPT, none, m = 1): the loss, every gradient leaf, one AdamW step and three, against
    the reference; then, from the same compiled step, `layer_collectives`."""
    cfg = fsdp_config("gpt", 4, 1, 1, False, 1)
    trainer = build(cfg, 4, 1, 1)
    assert trainer.plan.fsdp is not None and trainer.plan.distributed_optimizer
    state = trainer.init_state()
    params = jax.device_get(state.params)
    opt, update = reference_adamw(cfg, params)
    for step in range(3):
        batch = random_batch(seed=step)
        ref_loss, ref_grads = reference_value_and_grad(params, batch, cfg.model, VOCAB)
        state, metrics = trainer.train_step(state, trainer.put_batch(batch))
        if step == 0:    # the loss and every gradient the step applied
            assert abs(float(metrics["loss"]) - float(ref_loss)) / float(ref_loss) < TOL
            errs = leaf_errors(applied_gradients(trainer, state.opt_state), clipped(cfg, ref_grads),
                               skip=(ZERO_GRADIENT,))
            assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
        params, opt = update(ref_grads, opt, params)
        if step in (0, 2):   # one step, and three
            errs = leaf_errors(jax.device_get(state.params), params, skip=(ZERO_GRADIENT,))
            assert max(errs.values()) < TOL, (step, {k: v for k, v in errs.items() if v >= TOL})
    layer_collectives(trainer)


@pytest.mark.parametrize("arch,data,pipe,tensor,sp,context,extra,whole", [
    ("llama", 2, 2, 1, False, 2, ["parallel.schedule=1f1b", "parallel.fsdp_keep_gathered=true",
                                  "train.recompute=selective", "parallel.fsdp_pipeline_gather=microbatch"], True),
    # l 8: a zero-initialised fc1 bias entry's gradient near AdamW's eps (the step's check,
    # test_equivalence.STEP_ON_OWN_GRADIENTS)
    ("gpt", 2, 2, 1, False, 1, ["parallel.schedule=1f1b", "model.num_layers=8"], True),
    ("llama", 2, 2, 1, False, 1, ["parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                  "model.num_layers=4"], False),
    ("llama", 2, 2, 1, False, 1, ["parallel.schedule=zbv", "model.num_layers=4",
                                  "parallel.fsdp_pipeline_gather=microbatch"], False),
    ("gpt", 2, 2, 1, False, 1, ["parallel.schedule=zb", "train.recompute=full"], False),
], ids=["llama-data2-context2-pipe2-1f1b-kept-selective", "gpt-data2-pipe2-1f1b-step",
        "llama-data2-pipe2-interleaved-step", "llama-data2-pipe2-zbv-microbatch", "gpt-data2-pipe2-zb-full-step"])
def test_layout_matches_reference(arch, data, pipe, tensor, sp, context, extra, whole):
    """Each layout against the reference (`matches_reference`; `whole`: also the eval step and one
    AdamW step, which no schedule changes); a pipeline gathering once per step
    (`fsdp_pipeline_gather` step, the default) also gathers and reduce-scatters once per step
    (`stage_collectives`)."""
    cfg = fsdp_config(arch, data, pipe, tensor, sp, context, extra)
    trainer = build(cfg, data, pipe, tensor, context)
    assert trainer.plan.fsdp.axes == (("data", "context") if context > 1 else ("data",))
    assert trainer.plan.fsdp.per_step == (cfg.parallel.fsdp_pipeline_gather == "step")
    program = matches_reference(trainer, cfg, whole)
    if trainer.plan.fsdp.per_step:
        stage_collectives(trainer, program.as_text())


def matches_reference(trainer, cfg, whole: bool):
    """`test_equivalence.assert_matches_reference` but the logits (`logits_fn` gathers the weights
    whole: not fsdp's path) in canonical layer order: interleaved and zbv store the layers in run
    order (`Trainer.canonical`). The loss and every gradient leaf; with `whole`, the eval step's
    loss (through the stages) and one AdamW step. -> the compiled program that ran last (the train
    step, or the gradients' program), from jax's cache: not a second compile."""
    state = trainer.init_state()
    batch = random_batch()
    params = jax.device_get(trainer.canonical(state.params))
    ref_loss, ref_grads = reference_value_and_grad(params, batch, cfg.model, VOCAB)
    if not whole:
        args = (state.params, trainer.put_batch(batch), state.rng)
        grads, loss = trainer.grad_fn(*args)
        assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < TOL
        errs = leaf_errors(jax.device_get(trainer.canonical(grads)), ref_grads, skip=(ZERO_GRADIENT,))
        assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
        return trainer._grad_program.lower(*args, jnp.float32(1)).compile()
    assert abs(float(trainer.eval_step(state.params, trainer.put_batch(batch))) - float(ref_loss)) \
        < TOL * float(ref_loss)    # before the step, which donates the state
    assert_step_matches(trainer, cfg, state, batch, params, ref_loss, ref_grads)
    from mtjax.inspect import compile_train_step
    return compile_train_step(trainer)


def stage_collectives(trainer, hlo_text: str):
    """fsdp per step under a pipeline, from the compiled program (`docs/design.md`, "FSDP under a
    pipeline"): per layer leaf of the stage (n = v L layers, stacked [n, ...]), one all-gather over
    the replicas, of [n, ...], outside the tick loop (not m of them); its gradient reduce-scattered
    once: one [n, ..., size_k / r, ...] after the loop, or, where the last tick overlaps the data
    reduction (gpipe, 1f1b), L = n of one layer's slice inside that tick's layer scan: the same
    bytes. Every other collective over the replicas (the weights outside the stack) runs once."""
    from mtjax.hlo_report import collective_report
    from mtjax.training.grad_reduce import overlaps_data_reduction
    from mtjax.pipeline.executor import last_backward_reduces
    plan = trainer.plan
    ops = [o for o in collective_report(hlo_text, trainer.mesh)["ops"]
           if o["kind"] in ("all-gather", "reduce-scatter") and tuple(o["axes"]) == plan.replica_axes]
    counts = collections.Counter()
    for o in ops:
        counts[o["kind"], str(o["shapes"])] += o["multiplicity"]
    n, r = plan.layers_per_chunk * plan.virtual_stages, plan.replicas
    sunk = overlaps_data_reduction(plan) and last_backward_reduces(plan.schedule)
    expected = collections.Counter()
    name = lambda shape: f"['f32[{','.join(map(str, shape))}]']"  # noqa: E731
    for path, k in plan.fsdp.dims:
        assert k is not None, path            # r = 2 divides every leaf here
        leaf = plan.params.shapes["layers"]
        for key in path:
            leaf = leaf[key]
        stacked = [n, *leaf.shape[1:]]        # tensor 1: the stage's stack of the global leaf
        expected["all-gather", name(stacked)] += 1
        shard = list(stacked)
        shard[k + 1] //= r
        expected["reduce-scatter", name(shard[1:]) if sunk else name(shard)] += n if sunk else 1
    assert {key: counts[key] for key in expected} == expected, (counts, expected)
    layer = sum(int(np.prod(a.shape[1:])) for a in jax.tree.leaves(plan.params.shapes["layers"]))    # P_L
    moved = collections.Counter()
    for o in ops:
        if (o["kind"], str(o["shapes"])) in expected:
            moved[o["kind"]] += o["multiplicity"] * o["bytes"]     # a reduce-scatter's: its operand's
    assert moved == {"all-gather": 4 * n * layer, "reduce-scatter": 4 * n * layer}, moved    # fp32: w = 4
    others = [o for o in ops if (o["kind"], str(o["shapes"])) not in expected]     # the weights outside the stack
    assert all(o["multiplicity"] == 1 for o in others), others


def layer_collectives(trainer):
    """The compiled step (l = 2, m = 1): every all-gather or reduce-scatter of a layer leaf moves that
    leaf's one-layer bytes; per layer leaf at most 2 (n + 1) gathers (forward and backward, each
    one ahead), exactly n + 1 of a bias (the forward's: no backward reads it), and n + 1
    reduce-scatters (`docs/design.md`, "FSDP"). The train step already run is the program
    compiled here (jax's cache), not a second compile."""
    from mtjax.hlo_report import collective_report
    from mtjax.inspect import compile_train_step
    ops = collective_report(compile_train_step(trainer).as_text(), trainer.mesh)["ops"]
    counts = collections.Counter()
    for o in ops:
        counts[o["kind"], str(o["shapes"])] += o["multiplicity"]
    n, layer = trainer.plan.num_layers, jax.tree.map(lambda a: a.shape[1:], trainer.plan.params.shapes["layers"])
    whole = list(layer["mlp"]["fc1"]["kernel"])                            # [h, f]: one layer's fc1
    shard = list(whole)
    shard[dict(trainer.plan.fsdp.dims)["mlp", "fc1", "kernel"]] //= trainer.plan.data
    name = lambda shape: f"['f32[{','.join(map(str, shape))}]']"  # noqa: E731
    assert 1 <= counts["all-gather", name(whole)] <= 2 * (n + 1), counts
    assert counts["all-gather", name(layer["mlp"]["fc1"]["bias"])] == n + 1, counts    # one layer's [f]
    assert counts["reduce-scatter", name(shard)] == n + 1, counts     # reported by their result
    assert all(o["axes"] == ("data",) for o in ops if o["kind"] in ("all-gather", "reduce-scatter")), ops


def test_state_and_checkpoint_layout_is_the_distributed_optimizers():
    """fsdp changes where the step computes, not what persists: the TrainState's specs (and so its
    checkpoints, which any layout restores) equal the distributed optimizer's."""
    from mtjax.mesh import make_mesh
    from mtjax.training.trainer import Trainer
    mesh = make_mesh(4, 1, 1, jax.devices()[:4])
    base = ["parallel.data=4", "train.global_batch=8", "train.micro_batch=2", "model.num_layers=2",
            "model.hidden_size=32", "model.num_heads=8", "model.seq_len=16"]
    fsdp = Trainer(load_config(None, [*base, "parallel.fsdp=true"]), mesh, VOCAB)
    zero = Trainer(load_config(None, [*base, "parallel.distributed_optimizer=true"]), mesh, VOCAB)
    assert fsdp.specs == zero.specs
    assert fsdp.plan.compute_specs["layers"] == zero.plan.split.specs["layers"]


@pytest.mark.parametrize("overrides,devices,key,words", [
    (["parallel.fsdp=true", "parallel.data=1"], 1, "parallel.fsdp", "no effect"),
    (["parallel.fsdp_keep_gathered=true", "parallel.data=2"], 2, "parallel.fsdp_keep_gathered", "parallel.fsdp=true"),
    (["parallel.fsdp=true", "parallel.data=2", "parallel.tensor=4", "parallel.tensor_grid=2d", "train.micro_batch=4"],
     8, "parallel.fsdp", "tensor_grid=2d"),
    (["parallel.fsdp=true", "parallel.data=2", "train.offload_activations=true"], 2, "parallel.fsdp",
     "offload_activations"),
    (["parallel.fsdp=true", "parallel.data=2", "parallel.fsdp_pipeline_gather=microbatch"], 2,
     "parallel.fsdp_pipeline_gather", "parallel.pipe > 1"),
    (["parallel.fsdp=true", "parallel.data=2", "parallel.pipe=2", "parallel.fsdp_pipeline_gather=layer"], 4,
     "parallel.fsdp_pipeline_gather", "must be one of step, microbatch"),
    (["parallel.fsdp=true", "parallel.data=2", "parallel.pipe=2", "parallel.fsdp_keep_gathered=true"], 4,
     "parallel.fsdp_keep_gathered", "fsdp_pipeline_gather=microbatch"),
])
def test_bad_fsdp_settings_are_one_line(overrides, devices, key, words):
    cfg = load_config(None, ["train.global_batch=8", "train.micro_batch=1", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, devices)
    assert e.value.key == key and "\n" not in str(e.value) and words in str(e.value), str(e.value)


def peak_formula(plan, layer_params: int, shared_params: int) -> float:
    """docs/design.md, "FSDP": state + gradient shards + l layers' activations + two gathered
    layers and one layer gradient + the weights outside the stack (compute copy and gradient) + the
    logits, their softmax and gradient; at m > 1 also the micro-batch loop's fp32 gradient sums,
    of the shards and of the weights outside the stack (fp32 here: w = 4)."""
    from mtjax.activations import korthikanti_bytes
    r, w, b, s, l = plan.replicas, 4, plan.micro_batch, plan.seq_len, plan.num_layers
    h, a = plan.layout.model.hidden_size, plan.layout.model.num_heads
    total = l * layer_params + shared_params
    activations = l * korthikanti_bytes(s, b, h, a, mode=plan.recompute.mode, width=w, dropout=False)
    sums = (4 * total / r + 4 * shared_params) if plan.micro_batches > 1 else 0
    return (12 + 4) * total / r + activations + (2 * w + 4) * layer_params + (w + 4) * shared_params \
        + 3 * 4 * b * s * plan.padded_vocab + sums


@pytest.mark.parametrize("layers,micro_batches", [(4, 1), (8, 1), (4, 2)])
def test_peak_memory_is_the_formula(layers, micro_batches):
    """XLA's memory analysis of the compiled step (arguments + temporaries) within 3% of
    `peak_formula` (d = 4; h = 128, where the weights' terms outweigh the fixed ones; compiled, not
    run). At m = 2 the loops' first gathers read the micro-batch (`fsdp_scan._after`); read off
    the shards alone, XLA hoisted them out of the micro-batch loop and held the two gathered
    layers and their copies through the step (+30% at l = 4)."""
    from mtjax.inspect import compile_train_step
    t = build(fsdp_config("gpt", 4, 1, 1, False, 1, [*WIDER, f"model.num_layers={layers}",
                                                     f"train.micro_batches={micro_batches}"]), 4, 1, 1)
    assert t.plan.micro_batches == micro_batches
    m = compile_train_step(t).memory_analysis()
    shapes = t.plan.params.shapes
    layer = sum(int(np.prod(a.shape[1:])) for a in jax.tree.leaves(shapes["layers"]))
    shared = sum(int(np.prod(a.shape)) for k, v in shapes.items() if k != "layers" for a in jax.tree.leaves(v))
    measured, formula = m.argument_size_in_bytes + m.temp_size_in_bytes, peak_formula(t.plan, layer, shared)
    assert abs(measured - formula) < 0.03 * formula, (layers, micro_batches, measured, formula)


def test_a_checkpoint_moves_between_fsdp_and_the_distributed_optimizer(tmp_path):
    """Saved with fsdp at data 4, restored with the distributed optimizer at (data 2, pipe 2, tensor 2), saved
    there and restored with fsdp again: the same parameters and optimizer state, bitwise; loaded for
    generation (one device), the same parameters."""
    from mtjax.checkpoint import Checkpointer
    from test_checkpoint import config, vocab_rows

    fsdp_cfg = config(tmp_path / "a", 2, 4, 1, 1, ["parallel.fsdp=true"])
    zero_cfg = config(tmp_path / "a", 2, 2, 2, 2, ["parallel.distributed_optimizer=true"])
    back_cfg = config(tmp_path / "b", 2, 4, 1, 1, ["parallel.fsdp=true"])
    trainer, ck = build(fsdp_cfg, 4, 1, 1), Checkpointer(fsdp_cfg)
    state = trainer.init_state(seed=3)
    expected = vocab_rows(jax.device_get((trainer.canonical(state.params), state.opt_state)), VOCAB)
    ck.save(state, trainer)
    ck.close()
    import mtjax     # generation (and to-hf, init_from: `checkpoint/params.py`) reads the parameters alone
    loaded = mtjax.load(str(tmp_path / "a"))
    for a, b in zip(jax.tree.leaves(vocab_rows(jax.device_get(loaded.params), VOCAB)), jax.tree.leaves(expected[0]),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    for cfg, other, save_to in ((zero_cfg, build(zero_cfg, 2, 2, 2), back_cfg), (back_cfg, trainer, None)):
        ck = Checkpointer(cfg)
        restored = ck.restore(0, other)
        ck.close()
        got = vocab_rows(jax.device_get((other.canonical(restored.params), restored.opt_state)), VOCAB)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(a, b)
        if save_to is not None:
            ck = Checkpointer(save_to)
            ck.save(restored, other)
            ck.close()

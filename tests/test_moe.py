"""Mixture of experts against the plain reference (tests/reference.py `moe`, a loop over the
experts with the capacity rule written out), fp32, 1e-5: the loss, every gradient leaf of the
objective (auxiliary losses included) that one AdamW step applied, the step (with the aux-loss-free
bias update), the auxiliary losses' reported value and the routing statistics (each layer's load
ratio, the share dropped) on e = 4 (GPT, 1F1B, experts stored split over data, two dense layers
before the MoE layers, run by the first stage with the embedding) and e = 2
(Llama, zb, tensor 2 + SP, fsdp, full recomputation, m = 4, gated shared expert, sigmoid scores with a
bias, units of [MoE, dense] layers: `model/layer_pattern.py`) and e = 2 over context 2 (Llama, tensor 2 + SP with
`tensor_overlap` and half batches, a capacity ranked over the whole row across the context ranks:
the experts split over the context ranks, each sequence's tokens dispatched from both halves of its
load-balanced split); a dense prefix on pipe 2 interleaved (e = 2, selective recomputation); a
dense prefix and a unit [dense, MoE] in the one-device capacity test, and zbv storing units in its run order; e = 1 with the capacity
rule on one device (the tokens a capacity of 1.0 drops under a skewed
router); an e = 4 checkpoint (a dense prefix and units) restored at e = 1 and e = 2 (e < d: experts
whole, all-to-all in groups) and evaluated, and greedy generation from it (one device, pipe 2 x
tensor 2); the all-to-all count and bytes and the
executed FLOPs of a compiled step, and of a pipelined dense prefix's backward (from its stash, not
recomputed); fp16's loss scale reaching the auxiliary losses; packed
fine-tuning rows with padding (routed nowhere, outside the losses and statistics: `padded_rows`) on
pipe 2 x tensor 2 + SP x data 2 and context 2 x tensor 2 x data 2 under a capacity, and which
tokens are padding; the exact capacity ceiling; the one-line
refusals; zb's B program (traced) leaving the expert,
router and shared-gate weight gradients to W, and W's placement of a rank's experts in a whole leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from layouts import (BATCH, SEQ, VOCAB, ZERO_GRADIENT, applied_gradients, build, clipped, leaf_errors, random_batch,
                     tiny_config)
from mtjax.config import ConfigError, load_config, validate
from mtjax.model.moe import route
from mtjax.model.transformer import Transformer
from mtjax.parallel.context import ParallelContext
from mtjax.training.moe_stats import moe_layers
from mtjax.training.packing import NO_LOSS
from test_equivalence import reference_adamw_step

TOL = 1e-5
# one program each (not the eager pullback's two, nor an eager optax op per leaf shape)
reference_value_and_grad = jax.jit(jax.value_and_grad(reference.objective, has_aux=True), static_argnums=(2, 3))
reference_step = jax.jit(reference_adamw_step, static_argnums=0)
STATS = "['layers']['moe']['stats']"    # routing sums, not a gradient (`training/moe_stats.py`)
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=48", "model.moe_aux_loss_coeff=0.01",
       "model.moe_z_loss_coeff=0.001"]

# 4 layers, MoE every 2nd: units [MoE, dense] (`model/layer_pattern.py`), one a stage
EVERY_2ND = ["model.num_layers=4", "model.moe_layer_freq=2"]
# 4 layers, the first 2 dense (DeepSeek's first-k-dense): on a pipeline the prefix runs with the
# embedding on the first stage, and each stage holds 1 of the 2 MoE layers
DENSE_PREFIX = ["model.num_layers=4", "model.moe_first_dense=2"]

# (data, pipe, tensor, sp, arch, extra): one compiled step each. e = 1 is the capacity test's
# (one device); e = 2 of d = 4 (expert groups) the checkpoint test's evaluation. 1F1B without fsdp
# runs the data reduction in its last tick, where the idle stage's backward has a zero cotangent
# (`model/moe.py` `attach`). The zb case is also tests/test_fsdp.py's fsdp proof for data 2 x
# pipe 2 zb, data 2 x tensor 2 + SP, Llama, recompute full and m = 4 (8 rows / data 2 / b 1); its
# layers are units of an MoE and a dense layer.
LAYOUTS = {
    "e4_pipe2_1f1b_gpt_dense_prefix": (4, 2, 1, False, "gpt", ["parallel.expert=4", "parallel.schedule=1f1b",
                                                              *DENSE_PREFIX]),
    # interleaved: the prefix stash's slots are coloured over virtual stage 0's micro-batches alone,
    # fewer than the stash's (`buffers.plan_buffers`)
    "e2_pipe2_interleaved_llama_dense_prefix_selective": (2, 2, 1, False, "llama", [
        "parallel.expert=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", "model.num_layers=6",
        "model.moe_first_dense=2", "train.recompute=selective"]),
    "e2_pipe2_zb_tensor2_sp_llama_fsdp_full_m4_shared_sigmoid_bias_freq2": (
        2, 2, 2, True, "llama", ["parallel.expert=2", "parallel.schedule=zb", "model.moe_shared_expert_size=32",
                                 "model.moe_shared_expert_gate=true",
                                 "model.moe_score=sigmoid", "model.moe_router_bias=true", "parallel.fsdp=true",
                                 "train.recompute=full", *EVERY_2ND]),
    # the attention's rings (`tensor_overlap`) around the experts' own gather and reduce-scatter;
    # each micro-batch as two halves (`half_batch_overlap`: routing, capacity and the auxiliary
    # losses are per row, so the halves route as the whole does); a capacity (C = 4 of a row's 32
    # entries over 4 experts: tokens dropped) ranked over the whole row, across the context ranks.
    # The all-gather attention: the ring's (no bearing on the experts) tripled the compile
    "e2_context2_tensor2_overlap_halves_capacity_llama": (1, 1, 2, True, "llama", [
        "parallel.expert=2", "parallel.context=2", "parallel.context_attention=all_gather", "parallel.tensor_overlap=true",
        "parallel.half_batch_overlap=true", "train.micro_batch=2", "model.moe_capacity_factor=0.5"]),
    # every expert chosen by every token: all loads equal the mean, so the router bias must not
    # move; with E = 3 the mean sum / E rounds and XLA's multiply-add gave each expert +rate
    "one_device_three_experts_top3_router_bias": (1, 1, 1, False, "llama", [
        "model.num_experts=3", "model.moe_top_k=3", "model.moe_score=sigmoid", "model.moe_router_bias=true"]),
    # packed fine-tuning rows with padding (`padded_rows`): the padding routed nowhere, outside the
    # auxiliary losses and the statistics; each stage reads it off its micro-batch's tokens
    "packed_padding_e2_pipe2_1f1b_tensor2_sp_gpt": (2, 2, 2, True, "gpt", [
        "parallel.expert=2", "parallel.schedule=1f1b", "data.document_masking=true"]),
    # and under a capacity ranked across the context ranks (padding would take slots and drop real tokens)
    "packed_padding_e4_context2_tensor2_capacity_llama": (2, 1, 2, True, "llama", [
        "parallel.expert=4", "parallel.context=2", "parallel.context_attention=all_gather", "train.micro_batch=2",
        "data.document_masking=true", "model.moe_capacity_factor=0.5"]),
}
EOD = 7     # the packed layouts' end-of-document id


def padded_rows(seed=0):
    """[B, s + 1] packed fine-tuning rows: samples (prompt tokens marked NO_LOSS, a response ending in
    EOD), then padding EOD | NO_LOSS to s + 1 tokens. Two samples and 3 pads; one and 12; a full
    row; a cut sample (no EOD) and 8, the first of which ends its document (not padding); prompts
    opening with EOD | NO_LOSS (a BOS that is the EOD id: not padding); a sample without a prompt."""
    rng = np.random.RandomState(seed)

    def tok(n):
        return [int(t) for t in rng.randint(EOD + 1, VOCAB, n)]

    def prompt(n):
        return [t | NO_LOSS for t in tok(n)]
    bos = [EOD | NO_LOSS]
    rows = [prompt(3) + tok(4) + [EOD] + prompt(2) + tok(4) + [EOD], prompt(2) + tok(2) + [EOD],
            prompt(5) + tok(11) + [EOD], prompt(3) + tok(6),
            bos + prompt(2) + tok(2) + [EOD] + bos + prompt(1) + tok(3) + [EOD],
            tok(4) + [EOD] + prompt(6) + tok(5) + [EOD], prompt(1) + tok(1) + [EOD],
            prompt(4) + tok(7) + [EOD] + prompt(1) + tok(1) + [EOD]]
    return np.asarray([r + bos * (SEQ + 1 - len(r)) for r in rows], np.int32)


@pytest.mark.parametrize("name", LAYOUTS)
def test_expert_parallel_layout_matches_reference(name):
    data, pipe, tensor, sp, arch, extra = LAYOUTS[name]
    cfg = tiny_config(arch, tensor, pipe, data, sp, micro_batch=1, extra=MOE + extra)
    trainer = build(cfg, data, pipe, tensor, cfg.parallel.context, eod=EOD)
    if cfg.parallel.fsdp:
        assert trainer.plan.fsdp.axes == ("data",) and trainer.plan.micro_batches == 4
    matches_moe_reference(trainer, cfg)


def matches_moe_reference(trainer, cfg):
    """One step of `trainer` (an MoE model) against the reference: the loss, every applied gradient,
    the auxiliary losses, each layer's load ratio and the dropped share, and the AdamW step (on the
    step's own gradients) with the router-bias update (a drawn bias, so that it changes the
    choice). Also the layout fuzzer's check (tests/fuzz_layouts.py)."""
    state = trainer.init_state()
    if cfg.model.moe_router_bias:   # a bias that changes the choice
        bias = state.params["layers"]["moe"]["bias"]
        drawn = jax.device_put(0.3 * jax.random.normal(jax.random.key(3), bias.shape), bias.sharding)
        state = state.replace(params={**state.params, "layers": {**state.params["layers"], "moe": {
            **state.params["layers"]["moe"], "bias": drawn}}})
    packed = cfg.data.document_masking
    batch = padded_rows() if packed else random_batch()
    rows = reference.packed_rows(batch, trainer.plan.eod) if packed else None    # (loss weights, docs)
    params = jax.device_get(trainer.canonical(state.params))     # interleaved: stored in run order
    (ref_objective, ref_loss), ref_grads = reference_value_and_grad(params, batch, cfg.model, VOCAB, rows)
    docs = None if rows is None else rows[1]
    routing = reference.routing(params, batch[:, :-1] & (NO_LOSS - 1), cfg.model, VOCAB, docs)
    loads = np.stack([np.asarray(routed, np.float64) for routed, _ in routing])     # [l, E]
    step_bias = (cfg.model.moe_router_bias_rate * np.sign(loads.mean(-1, keepdims=True) - loads)
                 if cfg.model.moe_router_bias else None)
    # the step's own gradients, read from AdamW's first moment (one compile: no grad_fn)
    new_state, metrics = trainer.train_step(state, trainer.put_batch(batch))
    assert abs(float(metrics["loss"]) - float(ref_loss)) / float(ref_loss) < TOL
    grads = applied_gradients(trainer, new_state.opt_state)
    errs = leaf_errors(grads, clipped(cfg, ref_grads), skip=(ZERO_GRADIENT, STATS))
    assert max(errs.values()) < TOL, ("applied gradients", {k: v for k, v in errs.items() if v >= TOL})
    aux = float(metrics["moe_aux_loss"] + metrics["moe_z_loss"])
    assert aux > 0 and abs(aux - float(ref_objective - ref_loss)) < TOL * float(ref_objective)
    # the routing statistics, summed over every rank, are the reference's: each layer's load
    # ratio and the share of routes dropped for capacity
    ratios = [float(metrics[f"moe_load_max_over_mean/{i}"]) for i in moe_layers(cfg.model)]
    np.testing.assert_allclose(ratios, loads.max(-1) / loads.mean(-1), rtol=1e-6)
    dropped = 1.0 - sum(float(kept) for _, kept in routing) / loads.sum()
    m = cfg.model
    if m.moe_capacity_factor:   # E experts of C = ceil(f s k / E) places hold fewer than a row's s k routes: some drop
        places = m.num_experts * reference.expert_capacity(m, SEQ)
        assert (0 < dropped < 1) if places < SEQ * m.moe_top_k else (0 <= dropped < 1), dropped
    else:
        assert dropped == 0.0, dropped
    assert abs(float(metrics["moe_dropped"]) - dropped) < 1e-6, (float(metrics["moe_dropped"]), dropped)
    # AdamW on the step's own gradients (just checked against the reference's): its first step is
    # lr g / (|g| + eps) per entry, so an entry with |g| near eps turns a rounding of g far below
    # the leaf's scale into a step difference of 1e-5 (a 6-layer Llama's dense fc2: 6.4e-10
    # against 4.9e-10 where the leaf's median is 3.7e-4)
    expected = jax.device_get(reference_step(cfg, params, grads))
    if step_bias is not None:   # aux-loss-free balancing: after the optimizer, from the global loads
        expected["layers"]["moe"]["bias"] = expected["layers"]["moe"]["bias"] + step_bias
    errs = leaf_errors(jax.device_get(trainer.canonical(new_state.params)), expected, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, ("AdamW step", {k: v for k, v in errs.items() if v >= TOL})

def test_fp16_scales_the_auxiliary_losses_as_the_loss():
    """fp16 with a loss scale S = 2^10 and auxiliary losses that dominate the router's gradient:
    every gradient one step applied (divided by S again) is the fp32 reference's up to fp16
    rounding, the router's included. Given the cotangent 1 instead of S (`attach`), the auxiliary
    losses' share would come out S times too small. GPT, data 2, experts split over them. Then an
    overflowing S: the step is skipped and the routing statistics are still reported."""
    cfg = tiny_config("gpt", data=2, micro_batch=2, extra=MOE + [
        "parallel.expert=2", "train.precision=fp16", "train.initial_loss_scale=1024",
        "model.moe_aux_loss_coeff=1.0", "model.moe_z_loss_coeff=0.1"])
    trainer = build(cfg, 2, 1, 1)
    state = trainer.init_state()
    batch = random_batch()
    params = jax.device_get(trainer.canonical(state.params))
    (_, ref_loss), ref_grads = reference_value_and_grad(params, batch, cfg.model, VOCAB)
    new_state, metrics = trainer.train_step(state, trainer.put_batch(batch))
    assert int(metrics["skipped_steps"]) == 0 and float(metrics["loss_scale"]) == 1024.0
    assert abs(float(metrics["loss"]) - float(ref_loss)) < 1e-2 * float(ref_loss)
    errs = leaf_errors(applied_gradients(trainer, new_state.opt_state), clipped(cfg, ref_grads),
                       skip=(ZERO_GRADIENT, STATS))
    assert max(errs.values()) < 2e-2, {k: v for k, v in errs.items() if v >= 2e-2}
    # an overflowing scale: the step is skipped, and the routing statistics are still reported
    # (a non-finite cotangent is a real backward for `attach`)
    huge = new_state.loss_scale.replace(scale=jax.device_put(jnp.float32(2.0 ** 60), new_state.loss_scale.scale.sharding))
    _, metrics = trainer.train_step(new_state.replace(loss_scale=huge), trainer.put_batch(batch))
    assert int(metrics["skipped_steps"]) == 1
    assert float(metrics["moe_dropped"]) == 0.0 and 1.0 <= float(metrics["moe_load_max_over_mean"]) < 4.0


FIRST_DENSE = ["model.num_layers=4", "model.moe_layer_freq=2", "model.moe_first_dense=3"]
PREFIX_UNITS = ["model.num_layers=6", "model.moe_layer_freq=2", "model.moe_first_dense=3"]   # P = 2, 2 units


def one_device(extra):
    """The model at e = 1 on one device with the auxiliary losses on, its parameters, a batch."""
    cfg = tiny_config("llama", extra=MOE + extra)
    model = Transformer(cfg.model, 384, ParallelContext(batch_rows=BATCH))
    batch = random_batch()
    params = jax.jit(model.init)(jax.random.key(0), batch[:, :-1])["params"]     # one compile, not one per op
    return cfg, model, jax.tree.map(lambda w: w.value if hasattr(w, "value") else w, params,
                                    is_leaf=lambda w: hasattr(w, "value")), batch


def test_capacity_drops_what_the_reference_drops():
    """Capacity 1.0 (C = s k / E = 8 of 16 tokens) under a router skewed to expert 0: the slots
    kept are the reference's rule, tokens are dropped, and the model with those drops matches the
    reference (logits, objective gradients) at e = 1. The model has dense layers among its MoE
    layers: layers 0-2 dense, 3 MoE, stored as a dense prefix of 2 and a unit [dense, MoE]."""
    cfg, model, params, batch = one_device(["model.moe_capacity_factor=1.0", *FIRST_DENSE])
    router = params["layers"]["moe"]["router"]
    params["layers"]["moe"]["router"] = np.asarray(router).copy()
    params["layers"]["moe"]["router"][:, :, 0] += 3.0 * np.sign(np.asarray(router)[:, :, 1])   # skewed

    logits = jax.random.normal(jax.random.key(1), (BATCH, SEQ, 4)).at[..., 0].add(2.0)
    r = jax.jit(route, static_argnums=(1, 2))(logits, cfg.model, ParallelContext())
    kept = np.zeros((BATCH, SEQ, 4), bool)
    ex, ok = np.asarray(r.expert).reshape(BATCH, SEQ, 2), np.asarray(r.pos < r.capacity).reshape(BATCH, SEQ, 2)
    for j in range(2):
        np.put_along_axis(kept, ex[..., j:j + 1], ok[..., j:j + 1], axis=-1)
    routed = np.zeros((BATCH, SEQ, 4), bool)
    np.put_along_axis(routed, ex, True, axis=-1)
    rule = jax.jit(lambda z, routed: reference.kept_routes(jax.nn.softmax(z, -1), routed, cfg.model))
    expected = np.asarray(rule(logits, jnp.asarray(routed)))
    assert r.capacity == 8 and routed.sum() > kept.sum()           # something is dropped
    np.testing.assert_array_equal(kept, expected)

    def objective(p):
        z = model.apply({"params": p}, batch[:, :-1])[..., :VOCAB]
        return -jnp.take_along_axis(jax.nn.log_softmax(z, -1), batch[:, 1:, None], -1).mean()
    loss, grads = jax.jit(jax.value_and_grad(objective))(params)
    (_, ref_loss), ref_grads = reference_value_and_grad(params, batch, cfg.model, VOCAB)
    assert abs(float(loss) - float(ref_loss)) < TOL * float(ref_loss)
    errs = leaf_errors(jax.device_get(grads), ref_grads, skip=(STATS,))
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}


def test_capacity_is_the_exact_ceiling():
    """C = ceil(F s k / E) of the factor as written, in exact arithmetic: 1.12 x 25 x 2 / 4 is 14
    (binary floats: 14.000000000000002, C = 15) and 1.1 x 100 x 2 / 4 is 55. A row of 25 tokens
    under a router skewed to expert 0 keeps 14 of its entries there, the reference's rule."""
    from mtjax.parallel.expert_dispatch import capacity
    assert capacity(1.12, 25, 2, 4) == 14 and capacity(1.1, 100, 2, 4) == 55 and capacity(2.2, 180, 1, 4) == 99
    cfg = tiny_config("llama", extra=MOE + ["model.moe_capacity_factor=1.12"]).model
    assert reference.expert_capacity(cfg, 25) == 14 and reference.expert_capacity(cfg, 16) == 9
    logits = jax.random.normal(jax.random.key(2), (2, 25, 4)).at[..., 0].add(3.0)
    r = jax.jit(route, static_argnums=(1, 2))(logits, cfg, ParallelContext())
    kept = np.zeros((2, 25, 4), bool)
    routed = np.zeros((2, 25, 4), bool)
    ex, ok = np.asarray(r.expert).reshape(2, 25, 2), np.asarray(r.pos < r.capacity).reshape(2, 25, 2)
    for j in range(2):
        np.put_along_axis(kept, ex[..., j:j + 1], ok[..., j:j + 1], axis=-1)
        np.put_along_axis(routed, ex[..., j:j + 1], True, axis=-1)
    assert r.capacity == 14 and kept[..., 0].sum(1).tolist() == [14, 14] and routed[..., 0].sum() > 28
    np.testing.assert_array_equal(kept, reference.kept_routes(jax.nn.softmax(logits, -1), jnp.asarray(routed), cfg))


def test_padding_is_what_follows_a_rows_last_sample():
    """Which inputs are padding (`packing.row_padding`) in `padded_rows`: the reference's reading,
    token by token. Not a prompt's tokens (NO_LOSS), not a BOS that is the EOD id, not the EOD that
    ends a cut sample; marked, the segment ids keep every same-document pair. Routed under a
    capacity (C = 4 of a row's 32 entries) with padding that scores high on expert 0, padding takes
    no slot and is in no load: the kept entries are the reference's rule on the real tokens, where
    padding routed as real tokens would have taken slots from some. No compiled step but the route."""
    from types import SimpleNamespace
    from mtjax.model.documents import find_documents, real_tokens, same_document
    from mtjax.training.packing import row_documents, token_ids
    rows = padded_rows()
    docs = row_documents(jnp.asarray(rows), SimpleNamespace(document_masking=True, eod=EOD))
    real = np.asarray(real_tokens(docs.segments))
    np.testing.assert_array_equal(real, reference.packed_rows(rows, EOD)[1][2])
    inputs = rows[:, :-1]
    assert real[(inputs & NO_LOSS) == 0].all() and real[inputs == EOD | NO_LOSS].sum() == 3   # 2 BOS, the cut EOD
    assert real[3, 9] and not real[3, 10:].any() and real[2].all() and (~real).sum() == 36
    plain = find_documents(token_ids(jnp.asarray(inputs)), EOD)
    np.testing.assert_array_equal(same_document(docs.segments, docs.segments),
                                  same_document(plain.segments, plain.segments))

    cfg = tiny_config("llama", extra=MOE + ["model.moe_capacity_factor=0.5"]).model
    logits = jax.random.normal(jax.random.key(4), (BATCH, SEQ, 4)).at[..., 0].add(jnp.where(real, 0.0, 3.0))
    routes = jax.jit(route, static_argnums=(1, 2))
    r, as_real = routes(logits, cfg, ParallelContext(), None, jnp.asarray(real)), routes(logits, cfg, ParallelContext())
    ex, pos = np.asarray(r.expert).reshape(BATCH, SEQ, 2), np.asarray(r.pos).reshape(BATCH, SEQ, 2)
    routed, kept = np.zeros((BATCH, SEQ, 4), bool), np.zeros((BATCH, SEQ, 4), bool)
    for j in range(2):
        np.put_along_axis(routed, ex[..., j:j + 1], real[..., None], axis=-1)
        np.put_along_axis(kept, ex[..., j:j + 1], (pos[..., j:j + 1] < r.capacity), axis=-1)
    assert r.capacity == 4 and not kept[~real].any()
    displaced = (np.asarray(r.pos) < 4) & (np.asarray(as_real.pos) >= 4) & np.repeat(real, 2, axis=1)
    assert displaced.sum() > 0, "padding routed as real tokens takes no real token's slot: the check is vacuous"
    np.testing.assert_array_equal(np.asarray(r.stats[:4]), routed.sum((0, 1)))
    np.testing.assert_array_equal(kept, reference.kept_routes(jax.nn.softmax(logits, -1), jnp.asarray(routed), cfg))


def test_zbv_stores_units_in_run_order():
    """zbv's V layout at p = 2 keeps virtual stages 0 and 3 on stage 0: with 8 layers in units of 2
    (one a chunk) the stored rows are the units [0, 3, 1, 2], as one-layer chunks are
    (tests/test_checkpoint.py), and the canonical order inverts it. A step's per-layer load
    ratios are named by the MoE layers' indices in the model (0, 2, 4, 6) in the model's order (the
    reference's), not in the stored one."""
    cfg = tiny_config("llama", pipe=2, data=2, micro_batch=1, extra=MOE + [
        "model.num_layers=8", "model.moe_layer_freq=2", "parallel.expert=2", "parallel.schedule=zbv"])
    trainer = build(cfg, 2, 2, 1)
    run, canonical = trainer.plan.layout.layer_rows()
    assert list(run) == [0, 3, 1, 2] and list(canonical) == [0, 2, 3, 1]
    state, batch = trainer.init_state(), random_batch()
    routing = reference.routing(jax.device_get(trainer.canonical(state.params)), batch[:, :-1], cfg.model, VOCAB)
    _, metrics = trainer.train_step(state, trainer.put_batch(batch))
    loads = np.stack([np.asarray(routed, np.float64) for routed, _ in routing])     # [units, E]
    ratios = [float(metrics[f"moe_load_max_over_mean/{i}"]) for i in moe_layers(cfg.model)]
    expected = loads.max(-1) / loads.mean(-1)
    assert not np.allclose(expected[run], expected)                 # the stored order would show
    assert "moe_load_max_over_mean/1" not in metrics                # named by layer: 1 is dense
    np.testing.assert_allclose(ratios, expected, rtol=1e-6)


def test_dense_layers_count_as_dense_in_the_model_flops():
    """Active parameters and model FLOPs (`mtjax.inspect`, MFU) count experts in the MoE layers only:
    with 3 dense layers of 4, a layer's matmul FLOPs are the mean of 3 dense and 1 MoE layer."""
    from dataclasses import replace

    from mtjax.training.flops import forward_flops_per_token, inactive_parameters
    mixed = tiny_config("llama", extra=MOE + FIRST_DENSE).model
    sparse, dense = replace(mixed, moe_layer_freq=1, moe_first_dense=0), replace(mixed, num_experts=0)
    weights = [forward_flops_per_token(m, 384)[0] for m in (mixed, sparse, dense)]
    assert weights[0] == pytest.approx((weights[1] + 3 * weights[2]) / 4)
    assert inactive_parameters(mixed) * 4 == inactive_parameters(sparse) > 0 == inactive_parameters(dense)


def test_the_experts_slots_per_token():
    """E C / s expert MLPs a token (C = ceil(factor s k / E), dropless C = s): 4 experts, k 2, s 10:
    dropless 4; factor 1.0: C = 5, 2; factor 1.25: C = ceil(6.25) = 7, 2.8; with context 2 each
    rank keeps the row's C: 5.6 (dropless still 4: each rank its own s/2)."""
    from dataclasses import replace

    from mtjax.training.flops import expert_slots_per_token
    m = replace(tiny_config("llama", extra=MOE).model, num_experts=4, moe_top_k=2, seq_len=10)
    at = lambda factor, c=1: expert_slots_per_token(replace(m, moe_capacity_factor=factor), c)   # noqa: E731
    assert (at(0), at(1.0), at(1.25), at(1.25, 2), at(0, 2)) == (4, 2, 2.8, 5.6, 4)


BAD = [  # (overrides, devices, key, words)
    (["model.num_experts=4", "model.moe_top_k=5"], 1, "model.moe_top_k", "more than model.num_experts"),
    (["model.num_experts=4", "parallel.expert=3", "parallel.data=3"], 3, "parallel.expert", "does not divide model.num_experts"),
    (["model.num_experts=4", "parallel.expert=4", "parallel.data=2"], 2, "parallel.expert", "does not divide data 2"),
    (["model.num_experts=4", "model.moe_capacity_factor=-1"], 1, "model.moe_capacity_factor", "must be >= 0"),
    (["model.num_experts=4", "model.moe_router_bias=true"], 1, "model.moe_router_bias", "moe_score=sigmoid"),
    (["model.moe_top_k=1"], 1, "model.moe_top_k", "no effect"),
    (["parallel.expert=2", "parallel.data=2"], 2, "parallel.expert", "no effect"),
    (["model.num_experts=4", "model.moe_shared_expert_gate=true"], 1, "model.moe_shared_expert_gate",
     "needs a shared expert"),
    (["model.num_experts=4", "model.moe_layer_freq=3"], 1, "model.moe_layer_freq", "not divisible by moe_layer_freq 3"),
    (["model.num_experts=4", "model.num_layers=5", "model.moe_first_dense=2", "parallel.pipe=2"], 2,
     "model.num_layers", "the 3 layers after the 2 of the dense prefix are not divisible by pipe"),
    (["model.num_experts=4", "model.num_layers=4", "model.moe_layer_freq=4", "parallel.pipe=2"], 2,
     "model.moe_layer_freq", "does not divide the 2 layers of a pipeline chunk"),
    (["model.num_experts=4", "model.num_layers=4", "model.moe_layer_freq=2", "train.recompute=block",
      "train.recompute_layers=1"], 1, "train.recompute_layers", "not a multiple of moe_layer_freq 2"),
]


@pytest.mark.parametrize("overrides,devices,key,words", BAD, ids=[c[2] + ":" + c[3] for c in BAD])
def test_bad_moe_settings_are_refused_in_one_line(overrides, devices, key, words):
    cfg = load_config(None, ["train.global_batch=12", "train.micro_batch=1", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, devices)
    assert e.value.key == key and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_e4_checkpoint_resumes_at_e1_and_e2_and_generates(tmp_path):
    """The experts' stored shapes do not depend on e: a checkpoint saved at e = 4 restores at e = 1
    and e = 2 bitwise (weights and optimizer state), evaluates there to the reference's loss, and
    greedy generation from it (a KV cache; one device, and pipe 2 x tensor 2, whose first stage
    runs the dense prefix after the embedding) continues as the reference's argmax does. Its
    layers: 0-2 dense, 3 MoE, 4 dense, 5 MoE, stored as a dense prefix of 2 and units [dense, MoE]."""
    import mtjax
    from mtjax.checkpoint import Checkpointer

    def cfg_at(e):
        return tiny_config("llama", data=4, extra=MOE + PREFIX_UNITS + [f"parallel.expert={e}", "model.init_std=0.2",
                                                          f"train.run_dir={tmp_path}", "checkpoint.async_save=false"])
    at4 = build(cfg_at(4), 4, 1, 1)
    saved = at4.init_state()
    ck = Checkpointer(cfg_at(4))
    ck.save(saved, at4)
    ck.close()
    expected = jax.device_get((saved.params, saved.opt_state))
    batch = random_batch(5)
    for e in (1, 2):
        trainer = build(cfg_at(e), 4, 1, 1)
        ck = Checkpointer(cfg_at(e))
        state = ck.restore(0, trainer)
        ck.close()
        for a, b in zip(jax.tree.leaves(jax.device_get((state.params, state.opt_state))), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(a, b)
    ref = float(reference.loss(jax.device_get(state.params), batch, cfg_at(2).model, VOCAB))
    assert abs(float(trainer.eval_step(state.params, trainer.put_batch(batch))) - ref) < TOL * ref   # at e = 2

    prompt = [5, 17, 42]
    tokens = mtjax.load(str(tmp_path)).generate(prompt, 6)
    logits = reference.logits(expected[0], jnp.asarray([prompt + tokens[:-1]]), cfg_at(1).model, VOCAB)
    assert tokens == [int(i) for i in np.argmax(np.asarray(logits[0, len(prompt) - 1:]), -1)]
    assert mtjax.load(str(tmp_path), overrides=["parallel.pipe=2", "parallel.tensor=2"]).generate(prompt, 6) == tokens


def test_compiled_step_all_to_alls_and_flops_match_the_formulas():
    """From the compiled train step (`mtjax.inspect`), with a capacity factor of 1.5 (C = ceil(1.5 s
    k / E)): per MoE layer and micro-batch 2 all-to-alls forward and 2 backward over `data`, each of
    the E b C h buffer (docs/design.md, "Mixture of experts"), nothing else over `data` but the
    gradient and loss reductions; the executed matmul FLOPs within 2% of the count with the
    experts' E C slots a row (`expert_slot_flops_per_step_per_device`), above the active FLOPs."""
    import math

    from mtjax.inspect import report
    cfg = tiny_config("gpt", data=2, micro_batch=2, extra=MOE + ["parallel.expert=2", "model.moe_capacity_factor=1.5"])
    trainer = build(cfg, 2, 1, 1)
    rep = report(trainer)
    m, b, h, layers, E = trainer.plan.micro_batches, 2, cfg.model.hidden_size, cfg.model.num_layers, 4
    cap = math.ceil(1.5 * SEQ * 2 / E)
    a2a = [op for op in rep["collectives"]["ops"] if op["kind"] == "all-to-all"]
    assert {tuple(op["axes"]) for op in a2a} == {("data",)}
    assert sum(op["multiplicity"] for op in a2a) == 4 * m * layers
    assert {op["bytes"] for op in a2a} == {E * b * cap * h * 4}
    executed = rep["executed_flops_per_device"]
    a = rep["analytical"]
    assert a["expert_slots_per_token"] == E * cap / SEQ
    assert abs(executed - a["expert_slot_flops_per_step_per_device"]) < 0.02 * executed, (executed, a)
    assert executed > 1.1 * a["model_flops_per_step_per_device"]
    assert rep["analytical"]["active_parameters"] < rep["analytical"]["parameters"]
    leaves = jax.tree_util.tree_leaves_with_path(jax.eval_shape(trainer.init_state).params)
    probe = [int(np.prod(x.shape)) for path, x in leaves if getattr(path[-1], "key", None) == "stats"]
    total = sum(int(np.prod(x.shape)) for _, x in leaves)
    assert probe and rep["analytical"]["parameters"] == total - sum(probe)    # the routing probe is no weight


def test_a_pipelined_dense_prefix_is_differentiated_from_its_stash():
    """Pipe 2 1F1B, a dense prefix of 1 (run by stage 0 after the embedding), recompute none: the
    executed matmul FLOPs of the prefix's scope (`chunk.EMBED_SCOPE`) on stage 0 are, per
    micro-batch, one GPT layer's forward F = 2 b s (3h^2 + h^2 + 2 h f) + 4 b s^2 h in the forward
    and 2F (dX and dW of each product) in the backward, from the residuals the forward stashed.
    (Recomputed there, as it was, the backward ran F - 2 b s f h more: the forward again but for its
    last product, whose output no backward reads.)"""
    from mtjax.hlo_report import executed_dot_flops
    from mtjax.inspect import compile_train_step, pipeline_scope_weights
    cfg = tiny_config("gpt", 1, 2, 1, micro_batch=2, extra=MOE + ["model.num_layers=3", "model.moe_first_dense=1",
                                                                 "parallel.schedule=1f1b", "train.recompute=none"])
    trainer = build(cfg, 1, 2, 1)
    text = compile_train_step(trainer).as_text()
    first, last = (executed_dot_flops(text, w)["by_scope"] for w in pipeline_scope_weights(trainer))
    b, s, h, m = 2, SEQ, cfg.model.hidden_size, trainer.plan.micro_batches
    f = cfg.model.ffn_size
    layer = 2 * b * s * (3 * h * h + h * h + 2 * h * f) + 4 * b * s * s * h
    assert first["pipeline_forward/pipeline_embed"] == m * layer
    assert first["pipeline_backward/pipeline_embed"] == 2 * m * layer
    assert last["pipeline_forward/pipeline_embed"] == last["pipeline_backward/pipeline_embed"] == 0


def _dot_shapes(jaxpr) -> list[tuple[int, ...]]:
    """The output shapes (dims sorted) of every dot_general in a jaxpr and the jaxprs inside it."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(tuple(sorted(eqn.outvars[0].aval.shape)))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += _dot_shapes(sub)
    return out


def test_split_backward_leaves_the_expert_and_router_weight_gradients_to_w():
    """zb's B (`pipeline/chunk.py` `chunk_vjp`: the tapped weights held constant, `parallel/taps.py`)
    traced, not compiled, on an MoE layer with a gated shared expert: the experts' gate, up and fc2,
    the router and the shared gate are tapped, and B's program has no matmul whose output is shaped
    like one of their (per-layer) weights, where the whole backward has one per weight: their
    X^T dY is W's. (W's values: the zb layout above equals the reference.) One row (b = 1), so no
    activation [E, b s, .] is weight-shaped."""
    from mtjax.parallel import taps
    cfg = tiny_config("llama", extra=MOE + ["model.moe_shared_expert_size=32", "model.moe_shared_expert_gate=true"])
    model = Transformer(cfg.model, 384, ParallelContext(batch_rows=BATCH))
    boxed = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, SEQ), jnp.int32))["params"]
    params = jax.tree.map(lambda w: w.value, boxed, is_leaf=lambda w: hasattr(w, "value"))
    shared, runs = {k: v for k, v in params.items() if k != "layers"}, (params["layers"],)
    x = jax.ShapeDtypeStruct((1, SEQ, cfg.model.hidden_size), jnp.float32)

    def layers(runs, x, tap=None):
        return model.apply({"params": shared}, x, runs, None, tap, method="run_layers")

    def split_b(runs, x, dy):
        tap = model.apply({"params": shared}, x, runs, method="zero_taps")
        kernels, rest = taps.split_weights(runs[0], tap[0])
        assert {("moe", "experts", n) for n in ("gate", "up", "fc2")} | {("moe", "router"), ("moe", "shared_gate")} \
            <= set(kernels)
        return jax.vjp(lambda rest, x, tap: layers((taps.join_weights(kernels, rest),), x, tap), rest, x, tap)[1](dy)

    def whole(runs, x, dy):
        return jax.vjp(layers, runs, x)[1](dy)
    moe = params["layers"]["moe"]
    weights = [tuple(sorted(w.shape[1:])) for w in (*moe["experts"].values(), moe["router"], moe["shared_gate"])]
    split_dots, whole_dots = (_dot_shapes(jax.make_jaxpr(f)(runs, x, x).jaxpr) for f in (split_b, whole))
    assert sorted(s for s in whole_dots if s in weights) == sorted(weights)
    assert not [s for s in split_dots if s in weights]


def test_grouped_tap_gives_w_the_pairs_and_where_this_ranks_experts_sit():
    """A grouped product on this rank's E_r = 2 of E = 4 experts stored whole (e < d c): the tapped
    backward's dX is the plain one, its weight cotangent zero, and W's dA from the tap's (X, dY, P)
    is the plain gradient of the whole stored weight: X_x^T dY_x in rank 1's block, zeros in rank 0's."""
    from functools import partial

    from mtjax.parallel import taps
    shapes = [(2, 3, 5), (4, 5, 6), (2, 3, 6)]     # x [E_r, n, in], w [E, in, out], dy [E_r, n, out]
    x, w, dy = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate(shapes))
    place = jax.nn.one_hot(1, 2)

    def plain(x, w):
        return jnp.einsum(taps.GROUPED, x, w[2:])

    def tapped(x, w, tap):
        product, grad_x = partial(jnp.einsum, taps.GROUPED), partial(taps.einsum_dx, taps.GROUPED)
        return taps.tapped(product, grad_x, x, w[2:], tap, (place,))
    dx_ref, dw_ref = jax.vjp(plain, x, w)[1](dy)
    tap = (jnp.zeros_like(x), jnp.zeros_like(dy), jnp.zeros_like(place))
    dx, dw, cotangent = jax.vjp(tapped, x, w, tap)[1](dy)
    np.testing.assert_allclose(dx, dx_ref, rtol=TOL, atol=1e-6)
    assert not np.asarray(dw).any() and len(cotangent) == 3
    np.testing.assert_allclose(taps.grouped_weight_gradient(*cotangent), dw_ref, rtol=TOL, atol=1e-6)
    assert not np.asarray(dw_ref[:2]).any()


def test_a_pipeline_for_generation_takes_whole_units():
    """`mtjax.load(..., overrides=["parallel.pipe=P"])` validates the model for P stages: units of
    moe_layer_freq layers split over stages whole, or one line naming the field (no compile)."""
    from mtjax.config.validate import validate_model
    cfg = tiny_config("llama", extra=MOE + EVERY_2ND)
    validate_model(cfg, 1, 2)                            # 2 units, one a stage
    with pytest.raises(ConfigError, match="model.moe_layer_freq.*does not divide the 1 layers"):
        validate_model(cfg, 1, 4)
    from mtjax.inference.model import inference_config
    with pytest.raises(ConfigError, match="parallel.pipe: num_layers 4 is not divisible by parallel.pipe 4 in units"):
        inference_config(cfg.to_dict(), ["parallel.pipe=4"])     # the setting given, named (as a checkpoint saves it)


def test_a_pipeline_stashes_no_copy_of_the_experts_weights(monkeypatch):
    """bf16, pipe 2 1F1B, experts whole (e = 1): the step casts the experts' weights to bf16 once,
    with the kernels (`computed_weights.as_computed`, `fsdp.is_matmul_weight`), so the pullback's residuals
    are the parameters themselves and the executor stashes none of them per micro-batch (cast
    inside the layer, each stash slot held a bf16 copy of the stage's experts: at h 32, f 256,
    E 4 -> 8, 12 more bytes of temporaries per expert parameter of the stage). Traced, not compiled."""
    from mtjax.inspect import abstract_state
    from mtjax.pipeline import chunk
    from mtjax.training.step import batch_sharding
    stashed, split = [], chunk.Residuals.split

    def recorded(self, pullback, params):
        leaves = split(self, pullback, params)
        stashed.extend((tuple(x.shape), x.dtype) for x in leaves)
        return leaves
    monkeypatch.setattr(chunk.Residuals, "split", recorded)
    cfg = tiny_config("llama", 1, 2, 1, micro_batch=1, extra=[*MOE, "train.precision=bf16"])
    trainer = build(cfg, 1, 2, 1)
    batch = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32, sharding=batch_sharding(trainer.mesh))
    trainer.train_step.lower(abstract_state(trainer), batch)
    h, f, E = cfg.model.hidden_size, cfg.model.expert_ffn_size, cfg.model.num_experts
    assert stashed, "the executor stashed nothing: the check would pass vacuously"
    weights = [(s, d) for s, d in stashed if s[-3:] in ((E, h, f), (E, f, h))]
    assert not weights, weights

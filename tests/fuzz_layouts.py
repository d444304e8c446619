"""Random layouts against the single-device reference: a tool for finding bugs, not a test (pytest
does not collect it, and what it finds becomes a test case).

    python tests/fuzz_layouts.py {dense,moe,packed,checkpoint,precision} [--seed N] [--seconds S]

Each draw is a layout (data, pipe, tensor, context), a schedule, the data-parallel sharding, a
recompute mode, the overlaps and the attention heads, and (but for packed, half the time) the
model's shape and options: h, a, d, f, tied embeddings, no vocabulary padding, GPT's tanh GeLU,
Llama's QKV bias, QK norm and linear, llama3 or YaRN rotary scaling; fp32, on 8 simulated CPU
devices. Validation
refuses it (`refused` and the one line), or one check runs, with the tests' own tolerance:
    dense   the loss and every gradient leaf (tests/test_fsdp.py `matches_reference`);
    moe     experts too (routing settings, dense layers among them and packed rows with padding
            drawn): loss, applied
            gradients, auxiliary losses, the routing statistics and the AdamW step on the
            step's own gradients (tests/test_moe.py `matches_moe_reference`);
    packed  packed rows against each document alone (tests/test_packed.py's check);
    checkpoint  one step on a drawn layout (dense or experts), saved, restored on another drawn
            layout of the same model: every parameter and moment equal bitwise in canonical order,
            the step and data position kept, the same evaluation loss (1e-5);
    precision   a drawn layout (dense or experts) in bf16 or fp16: two steps run, the losses are
            finite and the first is the fp32 reference's within 2% (a finder of crashes and of
            gross errors, not an equality check).
and prints `OK`, `FAIL` and the check's message, or `ERROR`. The moe check's AdamW step is on the
step's own gradients: on the reference's, a leaf with some gradient elements near Adam's eps (GPT's
LayerNorm biases; a router; in one Llama fc2 kernel one element of 6.4e-10 against 4.9e-10, its
leaf's median 3.7e-4) missed 1e-5 by a few times while every applied gradient matched, since
g / (|g| + eps) amplifies their rounding.
"""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: E402,F401  (8 CPU devices, fp32: before JAX starts)
from layouts import build, tiny_config  # noqa: E402
from mtjax.config import ConfigError, validate  # noqa: E402

LAYOUTS = [(2, 1, 2, 1), (1, 2, 2, 1), (2, 2, 2, 1), (1, 1, 4, 1), (1, 1, 2, 2), (2, 1, 2, 2), (4, 1, 2, 1),
           (1, 2, 2, 2), (1, 2, 4, 1), (2, 1, 1, 2), (2, 2, 1, 2), (4, 2, 1, 1)]


def draw(rng: random.Random, kind: str):
    """-> (arch, data, pipe, tensor, context, sp, micro_batch, overrides)."""
    arch = rng.choice(["gpt", "llama"])
    d, p, t, c = rng.choice(LAYOUTS)
    sp = t > 1 and rng.random() < 0.7
    recompute = rng.choice(["none", "selective", "full", "block"])
    extra = [f"parallel.context={c}", f"train.recompute={recompute}"]
    extra += ["train.recompute_layers=1"] if recompute == "block" else []
    if p > 1:
        schedule = rng.choice(["1f1b", "gpipe", "interleaved", "zb", "zbv"])
        extra.append(f"parallel.schedule={schedule}")
        if schedule in ("interleaved", "zbv"):
            extra.append("model.num_layers=4")
        if schedule == "interleaved":
            extra.append("parallel.virtual_stages=2")
        if rng.random() < 0.2:
            extra.append(f"parallel.max_in_flight={rng.choice([p, p + 1])}")
    if c > 1:
        extra.append("parallel.context_attention=" + rng.choice(["ring", "all_gather"]))
    if sp and rng.random() < 0.5:
        extra.append("parallel.tensor_overlap=true")
    micro_batch = 2 if kind == "packed" else 1
    if t > 1 and rng.random() < 0.3:
        extra.append("parallel.half_batch_overlap=true")
        extra += [f"parallel.half_batch_group={rng.choice([1, 2])}"] if rng.random() < 0.5 else []
        micro_batch = 2
        if kind != "packed" and rng.random() < 0.4:      # the sequence's halves (refused beside packed rows)
            extra.append("parallel.half_batch_axis=sequence")
            micro_batch = int(rng.choice([1, 2]))
    if d > 1 and rng.random() < 0.3:
        extra.append("parallel.fsdp=true")
        extra += ["parallel.fsdp_keep_gathered=true"] if rng.random() < 0.3 else []
        extra += ["parallel.fsdp_pipeline_gather=microbatch"] if p > 1 and rng.random() < 0.3 else []
    elif d > 1 and rng.random() < 0.3:
        extra.append("parallel.distributed_optimizer=true")
    if arch == "llama" and rng.random() < 0.3:
        extra.append("model.num_kv_heads=" + rng.choice(["1", "2"]))
    if kind != "packed" and rng.random() < 0.5:
        extra += model_shape(rng, arch)
    if kind == "packed":   # (its check builds the config from the overrides alone)
        extra += ["data.document_masking=true", "model.attention=" + rng.choice(["xla", "dot_product"])]
        extra += ["parallel.sequence_parallel=true"] if sp else []
    if kind == "moe":
        extra += moe_settings(rng, d * c)
    return arch, d, p, t, c, sp, micro_batch, extra


def model_shape(rng: random.Random, arch: str) -> list:
    """Shapes and options beside the tiny config's (h 32, a 8, 2 layers, s 16): validation refuses
    what a layout cannot split, in one line."""
    extra = [f"model.hidden_size={rng.choice([32, 48, 64])}", f"model.num_heads={rng.choice([4, 8])}"]
    extra += [o for o, chance in [(f"model.kv_channels={rng.choice([4, 12])}", 0.3),
                                  (f"model.ffn_hidden_size={rng.choice([40, 96])}", 0.3),
                                  ("model.tie_embeddings=" + ("false" if arch == "gpt" else "true"), 0.3),
                                  ("model.vocab_multiple=1", 0.3)] if rng.random() < chance]
    if arch == "gpt":
        extra += ["model.activation=gelu_tanh"] if rng.random() < 0.3 else []
    else:
        extra += [o for o, chance in [("model.qkv_bias=true", 0.3), ("model.qk_norm=true", 0.3),
                                      ] if rng.random() < chance]
        extra += rng.choice([[], [], [], ["model.rope_scaling=linear", "model.rope_scaling_factor=2"],
                             ["model.rope_scaling=llama3", "model.rope_scaling_factor=8",
                              "model.rope_original_positions=8"],
                             ["model.rope_scaling=yarn", "model.rope_scaling_factor=4", "model.rope_original_positions=8",
                              "model.rope_beta_fast=4", "model.rope_beta_slow=0.5"]])
    return extra


def moe_settings(rng: random.Random, ranks: int) -> list:
    """Expert parallelism over the data x context ranks and the routing options."""
    e = rng.choice([e for e in (1, 2, 4) if ranks % e == 0])
    extra = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=48", "model.moe_aux_loss_coeff=0.01",
             "model.moe_z_loss_coeff=0.001", f"parallel.expert={e}"]
    extra += [o for o, chance in [("model.moe_capacity_factor=" + rng.choice(["0.5", "1.0", "1.5"]), 0.3),
                                  ("model.moe_shared_expert_size=32", 0.3), ("model.moe_top_k=1", 0.3),
                                  ("model.moe_renormalize=false", 0.2)]
              if rng.random() < chance]
    if "model.moe_shared_expert_size=32" in extra and rng.random() < 0.5:
        extra.append("model.moe_shared_expert_gate=true")
    if rng.random() < 0.3:
        extra += ["model.moe_score=sigmoid", "model.moe_router_bias=true"]
    if rng.random() < 0.3:   # packed fine-tuning rows with padding (tests/test_moe.py `padded_rows`)
        extra.append("data.document_masking=true")
    if rng.random() < 0.4:   # dense layers among the MoE layers (`model/layer_pattern.py`): units, a prefix, both
        extra += rng.choice([["model.moe_layer_freq=2"], ["model.num_layers=6", "model.moe_first_dense=2"],
                             ["model.num_layers=6", "model.moe_layer_freq=2", "model.moe_first_dense=3"],
                             ["model.num_layers=10", "model.moe_layer_freq=2", "model.moe_first_dense=2"]])
    return extra


def draw_pair(rng: random.Random):
    """Two layouts of one model (4 layers; the same experts, each side its own expert ranks)."""
    kind = rng.choice(["dense", "moe"])
    src, dst = list(draw(rng, kind)), list(draw(rng, kind))
    model = [o for o in src[7] if o.startswith("model.") and o != "model.num_layers=4"] + ["model.num_layers=4"]
    for side in (src, dst):
        kept = [o for o in side[7] if not o.startswith(("model.", "parallel.expert="))]
        if kind == "moe":
            ranks = side[1] * side[4]
            kept.append(f"parallel.expert={rng.choice([e for e in (1, 2, 4) if ranks % e == 0])}")
        side[0], side[7] = src[0], kept + model
    return tuple(src), tuple(dst)


def check_checkpoint(src, dst):
    import shutil
    import tempfile
    run = tempfile.mkdtemp(prefix="fuzz-ckpt-")
    try:
        _save_and_restore(src, dst, run)
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _save_and_restore(src, dst, run):
    import jax
    import numpy as np
    from layouts import VOCAB, random_batch
    from mtjax.checkpoint import Checkpointer
    from test_checkpoint import vocab_rows
    io = [f"train.run_dir={run}", "checkpoint.async_save=false"]
    trainers = []
    for arch, d, p, t, c, sp, micro_batch, extra in (src, dst):
        cfg = tiny_config(arch, t, p, d, sp, micro_batch=micro_batch, extra=[*extra, *io])
        validate(cfg, d * p * t * c)
        trainers.append(build(cfg, d, p, t, c))
    a, b = trainers
    state, _ = a.train_step(a.init_state(), a.put_batch(random_batch(3)))
    saver = Checkpointer(a.cfg)
    saver.save(state, a)
    saver.close()
    reader = Checkpointer(b.cfg, directory=saver.directory)
    restored = reader.restore(1, b)
    reader.close()
    assert int(restored.step) == 1 and int(restored.data_position) == int(state.data_position)
    padded = {a.plan.padded_vocab, b.plan.padded_vocab}      # model.vocab_multiple may be drawn
    want = vocab_rows(jax.device_get(a.canonical((state.params, state.opt_state))), VOCAB, padded)
    got = vocab_rows(jax.device_get(b.canonical((restored.params, restored.opt_state))), VOCAB, padded)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(want)]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, x, y in zip(paths, jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(x, y), f"{path} differs after the restore"
    batch = random_batch(4)
    ref = float(a.eval_step(state.params, a.put_batch(batch)))
    loss = float(b.eval_step(restored.params, b.put_batch(batch)))
    assert abs(loss - ref) <= 1e-5 * abs(ref), f"evaluation loss {loss} after the restore, {ref} before"


def check_precision(arch, d, p, t, c, sp, micro_batch, extra, precision):
    import jax
    import numpy as np
    import reference
    from layouts import VOCAB, random_batch
    # its reference is the plain loss: the experts' draws of packed rows are the moe check's
    extra = [e for e in extra if not e.startswith("data.document_masking")]
    cfg = tiny_config(arch, t, p, d, sp, micro_batch=micro_batch, extra=[*extra, f"train.precision={precision}"])
    validate(cfg, d * p * t * c)
    trainer = build(cfg, d, p, t, c)
    state, batch = trainer.init_state(), random_batch()
    params = jax.device_get(trainer.canonical(state.params))
    ref = float(jax.jit(reference.loss, static_argnums=(2, 3))(params, batch, cfg.model, VOCAB))
    losses = []
    for k in range(2):
        state, metrics = trainer.train_step(state, trainer.put_batch(random_batch(k)))
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)), f"losses {losses}"
    assert abs(losses[0] - ref) < 2e-2 * ref, f"{precision} loss {losses[0]}, fp32 reference {ref}"


def check(kind: str, arch, d, p, t, c, sp, micro_batch, extra):
    cfg = tiny_config(arch, t, p, d, sp, micro_batch=micro_batch, extra=extra)
    validate(cfg, d * p * t * c)
    if kind == "packed":
        import test_packed
        oracles = {}
        get = lambda arch, cfg, batch: oracles.setdefault(arch, test_packed.oracle(cfg, batch))   # noqa: E731
        return test_packed.test_packed_rows_match_each_document_alone(get, arch, d, p, t, c, tuple(extra))
    if kind == "moe":
        from test_moe import EOD, matches_moe_reference
        return matches_moe_reference(build(cfg, d, p, t, c, eod=EOD), cfg)
    from test_fsdp import matches_reference
    matches_reference(build(cfg, d, p, t, c), cfg, False)


def main(argv, draw_one=None, draw_two=None) -> int:
    """The command line; `draw_one`, `draw_two` replace `draw`, `draw_pair` (`fuzz_odd.py`)."""
    draw_one, draw_two = draw_one or draw, draw_two or draw_pair
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["dense", "moe", "packed", "checkpoint", "precision"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=600.0)
    args = parser.parse_args(argv)
    rng, deadline = random.Random(args.seed), time.time() + args.seconds
    while time.time() < deadline:
        kind = rng.choice(["dense", "moe"]) if args.kind == "precision" else args.kind
        pair = draw_two(rng) if kind == "checkpoint" else (draw_one(rng, kind),)
        precision = rng.choice(["bf16", "fp16"])
        name = (precision + " " if args.kind == "precision" else "") + " -> ".join(f"{x[0]} d{x[1]} p{x[2]} t{x[3]} c{x[4]} sp={x[5]} b={x[6]} " + " ".join(x[7]) for x in pair)
        start = time.time()
        try:
            if args.kind == "checkpoint":
                check_checkpoint(*pair)
            elif args.kind == "precision":
                check_precision(*pair[0], precision)
            else:
                check(args.kind, *pair[0])
            print("OK", round(time.time() - start), name, flush=True)
        except ConfigError as e:
            print("refused", name, "|", e, flush=True)
        except AssertionError as e:
            print("FAIL", name, "|", str(e)[:600], flush=True)
        except Exception as e:     # noqa: BLE001  (a crash is a finding too)
            print("ERROR", name, "|", type(e).__name__, str(e)[:600], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

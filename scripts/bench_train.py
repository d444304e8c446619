"""`python scripts/bench_train.py [--steps N] [--configs tiny,gpt100m] [--override K=V ...] [--peak-tflops P] [--no-baseline] [--no-depth] [--json OUT]`

Single-device training benchmark on synthetic token batches (no corpus is read), with a plain-JAX baseline.
For each config it reports
  - compile time: seconds for `train_step.lower(abstract inputs).compile()`,
  - step time: the median of N steps (per config, or --steps) after 2 warm-up steps, each step
    synchronised with `jax.block_until_ready` on the new state and the metrics,
  - tokens/s = B s / step time, and TFLOP/s = `model_flops` / step time
    (Megatron's model-FLOPs accounting, mtjax/training/flops.py),
  - the baseline (skipped with `--no-baseline`): the same training step written from scratch in
    this file with jax and optax only (`plain_*` below; nothing from mtjax.model, mtjax.parallel
    or mtjax.training): the config's l, h, a, s, f, V padded as mtjax pads it, tied embedding,
    dropout rates, AdamW with the same schedule, clipping and decay mask, the same precision
    policy (fp32 master weights, gradients and moments; matmuls in the compute dtype, LayerNorm,
    softmax and loss in fp32) and the same micro-batching (gradients accumulated in fp32 over a
    scan). Both start from the same weights (mtjax's initial tree, mapped: `params_from_mtjax`)
    and step on the same batches, the two steps taking turns (mtjax, plain, mtjax, ...) so that
    load changes hit both; it reports plain tokens/s and mtjax / plain (= plain's median step
    time / mtjax's; > 1: mtjax is faster), and shows that the work is the same:
      * same model: every step's loss and gradient norm on both sides; the first step's must agree
        to 1e-5 relative in fp32 without dropout on CPU, 2e-2 under bf16 or on a GPU (bf16 roundings
        in other places, TF32), 1e-1 with dropout (the plain side draws its own masks). The first
        loss is also printed beside ln V, where an untrained model starts.
        The script exits with status 1 if they do not agree.
      * same FLOPs: XLA's `cost_analysis()` flops of the two compiled steps, and the matmul FLOPs
        executed through the loops' trip counts (`hlo_report.executed_dot_flops`). cost_analysis
        counts a while body once (one micro-batch, one layer), but both steps have the same loops,
        so its ratio still compares like with like; it includes elementwise work. On CPU mtjax's
        excess is 12-19 FLOPs per parameter and barely moves with the tokens (gpt100m, B = 2:
        1.03e9 at s = 256, 1.21e9 at s = 1024), so it is work over the weights and moments, as
        mtjax's non-finite checks and keep-or-update selects are (the plain step has neither);
        the GeLU that mtjax recomputes in the backward is token work. The matmul counts agree.
    What differs by construction: the plain side fuses Q, K, V into one [h, 3ad] matmul (same
    FLOPs; its gradient norm and AdamW update are the same, element by element), keeps the
    LayerNorm gains and shifts in fp32 under bf16 (mtjax rounds them to bf16 like every weight),
    skips no non-finite step and has no loss scaling (fp16 is refused), and recomputes with
    jax.checkpoint's own policies (recompute none, selective or full; block is refused);
and then the compile time of the tiny model at 4 and at 32 layers: the layers are
one `nn.scan`, so the compiled program, and its compile time, should barely grow.

Each config runs with the overrides in BENCH (printed), sized so that the
whole script takes a few minutes on a 2-core CPU; `--override group.field=value` (repeatable)
is appended to every config's overrides (e.g. a larger batch and `train.precision=bf16` on a GPU),
and `--peak-tflops P` adds a column MFU = TFLOP/s / P. TFLOP/s counts the model's FLOPs, not the
forward a recompute mode repeats (as the run's log and `inspect`'s predicted_mfu). `--no-depth`
skips the compile-time comparison. Runs on `jax.devices()[0]`: the first GPU where there is one.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtjax.config import load_config, validate
from mtjax.hlo_report import executed_dot_flops, flops_report
from mtjax.inspect import abstract_state
from mtjax.mesh import make_mesh
from mtjax.training.flops import model_flops
from mtjax.training.step import batch_sharding
from mtjax.training.trainer import Trainer

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
VOCAB = 257                    # the byte tokenizer's vocabulary (256 bytes + end of document)
WARMUP_STEPS = 2
DEPTHS = (4, 32)               # layer counts for the compile-time comparison (tiny model)
DEPTH_REPEATS = 3              # compile each depth this often (interleaved) and keep the fastest
BENCH = {                      # config name -> (overrides, timed steps unless --steps is given)
    "tiny": ([], 10),
    "gpt100m": (["train.global_batch=1", "train.micro_batch=1"], 3),   # ~10 s a step on 2 CPU cores
    "gpt1.3b": ([], 5),        # a GPU's: issue 15's MFU with each model.attention (not run by default)
}


# ============================================================================ the plain baseline
# A GPT written from scratch with jax and optax only (nothing from mtjax.model, mtjax.parallel or
# mtjax.training): the same model, optimizer and precision policy as mtjax's one-device step, as a
# JAX user would write it without mtjax. It reads the numbers of the same Config, nothing else.
#
# Shape legend: B global batch, m micro-batches, b = B/m micro-batch, s sequence, h hidden,
# a heads, d head dim, f MLP hidden, l layers, V the tokenizer's vocabulary, Vp the padded one.
# Parameters (fp32 master weights; every `blocks` leaf has a leading layer axis [l, ...]):
#   wte [Vp, h]   token embedding, also the output layer (tied)     wpe [s, h]  learned positions
#   ln_f_g, ln_f_b [h]  final LayerNorm
#   blocks: ln1_g, ln1_b [h]; w_qkv [h, 3ad], b_qkv [3ad] (Q, K, V fused); w_o [ad, h], b_o [h];
#           ln2_g, ln2_b [h]; w_fc [h, f], b_fc [f]; w_proj [f, h], b_proj [h]
# AdamW decays the `w*` leaves (the matrices), not the LayerNorm gains and biases or the biases.


class PlainGPT(NamedTuple):
    """The baseline's static shape and options (GPT only: LayerNorm, learned positions, GeLU,
    tied embedding, multi-head attention)."""
    l: int
    h: int
    a: int
    d: int
    f: int
    s: int
    V: int
    Vp: int
    eps: float
    std: float
    gelu_tanh: bool
    dropout: float
    attention_dropout: float
    dtype: object      # compute dtype; the master weights, gradients and moments stay fp32
    remat: str         # none | selective | full: what each layer's backward recomputes


class PlainState(NamedTuple):
    params: dict
    opt_state: object
    step: jax.Array


def plain_spec(cfg, vocab: int) -> PlainGPT:
    """The baseline for `cfg` (a loaded Config) and a tokenizer of `vocab` ids; V is padded to a
    multiple of model.vocab_multiple, as mtjax pads it on one device."""
    m = cfg.model
    act = m.activation or "gelu"
    if m.arch != "gpt" or not (m.tie_embeddings is None or m.tie_embeddings) or m.num_kv_heads not in (0, m.num_heads) \
            or act not in ("gelu", "gelu_tanh") or cfg.train.recompute not in ("none", "selective", "full") \
            or cfg.train.precision not in ("fp32", "bf16"):
        raise ValueError("the plain baseline is a tied-embedding multi-head GPT (gelu or gelu_tanh), fp32 or bf16, "
                         "recompute none, selective or full")
    padded = -(-vocab // m.vocab_multiple) * m.vocab_multiple
    return PlainGPT(m.num_layers, m.hidden_size, m.num_heads, m.kv_channels or m.hidden_size // m.num_heads,
                    m.ffn_hidden_size or 4 * m.hidden_size, m.seq_len, vocab, padded, m.norm_eps, m.init_std,
                    act == "gelu_tanh", m.dropout, m.attention_dropout,
                    {"fp32": jnp.float32, "bf16": jnp.bfloat16}[cfg.train.precision], cfg.train.recompute)


def plain_init(g: PlainGPT, key) -> dict:
    """N(0, std) matrices, N(0, std / sqrt(2l)) for the two projections into the residual
    stream (w_o, w_proj: GPT-2's scaling), zero biases, unit LayerNorm gains."""
    k = iter(jax.random.split(key, 6))
    normal = lambda shape, std: std * jax.random.normal(next(k), shape, jnp.float32)   # noqa: E731
    zeros, ones, out_std = jnp.zeros, jnp.ones, g.std / math.sqrt(2 * g.l)
    ad = g.a * g.d
    blocks = {"ln1_g": ones((g.l, g.h)), "ln1_b": zeros((g.l, g.h)),
              "w_qkv": normal((g.l, g.h, 3 * ad), g.std), "b_qkv": zeros((g.l, 3 * ad)),
              "w_o": normal((g.l, ad, g.h), out_std), "b_o": zeros((g.l, g.h)),
              "ln2_g": ones((g.l, g.h)), "ln2_b": zeros((g.l, g.h)),
              "w_fc": normal((g.l, g.h, g.f), g.std), "b_fc": zeros((g.l, g.f)),
              "w_proj": normal((g.l, g.f, g.h), out_std), "b_proj": zeros((g.l, g.h))}
    return {"wte": normal((g.Vp, g.h), g.std), "wpe": normal((g.s, g.h), g.std),
            "ln_f_g": ones((g.h,)), "ln_f_b": zeros((g.h,)), "blocks": blocks}


def _lead(v, ndim: int):
    """v [n] as [1, ..., 1, n] of rank `ndim` (explicit broadcasting)."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def _linear(x, w, b):
    """x [..., i] W [i, o] + b [o], in x's dtype (the fp32 master W and b cast to it)."""
    y = x @ w.astype(x.dtype)
    return y + _lead(b, y.ndim).astype(x.dtype)


def _dropout(x, rate: float, key):
    """Inverted dropout: keep each element with probability 1 - rate, scaled by 1 / (1 - rate).
    Identity when rate = 0 (no key is drawn then)."""
    if rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def plain_layer_norm(x, g, b, eps: float):
    """(x - mean) / sqrt(var + eps) * g + b over h, computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * _lead(g, x.ndim) + _lead(b, x.ndim)
    return y.astype(x.dtype)


def plain_attention(x, p, g: PlainGPT, key):
    """Causal self-attention, x [b, s, h] -> [b, s, h]:
        Q, K, V = split(x W_qkv + b_qkv)            each [b, s, a, d]
        P = softmax(Q K^T / sqrt(d) + causal mask)  [b, a, s, s], scores and softmax in fp32
        Y = dropout(P) V W_o + b_o."""
    b, s, _ = x.shape
    qkv = _linear(x, p["w_qkv"], p["b_qkv"]).reshape(b, s, 3, g.a, g.d)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqad,bkad->baqk", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(g.d))
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = _dropout(jax.nn.softmax(scores, axis=-1), g.attention_dropout, key)
    out = jnp.einsum("baqk,bkad->bqad", probs.astype(v.dtype), v).reshape(b, s, g.a * g.d)
    return _linear(out, p["w_o"], p["b_o"])


def plain_mlp(x, p, g: PlainGPT):
    """GeLU(x W_fc + b_fc) W_proj + b_proj, [b, s, h] -> [b, s, f] -> [b, s, h]; GeLU is
    x Phi(x) (erf), or its tanh approximation for model.activation=gelu_tanh."""
    return _linear(jax.nn.gelu(_linear(x, p["w_fc"], p["b_fc"]), approximate=g.gelu_tanh), p["w_proj"], p["b_proj"])


def plain_block(x, p, g: PlainGPT, key):
    """Pre-norm block: x + dropout(Attn(LN(x))), then x + dropout(MLP(LN(x))); x [b, s, h]."""
    k1, k2, k3 = (None, None, None) if key is None else jax.random.split(key, 3)
    x = x + _dropout(plain_attention(plain_layer_norm(x, p["ln1_g"], p["ln1_b"], g.eps), p, g, k1), g.dropout, k2)
    return x + _dropout(plain_mlp(plain_layer_norm(x, p["ln2_g"], p["ln2_b"], g.eps), p, g), g.dropout, k3)


PLAIN_REMAT = {"selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
               "full": jax.checkpoint_policies.nothing_saveable}


def plain_logits(params, tokens, g: PlainGPT, key=None):
    """tokens [b, s] -> logits [b, s, Vp]:
        x = dropout(wte[tokens] + wpe[:s])          [b, s, h] in the compute dtype
        x = block_l(... block_1(x))                 a lax.scan over the stacked blocks
        logits = LN_f(x) wte^T                      the tied output layer
    `key` None: no dropout (the rates must then be 0 or the caller is evaluating)."""
    s = tokens.shape[1]
    x = params["wte"][tokens].astype(g.dtype) + params["wpe"][None, :s].astype(g.dtype)
    drop = key is not None
    k0, kl = jax.random.split(key) if drop else (None, None)
    x = _dropout(x, g.dropout, k0) if drop else x
    layer = lambda x, xs: (plain_block(x, xs[0], g, xs[1]), None)   # noqa: E731
    if g.remat != "none":
        layer = jax.checkpoint(layer, policy=PLAIN_REMAT[g.remat])
    x, _ = jax.lax.scan(layer, x, (params["blocks"], jax.random.split(kl, g.l) if drop else None))
    x = plain_layer_norm(x, params["ln_f_g"], params["ln_f_b"], g.eps)
    return x @ params["wte"].T.astype(x.dtype)


def plain_loss_sum(logits, labels, V: int):
    """Sum over tokens of -log softmax(z)[label] = logsumexp(z) - z[label], in fp32, over the
    first V columns (the padding columns get no probability). logits [b, s, Vp], labels [b, s]."""
    z = logits[..., :V].astype(jnp.float32)
    picked = jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(jax.nn.logsumexp(z, axis=-1) - picked)


def plain_optimizer(cfg) -> optax.GradientTransformation:
    """clip by global norm (optim.clip_grad, 0 = off), then AdamW with lr(step): 0 -> lr linearly
    over optim.warmup_steps, then cosine to optim.min_lr over optim.decay_steps (0: the rest of
    train.steps); decoupled weight decay on the `w*` leaves only."""
    op = cfg.optim
    decay = op.decay_steps or max(1, cfg.train.steps - op.warmup_steps)
    lr = optax.warmup_cosine_decay_schedule(0.0, op.lr, op.warmup_steps, op.warmup_steps + decay, op.min_lr)
    mask = lambda params: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key.startswith("w"), params)  # noqa: E731
    adamw = optax.adamw(lr, b1=op.beta1, b2=op.beta2, eps=op.eps, weight_decay=op.weight_decay, mask=mask)
    return optax.chain(optax.clip_by_global_norm(op.clip_grad), adamw) if op.clip_grad > 0 else adamw


def plain_train_step(cfg, g: PlainGPT, tx: optax.GradientTransformation):
    """(state, batch [B, s+1]) -> (state, {loss, grad_norm}), jitted, the state donated.

    loss = mean over the B s tokens of the cross-entropy; its gradient with respect to the fp32
    master weights is accumulated in fp32 over m micro-batches of b rows (a lax.scan; each
    micro-batch adds sum(its token losses) / (B s)), then one optimizer update. Dropout keys:
    fold_in(key(train.seed), step), then the micro-batch index."""
    tr = cfg.train
    B = tr.global_batch
    m = tr.micro_batches or B // tr.micro_batch
    drop = g.dropout > 0 or g.attention_dropout > 0

    def micro_loss(params, tokens, key):                               # tokens [b, s+1]
        return plain_loss_sum(plain_logits(params, tokens[:, :-1], g, key), tokens[:, 1:], g.V) / (B * g.s)

    grad_fn = jax.value_and_grad(micro_loss)

    def step(state: PlainState, batch):
        key = jax.random.fold_in(jax.random.key(tr.seed), state.step) if drop else None

        def accumulate(acc, xs):
            tokens, i = xs
            loss, grads = grad_fn(state.params, tokens, None if key is None else jax.random.fold_in(key, i))
            return jax.tree.map(jnp.add, acc, grads), loss

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, losses = jax.lax.scan(accumulate, zeros, (batch.reshape(m, B // m, -1), jnp.arange(m)))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new = PlainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1)
        return new, {"loss": jnp.sum(losses), "grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, donate_argnums=0)


# ============================================================================ the benchmark


def build(name: str, overrides: list[str]) -> Trainer:
    """A Trainer for configs/NAME.yaml on a (1, 1, 1) mesh, after the config's validation pass."""
    cfg = load_config(os.path.join(CONFIGS, f"{name}.yaml"), overrides)
    validate(cfg, 1)
    return Trainer(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), vocab=VOCAB)


def timed_compile(trainer: Trainer):
    """(compiled train step, seconds spent lowering and compiling it)."""
    cfg = trainer.cfg
    state = abstract_state(trainer)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=batch_sharding(trainer.mesh))
    t0 = time.perf_counter()
    compiled = trainer.train_step.lower(state, batch).compile()
    return compiled, time.perf_counter() - t0


def run_alternating(sides: dict, steps: int) -> dict:
    """Every side's step on each of its WARMUP_STEPS + `steps` batches, the sides taking turns
    (A, B, A, B, ...) so that changes in the machine's load hit all of them alike; each step is
    synchronised with `jax.block_until_ready` on the new state and the metrics.
    sides: name -> (compiled step, initial state, batches). -> name -> {'step_s': seconds of the
    timed steps, 'loss', 'grad_norm': every step's, warm-up included}."""
    out = {name: {"step_s": [], "loss": [], "grad_norm": []} for name in sides}
    states = {name: side[1] for name, side in sides.items()}
    for i in range(WARMUP_STEPS + steps):
        for name, (compiled, _, batches) in sides.items():
            t0 = time.perf_counter()
            states[name], metrics = compiled(states[name], batches[i])
            jax.block_until_ready((states[name], metrics))
            seconds = time.perf_counter() - t0
            if i >= WARMUP_STEPS:
                out[name]["step_s"].append(seconds)
            out[name]["loss"].append(float(metrics["loss"]))
            out[name]["grad_norm"].append(float(metrics["grad_norm"]))
    for name, run in out.items():
        if not all(np.isfinite(run["loss"])):
            raise FloatingPointError(f"{name}: non-finite loss {run['loss']}")
    return out


def params_from_mtjax(p) -> dict:
    """The baseline's parameters (`PlainGPT` layout) holding the values of mtjax's GPT parameter
    tree (canonical layer order): the Q, K, V kernels [l, h, a, d] flattened to [l, h, ad] and
    concatenated into w_qkv, O [l, a, d, h] flattened to [l, ad, h], the rest renamed. Fresh
    copies on the default device, so that donating either state leaves the other intact."""
    p = jax.tree.map(np.asarray, p)
    layers, att, mlp = p["layers"], p["layers"]["attn"], p["layers"]["mlp"]
    l, h = att["q"]["kernel"].shape[:2]
    blocks = {"ln1_g": layers["ln_attn"]["scale"], "ln1_b": layers["ln_attn"]["bias"],
              "w_qkv": np.concatenate([att[n]["kernel"].reshape(l, h, -1) for n in "qkv"], -1),
              "b_qkv": np.concatenate([att[n]["bias"].reshape(l, -1) for n in "qkv"], -1),
              "w_o": att["o"]["kernel"].reshape(l, -1, h), "b_o": att["o"]["bias"],
              "ln2_g": layers["ln_mlp"]["scale"], "ln2_b": layers["ln_mlp"]["bias"],
              "w_fc": mlp["fc1"]["kernel"], "b_fc": mlp["fc1"]["bias"],
              "w_proj": mlp["fc2"]["kernel"], "b_proj": mlp["fc2"]["bias"]}
    tree = {"wte": p["embed"]["embedding"], "wpe": p["pos_embedding"],
            "ln_f_g": p["ln_final"]["scale"], "ln_f_b": p["ln_final"]["bias"], "blocks": blocks}
    return jax.device_put(jax.tree.map(np.array, tree), jax.devices()[0])


def plain_side(trainer: Trainer, mtjax_params, tokens: list[np.ndarray]):
    """(compiled plain step, its initial state from mtjax's initial parameters, its batches,
    compile seconds) for the trainer's config."""
    cfg = trainer.cfg
    g = plain_spec(cfg, trainer.vocab)
    if g.Vp != trainer.padded_vocab:
        raise ValueError(f"padded vocabularies differ: plain {g.Vp}, mtjax {trainer.padded_vocab}")
    tx = plain_optimizer(cfg)
    params = params_from_mtjax(mtjax_params)
    state = PlainState(params, tx.init(params), jnp.int32(0))
    batches = [jax.device_put(np.asarray(t, np.int32), jax.devices()[0]) for t in tokens]
    t0 = time.perf_counter()
    compiled = plain_train_step(cfg, g, tx).lower(state, batches[0]).compile()
    return compiled, state, batches, time.perf_counter() - t0


def same_model_tolerance(cfg) -> float:
    """Relative tolerance on the first step's loss and gradient norm: 1e-5 where both sides
    compute the same function in fp32 on CPU without dropout; 2e-2 under bf16 or on a GPU (bf16
    roundings in other places, TF32 matmuls); 1e-1 with dropout (each side draws its own masks)."""
    m = cfg.model
    if m.dropout > 0 or m.attention_dropout > 0:
        return 1e-1
    return 1e-5 if cfg.train.precision == "fp32" and jax.default_backend() == "cpu" else 2e-2


def compare(trainer: Trainer, compiled, plain_compiled, runs: dict, plain_compile_s: float) -> dict:
    """The baseline's figures and the checks that it does mtjax's work (see the module docstring)."""
    cfg, tokens = trainer.cfg, trainer.plan.tokens_per_step
    mt, pl = runs["mtjax"], runs["plain"]
    rel = lambda a, b: abs(a - b) / abs(b)   # noqa: E731
    tol = same_model_tolerance(cfg)
    loss_diffs = [rel(a, b) for a, b in zip(mt["loss"], pl["loss"])]
    first_loss, first_gnorm = loss_diffs[0], rel(mt["grad_norm"][0], pl["grad_norm"][0])
    costs = {"mtjax": flops_report(compiled), "plain": flops_report(plain_compiled)}
    ca = {k: c["flops"] for k, c in costs.items()}
    mm = {"mtjax": executed_dot_flops(compiled.as_text())["flops"],
          "plain": executed_dot_flops(plain_compiled.as_text())["flops"]}
    step_m, step_p = statistics.median(mt["step_s"]), statistics.median(pl["step_s"])
    return {"plain_compile_s": plain_compile_s, "plain_step_s": step_p, "plain_tokens_per_s": tokens / step_p,
            "mtjax_over_plain": step_p / step_m,
            "mtjax_over_plain_per_round": statistics.median(p / m for m, p in zip(mt["step_s"], pl["step_s"])),
            "step_s": {"mtjax": mt["step_s"], "plain": pl["step_s"]},
            "cost_analysis_flops": ca, "cost_analysis_ratio": ca["mtjax"] / ca["plain"],
            "cost_analysis_bytes": {k: c["bytes_accessed"] for k, c in costs.items()},
            "matmul_flops": mm, "matmul_flops_ratio": mm["mtjax"] / mm["plain"],
            "loss": {"mtjax": mt["loss"], "plain": pl["loss"]},
            "grad_norm": {"mtjax": mt["grad_norm"], "plain": pl["grad_norm"]},
            "ln_V": math.log(trainer.vocab), "first_loss_rel_diff": first_loss,
            "first_grad_norm_rel_diff": first_gnorm, "max_loss_rel_diff": max(loss_diffs),
            "tolerance": tol, "same_model": first_loss <= tol and first_gnorm <= tol}


def bench_config(name: str, overrides: list[str], steps: int, baseline: bool = True) -> dict:
    trainer = build(name, overrides)
    cfg = trainer.cfg
    compiled, compile_s = timed_compile(trainer)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, VOCAB, (cfg.train.global_batch, cfg.model.seq_len + 1))
              for _ in range(WARMUP_STEPS + steps)]
    state = trainer.init_state()
    sides = {"mtjax": (compiled, state, [trainer.put_batch(t) for t in tokens])}
    if baseline:   # built before mtjax's first step donates `state`
        plain_compiled, plain_state, plain_batches, plain_compile_s = plain_side(trainer, state.params, tokens)
        sides["plain"] = (plain_compiled, plain_state, plain_batches)
    runs = run_alternating(sides, steps)
    step_s = statistics.median(runs["mtjax"]["step_s"])
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(trainer.init_state).params))
    flops = model_flops(cfg.model, trainer.plan)
    row = {"config": name, "overrides": overrides, "params": params, "layers": cfg.model.num_layers,
           "hidden": cfg.model.hidden_size, "seq_len": cfg.model.seq_len,
           "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch,
           "precision": cfg.train.precision, "steps": steps, "compile_s": compile_s, "step_s": step_s,
           "tokens_per_s": cfg.train.global_batch * cfg.model.seq_len / step_s,
           "tflops": flops / step_s / 1e12, "model_flops": flops,
           "losses": [float(v) for v in runs["mtjax"]["loss"]]}
    if baseline:
        row["baseline"] = compare(trainer, compiled, plain_compiled, runs, plain_compile_s)
    return row


def bench_depth() -> dict:
    """Fastest compile time of the tiny model at each of DEPTHS layers (fresh Trainer each time)."""
    best = {}
    for _ in range(DEPTH_REPEATS):
        for layers in DEPTHS:
            _, seconds = timed_compile(build("tiny", [f"model.num_layers={layers}"]))
            best[layers] = min(seconds, best.get(layers, float("inf")))
    return {"config": "tiny", "compile_s_by_layers": best, "ratio": best[DEPTHS[1]] / best[DEPTHS[0]]}


def table(rows: list[dict], depth: dict | None, peak: float | None = None) -> str:
    mfu = f" MFU (of {peak:g}) |" if peak else ""
    lines = ["| config | params | l | h | s | B (b) | precision | compile s | step s (median of N) | N | tokens/s "
             "| TFLOP/s |" + mfu,
             "|---|---:|---:|---:|---:|---:|:--|---:|---:|---:|---:|---:|" + ("---:|" if peak else "")]
    for r in rows:
        lines.append(f"| {r['config']} | {r['params'] / 1e6:.2f}M | {r['layers']} | {r['hidden']} | {r['seq_len']} "
                     f"| {r['global_batch']} ({r['micro_batch']}) | {r['precision']} | {r['compile_s']:.2f} "
                     f"| {r['step_s']:.4f} | {r['steps']} | {r['tokens_per_s']:,.0f} | {r['tflops']:.3f} |"
                     + (f" {100 * r['tflops'] / peak:.1f}% |" if peak else ""))
    if any("baseline" in r for r in rows):
        lines += ["", "| config | mtjax tokens/s | plain tokens/s | mtjax / plain | plain compile s "
                  "| XLA flops mtjax / plain | matmul flops mtjax / plain | first loss (ln V) "
                  "| loss rel diff: step 1, max | grad norm rel diff | same model |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--|"]
        for r in rows:
            if "baseline" not in r:
                continue
            c = r["baseline"]
            lines.append(f"| {r['config']} | {r['tokens_per_s']:,.0f} | {c['plain_tokens_per_s']:,.0f} "
                         f"| {c['mtjax_over_plain']:.3f} | {c['plain_compile_s']:.2f} | {c['cost_analysis_ratio']:.4f} "
                         f"| {c['matmul_flops_ratio']:.4f} | {c['loss']['mtjax'][0]:.4f} ({c['ln_V']:.4f}) "
                         f"| {c['first_loss_rel_diff']:.1e}, {c['max_loss_rel_diff']:.1e} "
                         f"| {c['first_grad_norm_rel_diff']:.1e} | {'yes' if c['same_model'] else 'NO'} "
                         f"(tol {c['tolerance']:g}) |")
    if depth is None:
        return "\n".join(lines)
    lo, hi = DEPTHS
    by = depth["compile_s_by_layers"]
    lines.append(f"\ncompile time, tiny model (fastest of {DEPTH_REPEATS}): {lo} layers {by[lo]:.2f} s, "
                 f"{hi} layers {by[hi]:.2f} s, ratio {hi}/{lo} = {depth['ratio']:.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_train.py", description=__doc__.splitlines()[2])
    p.add_argument("--steps", type=int, help="timed steps per config after 2 warm-up steps "
                   f"(default: {', '.join(f'{n} {steps}' for n, (_, steps) in BENCH.items())})")
    p.add_argument("--configs", default="tiny,gpt100m", help=f"comma-separated, from {', '.join(BENCH)}")
    p.add_argument("--override", action="append", default=[], metavar="K=V",
                   help="group.field=value appended to every config's overrides (repeatable)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of the device: adds an MFU column")
    p.add_argument("--no-depth", action="store_true", help="skip the tiny model's compile time at 4 and 32 layers")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the plain-JAX GPT baseline (its steps alternate with mtjax's otherwise)")
    p.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in BENCH]
    if unknown or (args.steps is not None and args.steps < 1):
        p.error(f"unknown config {unknown[0]}" if unknown else "--steps must be at least 1")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for name in names:
        overrides, steps = BENCH[name]
        overrides, steps = overrides + args.override, args.steps or steps
        print(f"{name}: configs/{name}.yaml {' '.join(overrides) or '(no overrides)'}, {steps} timed steps",
              flush=True)
        rows.append(bench_config(name, overrides, steps, not args.no_baseline))
    depth = None
    if not args.no_depth:
        print(f"depth: configs/tiny.yaml model.num_layers={DEPTHS[0]} vs {DEPTHS[1]}", flush=True)
        depth = bench_depth()
    print(f"load average at the end {os.getloadavg()[0]:.2f}\n")
    print(table(rows, depth, args.peak_tflops))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "argv": argv,
                       "peak_tflops": args.peak_tflops, "rows": rows, "depth": depth}, f, indent=1)
    different = [r["config"] for r in rows if "baseline" in r and not r["baseline"]["same_model"]]
    if different:
        print(f"\nthe plain baseline does not compute what mtjax computes for {', '.join(different)} "
              "(first loss or gradient norm beyond the tolerance)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

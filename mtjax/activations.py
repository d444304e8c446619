"""Activation memory per layer: Korthikanti et al.'s count, what autodiff keeps, what XLA holds.

Shape legend: s sequence, b micro-batch, h hidden, a heads, k kv heads, f MLP hidden, t tensor
size, q grid side, d grid depth, l layers; sbh = s b h.

Three measures of the bytes one layer keeps for its backward, per device and micro-batch:
  `korthikanti_bytes`      the formula (Korthikanti et al. 2022, "Reducing Activation
                           Recomputation in Large Transformer Models"), with the value width a
                           parameter and dropout masks at 1 byte; `grid_activation_bytes` the
                           same count for the 2D / 2.5D grid (`model/grid_model.py`), term by term;
  `saved_bytes_per_layer`  the residuals of `jax.vjp` of one micro-batch's loss (the leaves of its
                           pullback, traced inside shard_map, nothing runs): the saved set;
  `xla_stacked_bytes`      the temp buffers of the compiled gradient that carry the layer
                           scan's stacked residuals, from XLA's buffer assignment.
"""
from __future__ import annotations

import os
import re
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

MODES = ("none", "selective", "full")


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, mode: str = "none",
                      width: int = 2, dropout: bool = True) -> float:
    """Bytes of activations one layer keeps per device, values `width` bytes, masks 1 byte.

    With r = t under sequence parallelism (else 1) and m = 1 with dropout (else 0):
      none       sbh ((4w + 2m)/r + 12w/t) + a s^2 b (w + m (w + 1)) / t
      selective  sbh ((4w + 2m)/r + 12w/t)
      full       w sbh / r                                  (the layer input only)
    The sbh terms: the two norms' inputs and the QKV and fc1 inputs (4 values) and the two
    hidden dropout masks, replicated over `tensor` unless SP splits them along s; Q, K, V, the
    output projection's input, fc1's output and GeLU's output (12 values), split over t. The
    a s^2 b terms: the softmax output, and with dropout its mask and output (P V's input).
    w = 2 with dropout gives the paper's sbh(34 + 5as/h) at t = 1, sbh(10 + 24/t + 5as/(ht)),
    (sbh/t)(34 + 5as/h) with SP, sbh(10 + 24/t) and 34 sbh/t selective, 2 sbh full."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    sbh, r, m = s * b * h, (t if sp else 1), (1 if dropout else 0)
    if mode == "full":
        return width * sbh / r
    layer = sbh * ((4 * width + 2 * m) / r + 12 * width / t)
    if mode == "selective":
        return layer
    return layer + a * s * s * b * (width + m * (width + 1)) / t


def grid_activation_terms(s: int, b: int, h: int, a: int, q: int, depth: int = 1, mode: str = "none",
                          width: int = 2, dropout: bool = True, kv_heads: int = 0, ffn: int = 0,
                          swiglu: bool = False, rms: bool = False) -> dict:
    """Bytes of activations one layer keeps per device on the q x q (x d) grid of
    `model/grid_model.py`, term by term; values `width` bytes, masks 1 byte, statistics fp32.

    Every activation of a grid layer is a block [r, s, ./q] with r = b/(d q) rows: n = s b/(d q)
    positions of h/q (or a/q heads, f/q) columns. With k kv heads (k = a by default), f the MLP
    hidden (4h by default) and t = d q^2:
      values      w n (5h + h(1 + 2k/a) + c f)/q = w sbh (6 + 2k/a + c f/h)/t, c = 2 (GeLU), 3 (SwiGLU):
                  h/q each: the first norm's input (the layer input), its output (the input the Q,
                  K, V linears keep: one buffer, `grid_ops.grid_linear` keeps the block, not the
                  gathered X), the O linear's input, the second norm's input, its output (fc1's,
                  or gate's and up's); Q, K, V (after RoPE) (a + 2k) d_h/q with a d_h = h; the MLP's
                  activation keeps its inputs (fc1's output, or gate and up), fc2 its input (the
                  activation's output)
      attention   w a s^2 b/t: the softmax output P [r, a/q, s, s] (no attention dropout on a
                  grid: P is P V's input too); 0 under selective (the core keeps only Q, K, V)
      masks       2 sbh/t: the two hidden dropout masks, 1 byte (0 without dropout)
      statistics  4 n (2 norms) (mean and 1/sigma for LayerNorm, 1/sigma for RMSNorm): fp32
                  [r, s, 1] per norm, the same on every COL rank (not split by q)
    full keeps the layer's input alone: values = w sbh/t, the rest 0 (block recomputation keeps
    full's on its first N layers and none's on the others).
    With k = a, f = 4h and GeLU, values + attention + masks is Korthikanti's count under
    sequence parallelism at the same t with no attention dropout (`korthikanti_bytes(t, sp=True)`
    less a s^2 b (w + 1)/t with dropout): 16 w sbh/t; at w = 2 with dropout sbh(34 + 2as/h)/t,
    and at q = d = 1 the paper's t = 1 count without attention dropout, sbh(34 + 2as/h)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t, n = q * q * depth, s * b / (depth * q)
    sbh = s * b * h
    if mode == "full":
        return {"values": width * sbh / t, "attention": 0.0, "masks": 0.0, "statistics": 0.0}
    k, f = kv_heads or a, ffn or 4 * h
    return {"values": width * sbh * (6 + 2 * k / a + (3 if swiglu else 2) * f / h) / t,
            "attention": width * a * s * s * b / t if mode == "none" else 0.0,
            "masks": 2 * sbh / t if dropout else 0.0,
            "statistics": 4 * n * 2 * (1 if rms else 2)}


def grid_activation_bytes(*args, **kwargs) -> float:
    """The sum of `grid_activation_terms` (same arguments): bytes per layer and device on a grid."""
    return sum(grid_activation_terms(*args, **kwargs).values())


def saved_residuals(trainer, batch: int) -> list:
    """ShapeDtypeStructs (this device's shapes) of everything autodiff keeps for the backward of
    the loss of `batch` rows (the step's objective, `scaled_loss_sum`: 1D or grid): the leaves of
    the pullback of `jax.vjp(loss, params)` inside shard_map over the trainer's mesh (the grid's
    on a 2d / 2.5d grid; no pipeline: every layer on every device); with context parallelism
    each rank's s/c tokens of the row (`inputs_and_labels`)."""
    from mtjax.training.loss import scaled_loss_sum
    from mtjax.training.step import inputs_and_labels, local_model

    cfg, plan, found = trainer.cfg, trainer.plan, []
    model = local_model(cfg.model, plan, stage=False)

    def body(params, tokens):
        inputs, labels = inputs_and_labels(tokens, plan)     # [b, s/c]: this context rank's chunks

        def loss(p):
            logits = model.apply({"params": p}, inputs, rngs={"dropout": jax.random.key(0)})
            return scaled_loss_sum(logits, labels, plan)
        found.extend(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(jax.vjp(loss, params)[1]))
        return jnp.zeros(())

    fn = jax.shard_map(body, mesh=trainer.mesh, in_specs=(trainer.specs.params, P()), out_specs=P(),
                       check_vma=False)
    jax.eval_shape(fn, jax.eval_shape(trainer.init_state).params,
                   jax.ShapeDtypeStruct((batch, cfg.model.seq_len + 1), jnp.int32))
    return found


def saved_bytes_per_layer(trainer, batch: int = 0) -> dict:
    """Bytes per layer and device of the saved set at `batch` rows (default: the micro-batch), by
    dtype, and 'total' (block recomputation: the mean over its two runs of layers). Each layer
    scan stacks its residuals along a leading dimension, its number of layers; of those, the
    ones that grow with the batch are activations (traced again at twice the rows to tell), the
    others the layer's weights or their 16-bit casts ('weights', not in the total)."""
    from mtjax.training.step import local_model

    b, l = batch or trainer.plan.micro_batch, trainer.plan.num_layers
    runs = set(local_model(trainer.cfg.model, trainer.plan, stage=False).layer_runs)
    one, two = saved_residuals(trainer, b), saved_residuals(trainer, 2 * b)
    if len(one) != len(two):
        raise RuntimeError("the residuals at b and 2b rows do not pair up")
    out = {"total": 0.0, "weights": 0.0}
    for r1, r2 in zip(one, two):
        if r1.ndim == 0 or r1.shape[0] not in runs or r2.ndim == 0 or r2.shape[0] != r1.shape[0]:
            continue     # not stacked, or led by b (the head's, whose size-1 axes may differ at b and 2b)
        if r2.ndim != r1.ndim:
            raise RuntimeError(f"a layer's residual {r1.shape} at b rows has no counterpart at 2b rows")
        nbytes = r1.size * r1.dtype.itemsize / l
        kind = "weights" if r2.size == r1.size else str(r1.dtype)
        out[kind] = out.get(kind, 0.0) + nbytes
        out["total"] += 0.0 if kind == "weights" else nbytes
    return out


def compile_grad(trainer, dump_dir: str | None = None):
    """The trainer's gradient function (one micro-batch) compiled for abstract inputs; with
    `dump_dir` XLA writes this compile's files there."""
    from mtjax.inspect import abstract_state
    from mtjax.training.step import batch_sharding

    cfg = trainer.cfg
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=batch_sharding(trainer.mesh))
    key = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(trainer.mesh, P()))
    options = {"xla_dump_to": dump_dir} if dump_dir else None
    return jax.jit(trainer.grad_fn).lower(abstract_state(trainer).params, batch, rng).compile(compiler_options=options)


_VALUE = re.compile(r"value: <\d+ \S+ @\d+> \(size=(\d+),offset=(\d+)\): \w+\[([\d,]*)\]")


def _local_param_shapes(trainer) -> set:
    """Each parameter's shape on one device, and the stacks of the layers' joined column kernels
    (`model/joined_columns.py`), which the step may make from them."""
    from mtjax.inspect import abstract_state
    from mtjax.model.joined_columns import join_columns
    local = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.sharding.shard_shape(a.shape), a.dtype),
                         abstract_state(trainer).params)
    shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(local)}
    if isinstance(local, dict) and isinstance(local.get("layers"), dict):
        joined = jax.eval_shape(lambda p: join_columns(p, True)[1], local["layers"])
        shapes |= {tuple(leaf.shape) for leaf in jax.tree.leaves(joined)}
    return shapes


def xla_stacked_bytes(trainer, runs: set | None = None) -> dict:
    """Bytes per device of the compiled gradient's buffers with a leading dimension in `runs`
    (the layer scans' lengths; default {l}), from XLA's buffer assignment: {'weights': shaped
    like a stacked parameter (the fp32 weight gradients), 'activations': the rest, the stacked
    residuals}. Every allocation but the entry parameters and constants is read: XLA:CPU puts
    some stacks (the dropout masks among them) in allocations of their own beside the temp heap,
    which later hold the step's outputs. Values at one offset of one allocation share one buffer
    (in-place updates, or later reuse): counted once, at their largest, as residuals if any is."""
    runs = runs or {trainer.plan.num_layers}
    weights = {shape[1:] for shape in _local_param_shapes(trainer)}
    with tempfile.TemporaryDirectory(prefix="mtjax_buffers_") as dump:
        compile_grad(trainer, dump)
        name = next(f for f in sorted(os.listdir(dump)) if f.endswith("after_optimizations-buffer-assignment.txt"))
        with open(os.path.join(dump, name), encoding="utf-8") as f:
            text = f.read()
    held = {}                                    # (allocation, offset) -> {kind: largest value}
    for block in re.split(r"\n(?=allocation \d+:)", text):
        header = block.split("\n", 1)[0]
        if not header.startswith("allocation ") or "parameter" in header or "constant" in header:
            continue
        for size, offset, dims in _VALUE.findall(block):
            shape = tuple(int(d) for d in dims.split(",") if d)
            if len(shape) > 1 and shape[0] in runs:
                kind = "weights" if shape[1:] in weights else "activations"
                sizes = held.setdefault((header.split(":")[0], int(offset)), {})
                sizes[kind] = max(sizes.get(kind, 0), int(size))
    out = {"weights": 0, "activations": 0}
    for sizes in held.values():                  # a place that once holds residuals counts as theirs
        kind = "activations" if "activations" in sizes else "weights"
        out[kind] += sizes[kind]
    return out

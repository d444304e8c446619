"""One validation pass over a Config, before anything heavy starts.

Each problem raises ConfigError naming the key; the first one found wins.
"""
from __future__ import annotations

import os

from mtjax.config.data_path import corpora, entry_key
from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config, ModelConfig
from mtjax.parallel.grid import GRIDS, grid_side
from mtjax.pipeline.schedules import SCHEDULES, SPLIT_SCHEDULES, chunks_per_stage, make_schedule

ARCHS = ("gpt", "llama")
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full", "block")
ON_NONFINITE = ("stop", "skip")
ACTIVATIONS = {"gpt": ("gelu", "gelu_tanh"), "llama": ("swiglu",)}   # the MLP activations of each arch
ROPE_SCALINGS = ("none", "linear", "llama3")
ATTENTIONS = ("auto", "xla", "dot_product")   # core attention implementations (model/core_attention.py)
LLAMA3_FIELDS = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_positions")


def _check(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(key, problem)


def _positive(cfg: Config, keys: list[str]) -> None:
    for key in keys:
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        _check(value > 0, key, f"must be positive, got {value}")


def _divides(small: int, big: int, key: str, what: str) -> None:
    _check(big % small == 0, key, f"{what}")


def resolve_mesh_shape(cfg: Config, num_devices: int) -> tuple[int, int, int]:
    """(d, p, t) with data=-1 resolved against `num_devices`."""
    par = cfg.parallel
    _check(par.pipe >= 1, "parallel.pipe", f"must be >= 1, got {par.pipe}")
    _check(par.tensor >= 1, "parallel.tensor", f"must be >= 1, got {par.tensor}")
    _check(par.data == -1 or par.data >= 1, "parallel.data", f"must be >= 1 or -1, got {par.data}")
    data = par.data
    if data == -1:
        _check(num_devices % (par.pipe * par.tensor) == 0, "parallel.data",
               f"-1 needs the {num_devices} devices to be a multiple of pipe*tensor = {par.pipe * par.tensor}")
        data = num_devices // (par.pipe * par.tensor)
    size = data * par.pipe * par.tensor
    _check(size == num_devices, "parallel",
           f"mesh data*pipe*tensor = {data}*{par.pipe}*{par.tensor} = {size} differs from the {num_devices} devices "
           f"(use --cpu-devices {size} to simulate them)")
    return data, par.pipe, par.tensor


# Far beyond any device, and below where XLA's shape arithmetic overflows (an abort, not an error).
ELEMENTS_LIMIT = 2 ** 48


def _validate_grid(cfg: Config, t: int) -> int:
    """`parallel.tensor_grid` and `tensor_depth` against t; -> the size heads, kv heads, h, f and V
    are split by: t for 1d, the grid side q for 2d / 2.5d."""
    par, m = cfg.parallel, cfg.model
    _check(par.tensor_grid in GRIDS, "parallel.tensor_grid", f"must be one of {', '.join(GRIDS)}, got {par.tensor_grid!r}")
    _check(par.tensor_depth >= 1, "parallel.tensor_depth", f"must be >= 1, got {par.tensor_depth}")
    if par.tensor_grid == "1d":
        _check(par.tensor_depth == 1, "parallel.tensor_depth", "only parallel.tensor_grid=2.5d has a depth")
        return t
    depth = par.tensor_depth if par.tensor_grid == "2.5d" else 1
    _check(par.tensor_grid == "2d" or t % depth == 0, "parallel.tensor_depth",
           f"depth {depth} does not divide parallel.tensor {t}")
    q = grid_side(t, depth)
    shape = "a square q^2" if depth == 1 else f"q^2 * tensor_depth (q^2 * {depth})"
    _check(q is not None, "parallel.tensor", f"tensor_grid={par.tensor_grid} needs {shape}, got {t}")
    _divides(q, m.hidden_size, "model.hidden_size", f"hidden_size {m.hidden_size} is not divisible by the grid side {q}")
    _divides(q, m.kv_heads, "model.num_kv_heads", f"num_kv_heads {m.kv_heads} is not divisible by the grid side {q}")
    _check(not par.sequence_parallel, "parallel.sequence_parallel",
           f"tensor_grid={par.tensor_grid} splits the batch and h, not the sequence: turn it off")
    _check(m.attention_dropout == 0, "model.attention_dropout",
           f"attention dropout is not implemented on tensor_grid={par.tensor_grid}")
    return q


def _validate_grid_batch(cfg: Config, b: int, t: int) -> None:
    """The micro-batch splits into d q row blocks on a grid."""
    par = cfg.parallel
    if par.tensor_grid == "1d":
        return
    depth = par.tensor_depth if par.tensor_grid == "2.5d" else 1
    blocks = depth * grid_side(t, depth)
    _divides(blocks, b, "train.micro_batch",
             f"micro-batch {b} is not divisible by the grid's batch blocks depth*q = {blocks}")


def _validate_sizes(cfg: Config, b: int, t: int) -> None:
    """No tensor of the step may be absurdly large: refused by name instead of crashing XLA."""
    m = cfg.model
    tensors = {"model.hidden_size": m.num_layers * m.hidden_size * max(m.ffn_size, m.num_heads * m.head_dim),
               "model.vocab_size": (m.vocab_size + m.vocab_multiple * t) * m.hidden_size,
               "model.seq_len": b * m.num_heads * m.seq_len * m.seq_len,
               "train.micro_batch": b * m.seq_len * max(m.ffn_size, m.vocab_size + m.vocab_multiple * t)}
    for key, elements in tensors.items():
        _check(elements <= ELEMENTS_LIMIT, key, f"a tensor of the step would hold {elements:.3g} elements "
                                                f"(more than {ELEMENTS_LIMIT:.3g}): no device could hold it")


def _validate_model(cfg: Config, t: int, p: int) -> None:
    m = cfg.model
    _check(m.arch in ARCHS, "model.arch", f"must be one of {', '.join(ARCHS)}, got {m.arch!r}")
    _positive(cfg, ["model.num_layers", "model.hidden_size", "model.num_heads", "model.seq_len",
                    "model.vocab_multiple", "model.norm_eps", "model.init_std"])
    _check(m.num_kv_heads >= 0, "model.num_kv_heads", "must be >= 0")
    _check(m.ffn_hidden_size >= 0, "model.ffn_hidden_size", "must be >= 0")
    _check(m.vocab_size >= 0, "model.vocab_size", "must be >= 0")
    for key, rate in (("model.dropout", m.dropout), ("model.attention_dropout", m.attention_dropout)):
        _check(0.0 <= rate < 1.0, key, f"must be in [0, 1), got {rate}")
    _check(m.kv_channels >= 0, "model.kv_channels", f"must be >= 0, got {m.kv_channels}")
    if not m.kv_channels:
        _divides(m.num_heads, m.hidden_size, "model.hidden_size",
                 f"hidden_size {m.hidden_size} is not divisible by num_heads {m.num_heads} (or set model.kv_channels)")
    _divides(m.kv_heads, m.num_heads, "model.num_kv_heads",
             f"num_heads {m.num_heads} is not divisible by num_kv_heads {m.kv_heads}")
    _divides(t, m.num_heads, "model.num_heads", f"num_heads {m.num_heads} is not divisible by parallel.tensor {t}")
    _check(m.kv_heads % t == 0 or t % m.kv_heads == 0, "model.num_kv_heads",
           f"num_kv_heads {m.kv_heads} and parallel.tensor {t}: one must divide the other")
    _divides(t, m.ffn_size, "model.ffn_hidden_size", f"ffn size {m.ffn_size} is not divisible by parallel.tensor {t}")
    v = cfg.parallel.virtual_stages
    _check(v >= 1, "parallel.virtual_stages", f"must be >= 1, got {v}")
    v = chunks_per_stage(cfg.parallel.schedule, v) if p > 1 else v
    _divides(p * v, m.num_layers, "model.num_layers",
             f"num_layers {m.num_layers} is not divisible by pipe*virtual_stages = {p * v}"
             + (" (zbv holds 2 chunks per stage)" if cfg.parallel.schedule == "zbv" and p > 1 else ""))
    _validate_layer_options(m)
    _validate_rope(m)


def _validate_layer_options(m: ModelConfig) -> None:
    """The MLP activation and the Q/K/V biases, against the arch."""
    allowed = ACTIVATIONS[m.arch]
    _check(m.mlp_activation in allowed, "model.activation",
           f"arch {m.arch} takes {' or '.join(allowed)}, got {m.activation!r}")
    _check(not (m.qkv_bias and m.arch == "gpt"), "model.qkv_bias",
           "is for arch=llama: gpt always has biases on Q, K and V")
    _check(m.attention in ATTENTIONS, "model.attention", f"must be one of {', '.join(ATTENTIONS)}, got {m.attention!r}")
    _check(m.attention != "dot_product" or m.attention_dropout == 0, "model.attention",
           f"dot_product has no attention dropout (model.attention_dropout is {m.attention_dropout}): "
           "set it to 0, or use model.attention=xla")


def _validate_rope(m: ModelConfig) -> None:
    """Rotary embeddings (llama): an even head dimension, a base, and the frequency scaling."""
    _check(m.rope_theta > 1, "model.rope_theta", f"must be > 1 (the base of the rotary wavelengths), got {m.rope_theta}")
    # beyond these a norm or an init wipes out the signal: the run would train nothing, silently
    _check(m.norm_eps < 1, "model.norm_eps", f"must be in (0, 1), got {m.norm_eps}")
    _check(m.init_std <= 1, "model.init_std", f"must be in (0, 1], got {m.init_std}")
    _check(m.rope_scaling in ROPE_SCALINGS, "model.rope_scaling",
           f"must be one of {', '.join(ROPE_SCALINGS)}, got {m.rope_scaling!r}")
    _check(m.arch == "llama" or m.rope_scaling == "none", "model.rope_scaling",
           "is for arch=llama: gpt has learned positions, no rotary embeddings")
    if m.arch == "llama":
        key = "model.kv_channels" if m.kv_channels else "model.hidden_size"
        _check(m.head_dim % 2 == 0, key, f"rotary embeddings need an even head dimension, got {m.head_dim}")
    if m.rope_scaling == "none":
        _check(m.rope_scaling_factor == 1.0, "model.rope_scaling_factor",
               "is only used with model.rope_scaling=linear or llama3")
    else:
        _check(m.rope_scaling_factor >= 1.0, "model.rope_scaling_factor", f"must be >= 1, got {m.rope_scaling_factor}")
    if m.rope_scaling != "llama3":
        for name in LLAMA3_FIELDS:     # set away from its default, it would be ignored
            _check(getattr(m, name) == getattr(ModelConfig, name), f"model.{name}",
                   "is only used with model.rope_scaling=llama3")
        return
    _check(m.rope_low_freq_factor > 0, "model.rope_low_freq_factor", f"must be positive, got {m.rope_low_freq_factor}")
    _check(m.rope_high_freq_factor > m.rope_low_freq_factor, "model.rope_high_freq_factor",
           f"must be greater than rope_low_freq_factor {m.rope_low_freq_factor}, got {m.rope_high_freq_factor}")
    _check(m.rope_original_positions > 0, "model.rope_original_positions",
           f"must be positive, got {m.rope_original_positions}")


def batch_split(cfg: Config, d: int) -> tuple[int, int]:
    """(b, m) with B = b m d: from train.micro_batch, or from train.micro_batches when it is set."""
    tr = cfg.train
    _positive(cfg, ["train.global_batch", "train.micro_batch"])
    _check(tr.micro_batches >= 0, "train.micro_batches", "must be >= 0")
    if tr.micro_batches:
        _divides(tr.micro_batches * d, tr.global_batch, "train.micro_batches",
                 f"global_batch {tr.global_batch} is not divisible by micro_batches*data = {tr.micro_batches}*{d}")
        return tr.global_batch // (tr.micro_batches * d), tr.micro_batches
    _divides(tr.micro_batch * d, tr.global_batch, "train.global_batch",
             f"global_batch {tr.global_batch} is not divisible by micro_batch*data = {tr.micro_batch}*{d}")
    return tr.micro_batch, tr.global_batch // (tr.micro_batch * d)


def _validate_parallel(cfg: Config, d: int, p: int, t: int) -> None:
    par = cfg.parallel
    names = SCHEDULES + SPLIT_SCHEDULES
    _check(par.schedule in names, "parallel.schedule", f"must be one of {', '.join(names)}, got {par.schedule!r}")
    _check(par.max_in_flight >= 0, "parallel.max_in_flight",
           f"must be >= 0 (0 = the schedule's own), got {par.max_in_flight}")
    _check(par.max_in_flight == 0 or p > 1, "parallel.max_in_flight",
           f"max_in_flight = {par.max_in_flight} needs pipeline parallelism (parallel.pipe > 1)")
    _check(par.virtual_stages >= 1, "parallel.virtual_stages", "must be >= 1")
    _check(par.virtual_stages == 1 or par.schedule == "interleaved", "parallel.virtual_stages",
           "virtual_stages > 1 needs parallel.schedule=interleaved")
    _check(par.virtual_stages == 1 or p > 1, "parallel.virtual_stages",
           f"virtual_stages = {par.virtual_stages} needs pipeline parallelism (parallel.pipe > 1)")
    if par.sequence_parallel:
        _divides(t, cfg.model.seq_len, "model.seq_len",
                 f"seq_len {cfg.model.seq_len} is not divisible by parallel.tensor {t} (sequence parallelism)")
    _, micro_batches = batch_split(cfg, d)
    if p > 1:
        _check(micro_batches >= p, "train.global_batch",
               f"{micro_batches} micro-batches per step is fewer than parallel.pipe {p}")
    if par.schedule == "interleaved" and p > 1:
        _divides(p, micro_batches, "train.global_batch",
                 f"interleaving needs micro-batches ({micro_batches}) to be a multiple of parallel.pipe {p}")
    if par.max_in_flight and micro_batches >= p:   # whether the schedule's order meets the cap (a table build)
        try:
            make_schedule(par.schedule, p, micro_batches, par.virtual_stages, par.max_in_flight)
        except ValueError as e:
            raise ConfigError("parallel.max_in_flight", str(e)) from None


def _validate_train(cfg: Config) -> None:
    tr, op = cfg.train, cfg.optim
    _check(tr.precision in PRECISIONS, "train.precision", f"must be one of {', '.join(PRECISIONS)}, got {tr.precision!r}")
    _check(tr.recompute in RECOMPUTE, "train.recompute", f"must be one of {', '.join(RECOMPUTE)}, got {tr.recompute!r}")
    _check(tr.recompute_layers >= 0, "train.recompute_layers", f"must be >= 0, got {tr.recompute_layers}")
    _check(tr.recompute == "block" or tr.recompute_layers == 0, "train.recompute_layers",
           "is only used with train.recompute=block")
    _check(tr.on_nonfinite in ON_NONFINITE, "train.on_nonfinite",
           f"must be one of {', '.join(ON_NONFINITE)}, got {tr.on_nonfinite!r}")
    _positive(cfg, ["train.steps", "train.log_interval", "optim.lr"])
    _check(tr.eval_interval >= 0, "train.eval_interval", "must be >= 0")
    _check(tr.eval_batches >= 1, "train.eval_batches", "must be >= 1")
    _check(tr.peak_tflops >= 0, "train.peak_tflops", "must be >= 0")
    _check(tr.min_loss_scale > 0, "train.min_loss_scale", "must be positive")
    _check(tr.initial_loss_scale >= tr.min_loss_scale, "train.initial_loss_scale", "must be >= train.min_loss_scale")
    _check(tr.loss_scale_window >= 1, "train.loss_scale_window", "must be >= 1")
    _check(tr.hysteresis >= 1, "train.hysteresis", "must be >= 1")
    _check(0 <= op.min_lr <= op.lr, "optim.min_lr", f"must be in [0, optim.lr], got {op.min_lr}")
    _check(op.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    _check(op.decay_steps >= 0, "optim.decay_steps", "must be >= 0")
    _check(op.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    _check(op.clip_grad >= 0, "optim.clip_grad", "must be >= 0")
    _check(0 <= op.beta1 < 1, "optim.beta1", "must be in [0, 1)")
    _check(0 <= op.beta2 < 1, "optim.beta2", "must be in [0, 1)")
    _check(0 < op.eps < 1, "optim.eps", f"must be in (0, 1), got {op.eps}")
    ck = cfg.checkpoint
    _check(ck.interval >= 0, "checkpoint.interval", "must be >= 0")
    _check(ck.keep >= 1, "checkpoint.keep", "must be >= 1")


def _host_offload_platform() -> str | None:
    """None if the first device can move saved activations to pinned host memory, else why not.
    XLA:CPU lists a pinned_host memory kind, but its device memory is host memory already and
    its compiler drops the moves, so CPU is refused too."""
    import jax   # here, so that validating other options never starts JAX
    device = jax.devices()[0]
    if device.platform == "cpu":
        return "the CPU backend has no separate host memory to offload to"
    if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        return f"{device.platform} devices here have no pinned_host memory space"
    return None


def _validate_recompute(cfg: Config, p: int) -> None:
    """Block recomputation's N within one model chunk; offload where it means something."""
    tr = cfg.train
    if tr.recompute == "block":
        local = cfg.model.num_layers // (p * cfg.parallel.virtual_stages)
        _check(1 <= tr.recompute_layers <= local, "train.recompute_layers",
               f"block recomputation needs 1 <= recompute_layers <= {local} (layers per pipeline stage, "
               f"num_layers/(pipe*virtual_stages)), got {tr.recompute_layers}")
    if tr.offload_activations:
        _check(tr.recompute != "full", "train.offload_activations",
               "full recomputation saves only each layer's input: nothing to offload")
        why_not = _host_offload_platform()
        _check(why_not is None, "train.offload_activations", f"needs host memory on an accelerator: {why_not}")


def _validate_data(cfg: Config) -> None:
    dc = cfg.data
    _check(dc.seed >= 0, "data.seed", f"must be >= 0, got {dc.seed}")
    _check(cfg.train.seed >= 0, "train.seed", f"must be >= 0, got {cfg.train.seed}")
    _check(0.0 <= dc.valid_fraction < 1.0, "data.valid_fraction", f"must be in [0, 1), got {dc.valid_fraction}")
    for key, value in (("data.path", dc.path), ("data.valid_path", dc.valid_path)):
        for i, corpus in enumerate(corpora(value)):
            for ext in (".bin", ".idx"):
                _check(os.path.isfile(corpus.path + ext), entry_key(key, value, i),
                       f"missing data file {corpus.path + ext}")
    if dc.tokenizer != "byte":
        _check(os.path.isfile(dc.tokenizer), "data.tokenizer", f"must be 'byte' or a tokenizer.json file; {dc.tokenizer} not found")
    else:               # the byte tokenizer's ids are fixed: EOD is 256, and it has no BOS
        for key, value in (("data.eod_token", dc.eod_token), ("data.bos_token", dc.bos_token)):
            _check(not value, key, f"the byte tokenizer's ids are fixed (EOD 256, no BOS): {value!r} cannot be set")
        _check(not dc.add_bos, "data.add_bos", "the byte tokenizer has no beginning-of-document token")


def _writable_dir(path: str, key: str) -> None:
    """`path` is, or can be made, a directory this process can write: it is not a file, and its
    nearest existing ancestor is a writable directory (checked now: later it would be a traceback
    after the data has been opened)."""
    _check(bool(path.strip()), key, "must not be empty")
    _check(_utf8(path), key, f"{path!r} is not valid UTF-8 (orbax and TensorBoard need UTF-8 paths)")
    full = os.path.abspath(path)
    if os.path.exists(full):
        _check(os.path.isdir(full), key, f"{path} exists and is not a directory")
        _check(os.access(full, os.W_OK | os.X_OK), key, f"{path} is not writable")
        return
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    _check(os.path.isdir(parent), key, f"cannot create {path}: {parent} is a file, not a directory")
    _check(os.access(parent, os.W_OK | os.X_OK), key, f"cannot create {path}: {parent} is not writable")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:      # undecodable bytes of a command line arrive as lone surrogates
        return False
    return True


# what a run writes inside train.run_dir: (name, must be a directory)
RUN_DIR_ENTRIES = (("config.json", False), ("metrics.jsonl", False), ("tb", True))


def _validate_paths(cfg: Config) -> None:
    """Every directory the run writes, and what it writes inside the run directory."""
    _writable_dir(cfg.train.run_dir, "train.run_dir")
    for name, is_dir in RUN_DIR_ENTRIES:
        path = os.path.join(cfg.train.run_dir, name)
        _check(not os.path.exists(path) or os.path.isdir(path) == is_dir, "train.run_dir",
               f"{path} exists and is {'not ' if is_dir else ''}a directory")
    if cfg.checkpoint.enabled and cfg.checkpoint.dir:
        _writable_dir(cfg.checkpoint.dir, "checkpoint.dir")
    if not cfg.data.path:            # the default corpus is built there; sample indices are cached
        _writable_dir(cfg.data.cache_dir, "data.cache_dir")
    elif cfg.data.cache_dir:
        _check(not os.path.exists(cfg.data.cache_dir) or os.path.isdir(cfg.data.cache_dir), "data.cache_dir",
               f"{cfg.data.cache_dir} exists and is not a directory")


def validate_distributed(cfg: Config) -> None:
    """The `distributed` group; needs no devices, so it also runs before JAX starts (mtjax.distributed)."""
    dc = cfg.distributed
    _check(dc.num_processes >= 0, "distributed.num_processes", f"must be >= 0, got {dc.num_processes}")
    _check(dc.process_id >= -1, "distributed.process_id", f"must be >= -1, got {dc.process_id}")
    if dc.coordinator:
        host, _, port = dc.coordinator.rpartition(":")
        _check(bool(host) and port.isascii() and port.isdigit() and 0 < int(port) < 65536, "distributed.coordinator",
               f"must be host:port, got {dc.coordinator!r}")
        _check(dc.num_processes >= 1, "distributed.num_processes", "must be set (>= 1) with distributed.coordinator")
        _check(dc.process_id >= 0, "distributed.process_id", "must be set (>= 0) with distributed.coordinator")
    if dc.num_processes and dc.process_id >= 0:
        _check(dc.process_id < dc.num_processes, "distributed.process_id",
               f"must be < num_processes {dc.num_processes}, got {dc.process_id}")


def validate(cfg: Config, num_devices: int) -> tuple[int, int, int]:
    """Check everything but the `distributed` group; returns the resolved mesh shape (d, p, t).
    `distributed.initialize` checks that group once, before the backend starts (it must: joining
    the job configures the backend, and validation here queries devices)."""
    d, p, t = resolve_mesh_shape(cfg, num_devices)
    _validate_model(cfg, _validate_grid(cfg, t), p)
    _validate_parallel(cfg, d, p, t)
    _validate_grid_batch(cfg, batch_split(cfg, d)[0], t)
    _validate_sizes(cfg, batch_split(cfg, d)[0], t)
    _validate_train(cfg)
    _validate_recompute(cfg, p)
    _validate_data(cfg)
    _validate_paths(cfg)
    return d, p, t


def validate_model(cfg: Config, tensor: int = 1) -> None:
    """The `model` group alone (and the compute precision), its heads split over `tensor` ranks:
    for tools that build a model without training it (a converter, generation), where the data
    and run paths are not this process's business."""
    _validate_model(cfg, tensor, 1)
    _validate_sizes(cfg, 1, tensor)
    _check(cfg.train.precision in PRECISIONS, "train.precision",
           f"must be one of {', '.join(PRECISIONS)}, got {cfg.train.precision!r}")

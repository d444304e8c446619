"""`mtjax.load`: a checkpoint opened for inference on any (data, pipe, tensor) mesh.

    model = mtjax.load("runs/tiny")                    # a run, checkpoints or step directory
    model.logits([[1, 2, 3]])                          # np.ndarray [B, s, V]
    model.generate([1, 2, 3], max_new_tokens=20)       # greedy: list[int]
    model.generate(ids, 20, temperature=0.8, top_p=0.9, seed=1)
    mtjax.load("runs/tiny", overrides=["parallel.pipe=2", "parallel.data=2"])

The checkpoint is found as `mtjax.convert` finds one (the newest complete step, read-only,
checked against its manifest), and only its parameters are read (`mtjax/checkpoint/params.py`) onto the
model's layout (`mtjax/layout.py`): no optimizer, gradient function or pipeline schedule is
built. The weights are those the train step computes with (`layout.compute_params`). `.logits`
is the layout's forward, and `.generate` runs the same modules and parameters from a KV cache
(`decode.py`). Bad arguments raise ConfigError (a ValueError) naming the parameter.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import jax
import numpy as np

from mtjax.config.errors import ConfigError
from mtjax.config.load import from_dict, override_list, parse_override
from mtjax.config.schema import Config, ParallelConfig
from mtjax.config.validate import validate_model
from mtjax.data.tokenizer import Tokenizer, config_tokenizer
from mtjax.inference.arguments import check_ids, check_settings, flag
from mtjax.inference.decode import Decoder
from mtjax.layout import ModelLayout, compute_params, logits_fn, resolve_layout
from mtjax.mesh import axis_sizes, make_mesh
from mtjax.checkpoint.compat import check_window, length_free, model_change
from mtjax.checkpoint.params import restore_params, saved_config, saved_run_config
from mtjax.checkpoint.stored import quiet_absl
from mtjax.checkpoint import find_checkpoint

SMALLEST_PREFILL = 8       # prompts are padded to a power of two (at least this), so few lengths compile
SIZES = ("data", "pipe", "tensor")


def load(checkpoint: str, mesh=None, overrides: Sequence[str] = ()) -> "InferenceModel":
    """The newest complete checkpoint under `checkpoint` (a run directory, a directory of steps, or
    one step's directory) on `mesh`, or, when None, on the first d p t devices as
    `parallel.data/pipe/tensor` in `overrides` say (default one device). `overrides` are dotted
    `group.field=value` settings applied to the config the checkpoint was saved with, e.g.
    `train.precision=bf16` or `data.tokenizer=PATH`; the model fields stay the checkpoint's."""
    overrides = override_list(overrides)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint is a directory's path, got {type(checkpoint).__name__}")
    if not os.fspath(checkpoint).strip():     # else the current directory, named as holding no checkpoint
        raise ConfigError("checkpoint", "must name a directory: a run, its checkpoints/ or one step's")
    directory, step = find_checkpoint(checkpoint)
    with quiet_absl():
        meta, saved = saved_config(directory, step)
        saved_run_config(directory, step, saved)      # the saved config's own faults named as the checkpoint's
        cfg, mesh = inference_config(saved, overrides, mesh)
        check_window(meta, cfg.model.seq_len, step)     # (prompt and continuation fit in seq_len)
        layout = resolve_layout(cfg, mesh, int(meta["vocab"]))
        master = restore_params(directory, step, layout, meta)
    return InferenceModel(cfg, layout, jax.jit(functools.partial(compute_params, layout))(master), step)


def inference_config(saved: dict, overrides: Sequence[str], mesh=None) -> tuple[Config, object]:
    """(the saved config with `overrides` applied, laid out for inference: one row per step, no
    recomputation; the mesh), its model checked against the layout."""
    raw = {group: dict(values) if isinstance(values, dict) else values for group, values in saved.items()}
    sizes, given, rest = parallel_overrides(overrides)
    for group, name, value in rest:
        if not isinstance(raw.setdefault(group, {}), dict):
            raise ConfigError(group, "must be a mapping of fields")
        raw[group][name] = value
    mesh = _inference_mesh(mesh, sizes, given)
    d, p, t = (axis_sizes(mesh)[axis] for axis in SIZES)
    cfg = from_dict(raw)
    if cfg.model.moe_capacity_factor and ("model", "moe_capacity_factor") in {(g, n) for g, n, _ in rest}:
        raise ConfigError("model.moe_capacity_factor", "generation routes every token (dropless): a capacity "
                                                       "would drop by the padded prompt's length, a step of one "
                                                       "token never")
    # dropless whatever the run trained with: a capacity counts a sequence's tokens, so the prompt's
    # padding would take slots, and the one-token decode steps could never drop
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, moe_capacity_factor=0.0))
    train = dataclasses.replace(cfg.train, recompute="none", recompute_layers=0, offload_activations=False,
                                global_batch=d, micro_batch=1, micro_batches=0)
    cfg = cfg.replace(parallel=ParallelConfig(data=d, pipe=p, tensor=t), train=train)
    change = model_change(saved["model"], cfg, length_free(saved["model"]))
    if change is not None:       # (else the restore fails on a shape, or computes another function)
        key, value, now = change
        raise ConfigError(f"model.{key}", f"is {value!r} in the checkpoint's model, given {now!r}: generation runs "
                                          f"the model as saved (model.attention, the training settings and a "
                                          f"rotary model's seq_len may change)")
    m = cfg.model     # the stages first: a refusal names parallel.pipe, the setting given
    if p > 1 and (m.num_layers - m.dense_prefix) % (p * m.moe_layer_freq if m.moe else p):
        split = f"the {m.num_layers - m.dense_prefix} layers after the dense prefix are" if m.dense_prefix else \
            f"num_layers {m.num_layers} is"
        unit = f" in units of moe_layer_freq {m.moe_layer_freq}" if m.moe and m.moe_layer_freq > 1 else ""
        raise ConfigError("parallel.pipe", f"{split} not divisible by parallel.pipe {p}{unit}")
    validate_model(cfg, t, p)
    return cfg, mesh


def parallel_overrides(overrides: Sequence[str]) -> tuple[dict, list[str], list[tuple]]:
    """({data|pipe|tensor: size} the `parallel.*` overrides set, their names in the order given,
    the other overrides as (group, field, value)); ConfigError for a parallel option generation
    does not take."""
    sizes, given, rest = {}, [], []
    for text in overrides:
        group, name, value = parse_override(text)
        if group != "parallel":
            rest.append((group, name, value))
            continue
        value = _parallel_size(name, value)
        if name in SIZES:
            sizes[name] = value
            given.append(name)
    return sizes, given, rest


def _parallel_size(name: str, value):
    """A parallel override generation takes: data, pipe, tensor (>= 1), the 1d tensor layout."""
    if name in ("tensor_grid", "tensor_depth") and value not in ("1d", 1):
        raise ConfigError(f"parallel.{name}", "generation runs on the 1d tensor layout: decoding with a KV cache "
                                              "is not implemented on a 2d/2.5d grid (a grid's checkpoint "
                                              "generates on 1d)")
    if name == "sequence_parallel" and value not in (False, "false"):
        raise ConfigError("parallel.sequence_parallel", "decoding runs one position at a time: there is no "
                                                        "sequence to split")
    if name in SIZES and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"parallel.{name}", f"must be an integer >= 1, got {value!r}")
    if name not in SIZES + ("tensor_grid", "tensor_depth", "sequence_parallel"):
        raise ConfigError(f"parallel.{name}", "generation takes only parallel.data, parallel.pipe and "
                                              "parallel.tensor")
    return value


def _inference_mesh(mesh, sizes: dict, given: list[str]):
    """`mesh`, whose sizes must agree with the parallel overrides, or one of their sizes."""
    if mesh is not None:
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh is a jax.sharding.Mesh (make_mesh(d, p, t, devices)), got {type(mesh).__name__}")
        if not set(SIZES) <= set(mesh.axis_names):
            raise ConfigError("mesh", f"has axes {tuple(mesh.axis_names)}, not data, pipe and tensor: make it with "
                                      f"mtjax.mesh.make_mesh(d, p, t, devices)")
        if len(set(mesh.devices.flat)) != mesh.devices.size:    # else orbax's restore fails deep inside
            raise ConfigError("mesh", "holds a device twice: each position of the mesh is its own device")
        have = axis_sizes(mesh)
        extra = {name: n for name, n in have.items() if name not in SIZES and n > 1}
        if extra:
            raise ConfigError("mesh", f"has {', '.join(f'{k}={n}' for k, n in extra.items())}: inference splits "
                                      f"data, pipe and tensor only (make_mesh(d, p, t, devices))")
        for name in SIZES:
            if name in sizes and sizes[name] != have[name]:
                raise ConfigError(f"parallel.{name}", f"is {sizes[name]} but the mesh given has {name}={have[name]}")
        return mesh
    d, p, t = (sizes.get(name, 1) for name in SIZES)
    if d * p * t > jax.device_count():
        key = next((f"parallel.{n}" for n in reversed(given) if n in SIZES and sizes[n] > 1), "parallel.tensor")
        raise ConfigError(key, f"data x pipe x tensor = {d * p * t} needs {d * p * t} devices, this machine has "
                               f"{jax.device_count()} (--cpu-devices {d * p * t} simulates them)")
    return make_mesh(d, p, t, jax.devices()[:d * p * t])


def padded_batch(rows: list, seq_len: int, split: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompts [b, P] right-padded to a power of two, lengths [b], row indices [b]) of the
    prompts `rows`: b a multiple of `split` (data x pipe; padding rows: one token, an index
    beyond the prompts')."""
    longest = max(map(len, rows))
    width = min(seq_len, max(SMALLEST_PREFILL, 1 << (longest - 1).bit_length()))
    b = -(-len(rows) // split) * split
    prompts, lengths = np.zeros((b, width), np.int32), np.ones((b,), np.int32)
    for r, ids in enumerate(rows):
        prompts[r, :len(ids)], lengths[r] = ids, len(ids)
    return prompts, lengths, np.arange(b, dtype=np.int32)


class InferenceModel:
    """A restored model: `.logits(tokens)` and `.generate(prompt_ids, max_new_tokens, ...)`."""

    def __init__(self, cfg: Config, layout: ModelLayout, params, step: int):
        self.cfg, self.layout, self.mesh, self.step = cfg, layout, layout.mesh, step
        self.vocab = layout.vocab                       # V, unpadded
        self.seq_len = cfg.model.seq_len                # S: prompt and continuation together
        self.params = params        # as the train step computes with them (`layout.compute_params`)
        self._logits_fn = logits_fn(layout)
        self._packed_logits = {}                        # eod id -> logits_fn of packed rows
        self.decoder = Decoder(layout)

    def __repr__(self) -> str:
        m, sizes = self.cfg.model, dict(self.mesh.shape)
        mesh = ", ".join(f"{name} {size}" for name, size in sizes.items() if size > 1) or "one device"
        return (f"InferenceModel(step {self.step}: {m.arch}, {m.num_layers} layers, h {m.hidden_size}, "
                f"vocab {self.vocab}, seq_len {self.seq_len}, {self.cfg.train.precision}; {mesh})")

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint config's tokenizer, with its `data.eod_token`, `data.bos_token` and
        `data.add_bos` (`config_tokenizer`; loaded when first asked for)."""
        return config_tokenizer(self.cfg)

    def logits(self, tokens, document_masking: bool = False, eod_id: int | None = None) -> np.ndarray:
        """tokens [B, s] (ids < V, s <= seq_len) -> fp32 logits [B, s, V] (the layout's `logits_fn`;
        rows padded to a multiple of parallel.data and cut again). `document_masking`: each row is
        packed documents, each ending at the end-of-document id (`eod_id`, by default the
        checkpoint tokenizer's): every document gets the logits it would get alone
        (`model/documents.py`: attention and positions restart after each end-of-document)."""
        if isinstance(tokens, (list, tuple)) and len({len(r) if isinstance(r, (list, tuple, np.ndarray)) else -1
                                                      for r in tokens}) > 1:
            raise ConfigError("tokens",
                              "rows of different lengths: give [B, s] (pad the rows, or call once per length)")
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[0] < 1 or not 1 <= tokens.shape[1] <= self.seq_len:
            raise ConfigError("tokens", f"must be [B, s] with B >= 1 and 1 <= s <= model.seq_len {self.seq_len}, "
                                        f"got shape {list(tokens.shape)}")
        tokens = np.asarray(check_ids("tokens", tokens.tolist() if tokens.size else [], self.vocab), np.int32)
        rows, d = tokens.shape[0], self.layout.data
        padded = np.zeros((-(-rows // d) * d, tokens.shape[1]), np.int32)
        padded[:rows] = tokens
        fn = self._logits_for(flag("document_masking", document_masking), eod_id)
        return np.asarray(fn(self.params, padded)[:rows], np.float32)   # bf16/fp16 runs' head: fp32 as promised

    def _logits_for(self, document_masking: bool, eod_id: int | None):
        """The compiled logits function: plain, or packed rows ending documents at `eod_id`."""
        if not document_masking:
            if eod_id is not None:
                raise ConfigError("eod_id", "is read only with document_masking=True")
            return self._logits_fn
        eod = self.tokenizer.eod_id if eod_id is None else int(check_ids("eod_id", [eod_id], self.vocab)[0])
        if eod not in self._packed_logits:
            self._packed_logits[eod] = logits_fn(self.layout, eod)
        return self._packed_logits[eod]

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, stop_at_eod: bool = False):
        """The continuation of `prompt_ids` (ids < V): a list of up to `max_new_tokens` ids, or for a
        list of prompts (lengths may differ; at least parallel.data of them) a list of them. Greedy
        when `temperature` is 0; otherwise sampled with `top_k` (k >= V: no filter) / `top_p`
        filtering and a key from `seed` (the same seed gives the same tokens, on every layout).
        `stop_at_eod` ends a continuation after the tokenizer's end-of-document id. Each prompt and
        its continuation must fit in model.seq_len."""
        batch = (isinstance(prompt_ids, np.ndarray) and prompt_ids.ndim == 2) or (
            isinstance(prompt_ids, (list, tuple)) and bool(prompt_ids)
            and all(isinstance(p, (list, tuple, np.ndarray)) for p in prompt_ids))
        rows = [check_ids("prompt_ids", p, self.vocab) for p in (prompt_ids if batch else [prompt_ids])]
        if not rows:                                    # a [0, s] array: no prompt at all
            raise ConfigError("prompt_ids", "a batch of no prompts: give at least one")
        check_settings(self.seq_len, max(map(len, rows)), max_new_tokens, temperature, top_k, top_p, seed)
        stop_at_eod = flag("stop_at_eod", stop_at_eod)
        if len(rows) < self.layout.data:
            raise ConfigError("prompt_ids", f"a batch of {len(rows)} prompt{'s' * (len(rows) != 1)} cannot be split "
                                            f"over parallel.data {self.layout.data}: give at least {self.layout.data}")
        if max_new_tokens == 0:
            return [[] for _ in rows] if batch else []
        stop = self.tokenizer.eod_id if stop_at_eod else -1
        out = self.decoder.generate(
            self.params, *padded_batch(rows, self.seq_len, self.layout.data * self.layout.pipe),
            np.int32(len(rows)), np.int32(max_new_tokens),
            jax.random.key_data(jax.random.key(seed)), np.float32(temperature),
            np.int32(min(top_k or self.vocab, self.vocab)), np.float32(1.0 if top_p is None else top_p),
            np.int32(stop))
        result = [[int(i) for i in row if i >= 0] for row in np.asarray(out)[:len(rows)]]
        return result if batch else result[0]

"""`mtjax.load`: a checkpoint opened for inference, on one device or heads split over `tensor`.

    model = mtjax.load("runs/tiny")                    # a run, checkpoints or step directory
    model.logits([[1, 2, 3]])                          # np.ndarray [B, s, V]
    model.generate([1, 2, 3], max_new_tokens=20)       # greedy: list[int]
    model.generate(ids, 20, temperature=0.8, top_p=0.9, seed=1)

The checkpoint is read as `mtjax.convert` reads one (the newest complete step, read-only) and
restored by a Trainer built for the mesh; the weights are those the train step computes with (cast
to the compute dtype, `Trainer.compute_params`). `.logits` is the trainer's own `logits_fn`, and
`.generate` runs the same modules and parameters from a KV cache (`decode.py`).
Bad arguments raise ConfigError (a ValueError) naming the parameter.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import numbers
from typing import Sequence

import jax
import numpy as np

from mtjax.config.errors import ConfigError
from mtjax.config.load import from_dict, parse_override
from mtjax.config.schema import Config, ParallelConfig
from mtjax.config.validate import validate_model
from mtjax.data.tokenizer import Tokenizer, load_tokenizer
from mtjax.inference.decode import Decoder
from mtjax.mesh import axis_sizes, make_mesh
from mtjax.checkpoint import Checkpointer
from mtjax.training.step import local_model
from mtjax.training.trainer import Trainer

SMALLEST_PREFILL = 8       # prompts are padded to a power of two (at least this), so few lengths compile


def load(checkpoint: str, mesh=None, overrides: Sequence[str] = ()) -> "InferenceModel":
    """The newest complete checkpoint under `checkpoint` (a run directory, a directory of steps, or
    one step's directory) on `mesh`: a (data=1, pipe=1, tensor=t) mesh, heads split over t, or one
    device when None. `overrides` are dotted `group.field=value` settings applied to the config
    the checkpoint was saved with, e.g. `train.precision=bf16` or `data.tokenizer=PATH`; the model
    fields must stay the checkpoint's, and the layout comes from the mesh."""
    from mtjax.convert.checkpoints import find_checkpoint
    directory, step = find_checkpoint(checkpoint)
    mesh = make_mesh(1, 1, 1, jax.devices()[:1]) if mesh is None else mesh
    with _quiet_orbax():
        checkpointer = Checkpointer(Config(), directory, read_only=True)
        try:
            meta, saved = checkpointer.saved(step)
            trainer = Trainer(inference_config(saved, overrides, mesh), mesh, int(meta["vocab"]))
            master = checkpointer.restore(step, trainer).params
        finally:
            checkpointer.close()
    return InferenceModel(trainer, jax.jit(trainer.compute_params)(master), step)


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax logs a warning for every read-only directory it opens; reading is all we do."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def inference_config(saved: dict, overrides: Sequence[str], mesh) -> Config:
    """The saved config with `overrides` applied, laid out on `mesh` (one row per step, no
    recomputation), its model checked against the tensor size."""
    sizes = axis_sizes(mesh)
    if sizes["data"] != 1 or sizes["pipe"] != 1:
        raise ConfigError("mesh", f"inference runs on a mesh of data=1, pipe=1 and any tensor size, got {sizes}")
    raw = {group: dict(values) if isinstance(values, dict) else values for group, values in saved.items()}
    for text in overrides:
        group, name, value = parse_override(text)
        if group == "parallel":
            raise ConfigError(f"parallel.{name}", "inference takes its layout from the mesh")
        if not isinstance(raw.setdefault(group, {}), dict):
            raise ConfigError(group, "must be a mapping of fields")
        raw[group][name] = value
    cfg = from_dict(raw)
    train = dataclasses.replace(cfg.train, recompute="none", recompute_layers=0, offload_activations=False,
                                global_batch=1, micro_batch=1, micro_batches=0)
    cfg = cfg.replace(parallel=ParallelConfig(data=1, tensor=sizes["tensor"]), train=train)
    validate_model(cfg, sizes["tensor"])
    return cfg


class InferenceModel:
    """A restored model: `.logits(tokens)` and `.generate(prompt_ids, max_new_tokens, ...)`."""

    def __init__(self, trainer: Trainer, params, step: int):
        self.cfg, self.mesh, self.step = trainer.cfg, trainer.mesh, step
        self.vocab = trainer.vocab                      # V, unpadded
        self.seq_len = trainer.cfg.model.seq_len        # S: prompt and continuation together
        self.params = params        # as the train step computes with them (`Trainer.compute_params`)
        self._logits_fn = trainer.logits_fn
        model = local_model(trainer.cfg.model, trainer.plan, stage=False, deterministic=True)
        self.decoder = Decoder(model, trainer.mesh, trainer.plan)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint config's `data.tokenizer` (loaded when first asked for)."""
        return load_tokenizer(self.cfg.data.tokenizer)

    def logits(self, tokens) -> np.ndarray:
        """tokens [B, s] (ids < V, s <= seq_len) -> fp32 logits [B, s, V] (the trainer's `logits_fn`)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[0] < 1 or not 1 <= tokens.shape[1] <= self.seq_len:
            raise ConfigError("tokens", f"must be [B, s] with B >= 1 and 1 <= s <= model.seq_len {self.seq_len}, "
                                        f"got shape {list(tokens.shape)}")
        tokens = np.asarray(self._check_ids("tokens", tokens.tolist() if tokens.size else []), np.int32)
        return np.asarray(self._logits_fn(self.params, tokens))

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, stop_at_eod: bool = False):
        """The continuation of `prompt_ids` (ids < V): a list of up to `max_new_tokens` ids, or for a
        list of prompts (lengths may differ) a list of them. Greedy when `temperature` is 0;
        otherwise sampled with `top_k` (k >= V: no filter) / `top_p` filtering and a key from
        `seed` (the same seed gives the same tokens). `stop_at_eod` ends a continuation after the tokenizer's
        end-of-document id. Each prompt and its continuation must fit in model.seq_len."""
        batch = (isinstance(prompt_ids, np.ndarray) and prompt_ids.ndim == 2) or (
            isinstance(prompt_ids, (list, tuple)) and bool(prompt_ids)
            and all(isinstance(p, (list, tuple, np.ndarray)) for p in prompt_ids))
        rows = [self._check_ids("prompt_ids", p) for p in (prompt_ids if batch else [prompt_ids])]
        self._check_settings(max(map(len, rows)), max_new_tokens, temperature, top_k, top_p, seed)
        if max_new_tokens == 0:
            return [[] for _ in rows] if batch else []
        longest = max(map(len, rows))
        width = min(self.seq_len, max(SMALLEST_PREFILL, 1 << (longest - 1).bit_length()))
        prompts = np.zeros((len(rows), width), np.int32)
        for r, ids in enumerate(rows):
            prompts[r, :len(ids)] = ids
        stop = self.tokenizer.eod_id if stop_at_eod else -1
        out, count = self.decoder.generate(
            self.params, prompts, np.array([len(r) for r in rows], np.int32), np.int32(max_new_tokens),
            jax.random.key(seed), np.float32(temperature), np.int32(min(top_k or self.vocab, self.vocab)),
            np.float32(1.0 if top_p is None else top_p), np.int32(stop))
        out = np.asarray(out)[:, :int(count)]
        result = [[int(i) for i in row if i >= 0] for row in out]
        return result if batch else result[0]

    # ------------------------------------------------------------------ argument checks

    def _check_ids(self, key: str, ids) -> list:
        """`ids` as a list (a row of ints; a list of rows for `tokens`), every id in [0, V)."""
        flat = [i for row in ids for i in row] if key == "tokens" else ids
        if isinstance(flat, np.ndarray):
            flat = flat.tolist()
        if not isinstance(flat, (list, tuple)) or not flat:
            raise ConfigError(key, "must hold at least one token id")
        for i in flat:
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not 0 <= i < self.vocab:
                raise ConfigError(key, f"token ids are integers in [0, {self.vocab}), got {i!r}")
        return list(ids)

    def _check_settings(self, longest: int, max_new, temperature, top_k, top_p, seed) -> None:
        def integer(x):
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
        if not integer(max_new) or max_new < 0:
            raise ConfigError("max_new_tokens", f"must be an integer >= 0, got {max_new!r}")
        if longest + max_new > self.seq_len:
            tokens = f"{longest} token{'s' * (longest != 1)}"
            raise ConfigError("max_new_tokens", f"a prompt of {tokens} and {max_new} new ones exceed "
                                                f"model.seq_len {self.seq_len}")
        if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature < 0:
            raise ConfigError("temperature", f"must be a finite number >= 0, got {temperature!r}")
        if top_k is not None and (not integer(top_k) or top_k < 1):
            raise ConfigError("top_k", f"must be an integer >= 1, got {top_k!r}")
        if top_p is not None and (not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
            raise ConfigError("top_p", f"must be in (0, 1], got {top_p!r}")
        if not integer(seed) or not 0 <= seed < 2 ** 32:
            raise ConfigError("seed", f"must be an integer in [0, 2**32), got {seed!r}")

"""One validation pass over a Config, before anything heavy starts: one module per config group.

  common.py       the refusal (ConfigError naming the key; the first problem found wins), the
                  no-effect rule and the device rule, which hold in every group
  model.py        `model`: sizes, options against the arch, rotary embeddings, tensor sizes
  moe.py          `model`'s mixture of experts and `parallel.expert`: router, expert split
  parallel.py     `parallel`: the mesh against the devices, B = b m d, the tensor grid, the schedule
  fsdp.py         `parallel.fsdp`: sharded weights (ZeRO-3) and what they combine with
  train.py        `train`, `optim`, `checkpoint`: precision, recomputation, optimizer, cadence
  data.py         `data` and the run's paths: files exist, output directories are writable
  distributed.py  `distributed`: joining a multi-process job (checked before JAX starts)

The no-effect rule: a field set away from its default that the layout (or another field) makes
inert is refused with one line, never ignored and never a warning (`common.no_effect`). Too few
devices: the line names the count needed and `--cpu-devices` (`common.devices_hint`).
"""
from __future__ import annotations

from mtjax.config.schema import Config
from mtjax.config.validate.data import validate_data, validate_data_files, validate_paths
from mtjax.config.validate.distributed import validate_distributed
from mtjax.config.validate.fsdp import validate_fsdp
from mtjax.config.validate.model import validate_batch_tokens, validate_model_group, validate_sizes
from mtjax.config.validate.moe import validate_moe
from mtjax.config.validate.parallel import (batch_split, resolve_mesh_shape, validate_context, validate_grid,
                                            validate_grid_batch, validate_parallel)
from mtjax.config.validate.train import validate_precision, validate_recompute, validate_train

__all__ = ["validate", "validate_portable", "validate_model", "validate_distributed", "batch_split", "resolve_mesh_shape"]


def validate(cfg: Config, num_devices: int) -> tuple[int, int, int]:
    """Check everything but the `distributed` group; returns the resolved mesh shape (d, p, t)
    (the context size c is `parallel.context` itself).
    `distributed.initialize` checks that group once, before the backend starts (it must: joining
    the job configures the backend, and validation here queries devices)."""
    d, p, t = validate_portable(cfg, num_devices)
    validate_data_files(cfg)
    validate_paths(cfg)
    return d, p, t


def validate_portable(cfg: Config, num_devices: int | None = None) -> tuple[int, int, int]:
    """Every check that does not read this machine: fields, ranges and divisibility on
    `num_devices` (None: the config's own mesh, data = -1 read as 1), but not whether the data
    files exist or the run's directories are writable (`--print-config` prints a config that may
    be meant for another machine)."""
    if num_devices is None:
        par = cfg.parallel
        num_devices = max(par.data, 1) * max(par.pipe, 1) * max(par.context, 1) * max(par.tensor, 1)
    d, p, t = resolve_mesh_shape(cfg, num_devices)
    validate_model_group(cfg, validate_grid(cfg, t), p)
    validate_parallel(cfg, d, p, t)
    validate_context(cfg, t)
    validate_fsdp(cfg, d)
    validate_moe(cfg, d, t, p)
    b = batch_split(cfg, d)[0]
    validate_grid_batch(cfg, b, t)
    validate_sizes(cfg, b, t)
    validate_batch_tokens(cfg)
    validate_train(cfg)
    validate_recompute(cfg, p)
    validate_data(cfg)
    return d, p, t


def validate_model(cfg: Config, tensor: int = 1, pipe: int = 1) -> None:
    """The `model` group alone (and the compute precision), its heads split over `tensor` ranks
    and its layers over `pipe` stages: for tools that build a model without training it (a
    converter, generation), where the data and run paths are not this process's business."""
    validate_model_group(cfg, tensor, 1)
    validate_sizes(cfg, 1, tensor)
    validate_moe(cfg, 1, tensor, pipe)
    validate_precision(cfg)

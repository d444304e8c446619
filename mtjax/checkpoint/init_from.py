"""`train.init_from`: a run that starts from another checkpoint's weights (fine-tuning).

The source is any mtjax checkpoint: a run directory, its checkpoints directory or one step's
directory (the newest complete step, as `find_checkpoint` reads them; `mtjax.convert from-hf`
writes one). Only its parameters are read (`mtjax/checkpoint/params.py`), onto this run's layout (any
data/pipe/tensor split, virtual stages, distributed optimizer, vocabulary padding); the optimizer
state is fresh, the step and the data position are 0, and
the RNG key is the one `train.seed` draws. The model must be the source's (`check_same_model`),
its seq_len within the sliding window of a converted source's weights (`check_window`).
The source is opened read-only: nothing is written there.

Precedence: a run whose own checkpoint directory holds checkpoints resumes from them
(checkpoint.resume=true): it was started from init_from before, and they are newer. The path
is checked only when it will be read, so a resume does not need the source any more.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config
from mtjax.data.errors import DataError
from mtjax.checkpoint.compat import check_window
from mtjax.checkpoint.params import restore_params
from mtjax.checkpoint import Checkpointer, check_same_model, find_checkpoint
from mtjax.training.loss_scale import init_loss_scale
from mtjax.training.state import start_state

KEY = "train.init_from"


@dataclass(frozen=True)
class InitSource:
    directory: str   # the checkpoint directory
    step: int        # the step whose weights start the run
    meta: dict       # its `meta` item (vocabulary and its padding)


def find_source(cfg: Config) -> InitSource:
    """The checkpoint `train.init_from` names, its model checked against this run's; ConfigError
    naming train.init_from when there is none or the model differs (reads metadata only)."""
    path = cfg.train.init_from
    if not os.path.exists(path):
        raise ConfigError(KEY, f"{path} does not exist")
    try:
        directory, step = find_checkpoint(path)
        checkpointer = Checkpointer(cfg, directory, read_only=True)
        try:
            meta, saved = checkpointer.saved(step)
        finally:
            checkpointer.close()
    except DataError as e:
        raise ConfigError(KEY, str(e)) from None
    try:
        check_same_model(saved["model"], cfg, step)
    except DataError as e:
        raise ConfigError(KEY, f"{e} (in {directory})") from None
    check_window(meta, cfg.model.seq_len, step)
    return InitSource(directory, step, meta)


def initial_state(source: InitSource, trainer):
    """Step 0 of this run on `trainer`'s layout: the source's parameters (only they are read,
    `mtjax/checkpoint/params.py`), a fresh optimizer state."""
    try:
        params = restore_params(source.directory, source.step, trainer.layout, source.meta)
    except DataError as e:
        raise ConfigError(KEY, f"{e} ({source.directory})") from None
    key, scaler = jax.random.key(trainer.cfg.train.seed), init_loss_scale(trainer.cfg)
    # The restored weights become the master weights in place where both are laid out alike; the
    # distributed optimizer splits the master over `data`, where no buffer could be reused (and
    # donating would only earn JAX's "donated buffers were not usable" warning).
    masters = jax.tree.leaves(trainer.state_shardings.params)
    alike = all(w.sharding == s for w, s in zip(jax.tree.leaves(params), masters))
    start = jax.jit(lambda p: start_state(p, trainer.tx, scaler, key), out_shardings=trainer.state_shardings,
                    donate_argnums=0 if alike else ())
    return start(params)

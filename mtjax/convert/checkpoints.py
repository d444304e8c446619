"""The mtjax side of a conversion: parameters written as a step-0 checkpoint that training
resumes from, and a checkpoint's parameters read back. Both run on one device: a checkpoint
stores global shapes in canonical layer order, so its layout is not part of it. Reading builds
the model's layout only (`mtjax/layout.py`, `mtjax/checkpoint/params.py`): no optimizer is built and no
moment is read; writing needs the optimizer, for the fresh moments a step-0 checkpoint holds.

Parameters travel as {leaf path: array} ("layers/attn/q/kernel", as `weights.py` names them).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax

from mtjax.config.schema import Config, ParallelConfig
from mtjax.layout import resolve_layout
from mtjax.mesh import make_mesh
from mtjax.checkpoint.params import restore_params, saved_config, saved_run_config
from mtjax.checkpoint import Checkpointer, find_checkpoint
from mtjax.training.loss_scale import init_loss_scale
from mtjax.training.state import start_state


def leaf_path(path) -> str:
    return "/".join(str(k.key) for k in path)


def one_device_config(cfg: Config) -> Config:
    """`cfg` on one device: parallel options and the ones that only change how a step runs reset
    (the rows' document masks too: the weights do not depend on them)."""
    train = dataclasses.replace(cfg.train, recompute="none", recompute_layers=0, offload_activations=False)
    data = dataclasses.replace(cfg.data, document_masking=False, eod_mask_loss=False)
    return cfg.replace(parallel=ParallelConfig(data=1), train=train, data=data)


def one_device_trainer(cfg: Config, vocab: int):
    """A Trainer for `cfg`'s model and optimizer on one device (`one_device_config`): what
    writing a step-0 checkpoint needs."""
    from mtjax.training.trainer import Trainer   # writing only: reading needs no optimizer
    return Trainer(one_device_config(cfg), make_mesh(1, 1, 1, jax.devices()[:1]), vocab)


def model_leaf_shapes(trainer) -> dict[str, tuple[int, ...]]:
    return {leaf_path(p): tuple(s.shape) for p, s in jax.tree_util.tree_leaves_with_path(trainer.plan.params.shapes)}


class Unshared(np.ndarray):
    """A host array that orbax writes as it is (still through its numpy handler, which takes
    subclasses, in the same format). That handler deep-copies each host array before an
    asynchronous write, in case the caller changes it meanwhile: a copy of the weights, and every
    zero of the moments made resident. A conversion hands its arrays over and waits for the write."""

    def __deepcopy__(self, memo):
        return self


def save_params(trainer, leaves: dict[str, np.ndarray], directory: str, meta: dict | None = None) -> None:
    """A step-0 checkpoint in `directory` (made by orbax) holding `leaves` as the fp32 master
    weights, fresh AdamW state, and the RNG key `train.seed` would draw (`start_state`); `meta`:
    more entries of its `meta` item. Consumes `leaves`.

    What it holds: the weights once, as the host arrays given (no device copy). The optimizer's
    fresh state is zeros (AdamW's moments mu and nu, the step counts; `tx.init` builds nothing
    else), written from np.zeros: a sizable one is calloc'd memory that the operating system maps
    only when written to, so reading it for the write costs none, and 2 of the 3 parameter-sized
    trees in the checkpoint take no memory here."""
    params = jax.tree_util.tree_map_with_path(
        lambda p, s: np.asarray(leaves.pop(leaf_path(p)), s.dtype).view(Unshared), trainer.plan.params.shapes)
    key, scaler = jax.random.key(trainer.cfg.train.seed), init_loss_scale(trainer.cfg)
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype).view(Unshared),
                         jax.eval_shape(trainer.tx.init, trainer.plan.params.shapes))
    state = start_state(params, optax.identity(), scaler, key).replace(opt_state=zeros)
    cfg = trainer.cfg.replace(checkpoint=dataclasses.replace(trainer.cfg.checkpoint, async_save=False))
    checkpointer = Checkpointer(cfg, directory, meta=meta)
    try:
        checkpointer.save(state, trainer)
    except BaseException:
        close_despite_signal(checkpointer, quiet=True)     # the error on its way out is the one to report
        raise
    close_despite_signal(checkpointer)


def close_despite_signal(checkpointer: Checkpointer, quiet: bool = False) -> None:
    """Close `checkpointer`, so that orbax's writer threads have stopped before the caller removes
    what they write into, even when the first SIGINT/SIGTERM lands during the close (a second one
    ends the process at once; `mtjax.staging` sweeps its leftovers later)."""
    from mtjax.interrupts import Interrupted
    try:
        checkpointer.close(quiet=quiet)
    except Interrupted:
        checkpointer.close(quiet=True)
        raise


def load_params(path: str) -> tuple[Config, int, dict[str, np.ndarray], dict]:
    """(the Config it was saved with, its vocabulary V, {leaf path: fp32 array}, its `meta` item)
    of the checkpoint `path` names (`find_checkpoint`); the vocabulary axis is still padded. Only
    the parameters are read."""
    directory, step = find_checkpoint(path)
    meta, saved = saved_config(directory, step)
    cfg = one_device_config(saved_run_config(directory, step, saved))
    layout = resolve_layout(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), int(meta["vocab"]))
    params = restore_params(directory, step, layout, meta)
    leaves = {leaf_path(p): np.asarray(jax.device_get(x)) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    return cfg, layout.vocab, leaves, meta

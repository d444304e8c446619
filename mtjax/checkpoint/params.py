"""A checkpoint's parameters, and nothing else, restored onto a model layout (`mtjax/layout.py`).

Opening a checkpoint to compute with it (generation, conversion, the weights a fine-tuning run
starts from) reads only the `params` subtree of the saved TrainState: orbax's partial restore
skips the optimizer moments, so nothing of the optimizer is built or read. The leaves land on
the layout's shardings in its layer order (stored canonical, `ModelLayout.run_order`).

The one stored shape that depends on the layout that saved it is the padded vocabulary: such
leaves are read whole and cut or zero-padded to this layout's V_p (rows beyond V never carry
probability). The caller names the step through `find_checkpoint`, which has checked every
file against the manifest: a damaged checkpoint is reported there and never read here.
"""
from __future__ import annotations

import os

import flax.linen as nn
import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from mtjax.checkpoint.checkpointer import Checkpointer
from mtjax.checkpoint.errors import CheckpointError, first_line, unrestorable
from mtjax.checkpoint.restore import resize_vocab
from mtjax.checkpoint.stored import check_stored_shapes
from mtjax.config.errors import ConfigError, is_fault
from mtjax.config.schema import Config, ParallelConfig
from mtjax.layout import ModelLayout, abstract_params
from mtjax.model.transformer import Transformer


def saved_config(directory: str, step: int) -> tuple[dict, dict]:
    """(meta, config as a dict) of the checkpoint at `step` (`Checkpointer.saved`), read-only."""
    checkpointer = Checkpointer(Config(), directory, read_only=True)
    try:
        return checkpointer.saved(step)
    finally:
        checkpointer.close()


def saved_run_config(directory: str, step: int, saved: dict) -> Config:
    """The Config the checkpoint at `step` was saved with (`saved`, as `saved_config` reads it),
    checked as a model to build (`validate_model`). A saved config no model has (a value of the
    wrong type, heads that do not divide the hidden size: an edited and resealed file) is a
    CheckpointError naming the checkpoint, not a key of the command's own config."""
    from mtjax.config.load import from_dict
    from mtjax.config.validate import validate_model
    try:
        cfg = from_dict(saved)
        validate_model(cfg.replace(parallel=ParallelConfig()))     # the model alone, not the layout it ran on
    except ConfigError as e:
        raise CheckpointError(f"checkpoint step {step} in {directory} was saved with a config that describes no "
                              f"model: {e}") from None
    return cfg


def restore_params(directory: str, step: int, layout: ModelLayout, meta: dict):
    """The fp32 parameters saved at `step` in `directory` (its `meta`, `saved_config`), on
    `layout`'s shardings and in its layer order; CheckpointError when they do not fit."""
    vocab, padded = int(meta["vocab"]), int(meta["padded_vocab"])
    if vocab != layout.vocab:
        raise CheckpointError(f"checkpoint step {step} was saved with a vocabulary of {vocab} tokens, "
                              f"this run's tokenizer has {layout.vocab}")
    stored = nn.unbox(abstract_params(Transformer(layout.model, padded), layout.model.seq_len))
    whole = NamedSharding(layout.mesh, P())

    def target(s, want, sharding):   # a leaf whose padding differs is read whole, then fitted
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding if s.shape == want.shape else whole)
    item = {"params": jax.tree.map(target, stored, layout.params.shapes, layout.param_shardings)}
    check_stored_shapes(os.path.join(directory, str(step), "state"), item, step, directory)
    restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    try:
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    except TypeError:   # an orbax before `partial_restore`: empty transforms restore the item's keys only
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, transforms={})
    try:
        with ocp.PyTreeCheckpointer() as reader:
            params = reader.restore(os.path.join(directory, str(step), "state"), args=args)["params"]
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint step {step} in {directory} cannot be restored: {first_line(e)}") from None
    except Exception as e:          # noqa: BLE001  (a damaged array: orbax's bare Exception)
        if is_fault(e):
            raise
        raise unrestorable(e, step, directory) from None
    return jax.jit(lambda p: layout.run_order(_fit(p, layout.params.shapes, vocab)),
                   out_shardings=layout.param_shardings)(params)


def _fit(tree, want, vocab: int):
    """Each leaf whose vocabulary axis is padded differently cut to V and zero-padded to the
    wanted size; every other leaf as is (`restore.resize_vocab`)."""
    return jax.tree.map(lambda x, w: resize_vocab(x, w, vocab), tree, want)

"""What a checkpoint's state item holds, read from orbax's metadata before any array is.

A restore whose target disagrees with the stored arrays (a config edited by hand and resealed, a
model change the config checks do not see) fails inside orbax's asynchronous reads: the error
arrives while other reads are still in flight, and their threads then print tracebacks after the
event loop has closed. Comparing the target's shapes with the stored ones first refuses such a
checkpoint in one line, naming the leaf, before a single read starts. So does a floating-point
array stored at another dtype than the target's: orbax would cast it on the read without a word
(an int32 embedding read as float32 weights).
"""
from __future__ import annotations

import contextlib
import logging

import jax
import numpy as np
import orbax.checkpoint as ocp

from mtjax.checkpoint.errors import CheckpointError


@contextlib.contextmanager
def quiet_absl():
    """Orbax's absl warnings held back (errors pass): it warns that an item directory has no step
    metadata file (the step directory has), and about every read-only directory it opens."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def stored_shapes(item_dir: str) -> dict[str, tuple[tuple[int, ...], object]] | None:
    """{orbax parameter name: (global shape, dtype)} of every array stored in `item_dir`; None when
    this orbax cannot say (then the restore itself decides, as before)."""
    try:
        with quiet_absl(), ocp.PyTreeCheckpointer() as reader:
            metadata = reader.metadata(item_dir)
        tree = getattr(metadata, "item_metadata", metadata)
        tree = getattr(tree, "tree", tree)
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "name"))
        return {leaf.name: (tuple(leaf.shape), getattr(leaf, "dtype", None)) for leaf in leaves
                if hasattr(leaf, "name")}
    except Exception:   # noqa: BLE001  (an orbax without this metadata: no early check)
        return None


def _key(k):
    """One step of a tree path as orbax names it: a dict key, an attribute or an index."""
    for field in ("key", "name", "idx"):
        if hasattr(k, field):
            return getattr(k, field)
    return k


def check_stored_shapes(item_dir: str, target, step: int, directory: str) -> None:
    """CheckpointError, naming the first leaf, when `target` (ShapeDtypeStructs) asks for an
    array the checkpoint at `step` does not hold, at another shape than it holds, or a floating-point
    one at another dtype (other leaves, the RNG key's among them, are stored in their own forms)."""
    stored = stored_shapes(item_dir)
    if not stored:
        return
    for path, want in jax.tree_util.tree_leaves_with_path(target):
        name = ".".join(str(_key(k)) for k in path)
        if name not in stored:
            raise CheckpointError(f"checkpoint step {step} in {directory} holds no array {name}")
        shape, dtype = stored[name]
        if shape != tuple(want.shape):
            raise CheckpointError(f"checkpoint step {step} in {directory} stores {name} at shape "
                                  f"{shape}, this model's is {tuple(want.shape)}")
        if _floating(want.dtype) and dtype is not None and np.dtype(dtype) != np.dtype(want.dtype):
            raise CheckpointError(f"checkpoint step {step} in {directory} stores {name} as {np.dtype(dtype).name}, "
                                  f"this model's is {np.dtype(want.dtype).name}")


def _floating(dtype) -> bool:
    try:
        return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))
    except TypeError:       # an extended dtype (a typed PRNG key)
        return False

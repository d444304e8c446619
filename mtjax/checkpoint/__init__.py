"""Checkpoints: asynchronous orbax saves that are complete or invisible, and restorable on any layout.

  checkpointer  the orbax save and restore (`Checkpointer`), and what is sealed after a signal;
  manifest      the manifest of sizes and CRC-32s that seals a step, and `verify`;
  policy        where checkpoints go, which steps count, what is kept and deleted, damaged
                steps moved aside, and `find_checkpoint` (a path to a step, read only);
  compat        what a restore checks first: the same model, the same data;
  restore       reading a stored state onto another layout (the padded vocabulary refitted);
  stored        the stored shapes, read from orbax's metadata: a mismatch refused before any read;
  params        the parameters alone onto a model layout (generation, conversion, init_from);
  errors        `CheckpointError` (a checkpoint that cannot be used), `CheckpointFault` (a save that failed);
  init_from     `train.init_from`: a run that starts from another checkpoint's weights (not imported here).

Importing this package loads orbax and the config, not the training machinery (no optimizer,
no step function, no pipeline executor): reading a checkpoint for inference needs none of it.
"""
from mtjax.checkpoint.checkpointer import Checkpointer
from mtjax.checkpoint.compat import check_same_data, check_same_model
from mtjax.checkpoint.errors import CheckpointError, CheckpointFault
from mtjax.checkpoint.manifest import MANIFEST, UNSEALED, verify, write_manifest
from mtjax.checkpoint.policy import CheckpointPlan, checkpoint_dir, existing_steps, find_checkpoint, plan_checkpoints

__all__ = ["Checkpointer", "CheckpointError", "CheckpointFault", "CheckpointPlan", "MANIFEST", "UNSEALED",
           "check_same_data", "check_same_model", "checkpoint_dir", "existing_steps",
           "find_checkpoint", "plan_checkpoints", "verify", "write_manifest"]

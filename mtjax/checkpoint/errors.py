"""The two ways a checkpoint goes wrong, each reported in one line."""
from __future__ import annotations

from mtjax.config.errors import RunFault, is_fault
from mtjax.data.errors import DataError


class CheckpointError(DataError):
    """A checkpoint that cannot be used; the message is one line naming it."""


class CheckpointFault(RunFault):
    """A checkpoint that could not be written; the message is one line naming step and directory."""


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def unrestorable(e: Exception, step: int, directory: str) -> CheckpointError:
    """A failed read of step `step`'s arrays that is not the machine's (`is_fault`: the caller
    re-raises those) as a CheckpointError naming the step. Orbax raises a bare Exception from its
    reads, with tensorstore's error (what was wrong with which array) as its cause."""
    reason = first_line(e.__cause__ if isinstance(e.__cause__, ValueError) else e)
    reason = reason.split(" [tensorstore_spec")[0]        # (the JSON spec of the store it opened, kilobytes)
    return CheckpointError(f"checkpoint step {step} in {directory} cannot be restored: {reason}")

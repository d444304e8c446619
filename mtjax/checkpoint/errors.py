"""The two ways a checkpoint goes wrong, each reported in one line."""
from __future__ import annotations

from mtjax.config.errors import RunFault
from mtjax.data.errors import DataError


class CheckpointError(DataError):
    """A checkpoint that cannot be used; the message is one line naming it."""


class CheckpointFault(RunFault):
    """A checkpoint that could not be written; the message is one line naming step and directory."""


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

"""SIGTERM / SIGINT as a request to stop at the next step boundary (after saving a checkpoint).

A cluster scheduler sends SIGTERM before it kills a job; Ctrl-C sends SIGINT. The
handler only records the signal; the loop finishes the step it is in, saves, and
returns. The first signal also reinstalls the handlers that were there before
(Python's KeyboardInterrupt for SIGINT, termination for SIGTERM), so a second
one is not swallowed: it interrupts the step, or the wait for the last save. With several
processes every one must stop at the same step (they meet in collectives), so the flag is
agreed on by a maximum over processes. That is a blocking collective (the host waits for the
step in flight), so the loop asks for it only at steps where it syncs anyway (logging,
checkpoints, the last step).
"""
from __future__ import annotations

import signal

import jax
import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Install with `with StopRequest() as stop:`; `stop.requested()` names the signal or is None."""

    def __init__(self):
        self._signal: int | None = None
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self._signal = signum
        for sig, handler in self._previous.items():   # the next signal acts at once
            signal.signal(sig, handler)

    def requested(self, agree: bool = True) -> str | None:
        """The signal received, if any. With several processes: the signal any of them received,
        where `agree` (every process must pass the same value), else None."""
        signum = self._signal or 0
        if jax.process_count() > 1:
            if not agree:
                return None
            from jax.experimental import multihost_utils
            signum = int(np.max(multihost_utils.process_allgather(np.int32(signum))))
        return signal.Signals(signum).name if signum else None

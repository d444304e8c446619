"""SIGTERM / SIGINT as a request to stop at the next step boundary (after saving a checkpoint).

A cluster scheduler sends SIGTERM before it kills a job; Ctrl-C sends SIGINT. The
handler only records the signal; the loop finishes the step it is in, saves, and
returns. A second signal, even milliseconds later, ends the process at once
(`mtjax.interrupts.exit_at_once`: one line, no traceback, no waiting for the save in
progress; the last sealed checkpoint is intact). Leaving the block restores the handlers
that were there before (a CLI that stopped on a signal re-arms the second-signal handler
for its own last steps). With several
processes every one must stop at the same step (they meet in collectives), so the flag is
agreed on by a maximum over all devices, started on the device behind each step and read one
step later (by then that step is done): the host never waits for it, and a signal stops the
run one step later than it would in a single process.
"""
from __future__ import annotations

import functools
import signal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtjax.interrupts import SIGNALS, arm_second_signal


class StopRequest:
    """Install with `with StopRequest() as stop:`; `stop.requested()` names the signal or is None."""

    def __init__(self):
        self._signal: int | None = None
        self._previous = {}
        self._agreement: jax.Array | None = None      # several processes: started last step

    def __enter__(self) -> "StopRequest":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self._signal = signum
        arm_second_signal()

    @property
    def requested_once(self) -> bool:
        """Whether this process has received a signal (whether or not the run has acted on it yet)."""
        return self._signal is not None

    def requested(self) -> str | None:
        """The signal received, if any. With several processes (each must call this once per
        step): the signal any of them had received one call earlier."""
        signum = self._signal or 0
        if _multi_process():
            agreed, self._agreement = self._agreement, _start_agreement(signum)
            signum = 0 if agreed is None else int(agreed)
        return signal.Signals(signum).name if signum else None


def _multi_process() -> bool:
    return jax.process_count() > 1


@functools.cache
def _agreement_fn():
    """(this process's flag on each of its devices -> global [devices] array, jitted max)."""
    mesh = Mesh(np.array(jax.devices()), ("all",))
    return NamedSharding(mesh, P("all")), jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))


def _start_agreement(signum: int) -> jax.Array:
    """The maximum of every process's flag, as a replicated scalar that is not waited for."""
    sharding, maximum = _agreement_fn()
    local = np.full((jax.local_device_count(),), signum, np.int32)
    return maximum(jax.make_array_from_process_local_data(sharding, local, (jax.device_count(),)))

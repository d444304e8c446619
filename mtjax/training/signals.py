"""SIGTERM / SIGINT as a request to stop at the next step boundary (after saving a checkpoint).

A cluster scheduler sends SIGTERM before it kills a job; Ctrl-C sends SIGINT. The
handler only records the signal; the loop finishes the step it is in, saves, and
returns. A second signal ends the process (`mtjax.interrupts.late_signal`): when a save is
being written it first waits for it to be sealed, up to a bound, saying so on one line; a
third (after a pause: a hammered key is one burst) ends it at once. The line names the newest
sealed checkpoint and the steps lost: the
StopRequest is the guard it asks (`unsealed`, `kept`), which is why the loop tells it each
step it finishes. Leaving the block restores the handlers that were there before (a CLI that
stopped on a signal re-arms the second-signal handler for its own last steps, and the guard
stays in place for them). With several
processes every one must stop at the same step (they meet in collectives), so the flag is
agreed on by a maximum over all devices, started on the device behind each step and read one
step later (by then that step is done): the host never waits for it, and a signal stops the
run one step later than it would in a single process.
"""
from __future__ import annotations

import functools
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtjax.interrupts import SIGNALS, arm_second_signal, guard_saves


TIME_LIMIT = 1 << 16      # the flag of a passed deadline: above every signal number
TIME_LIMIT_NAME = "time limit"


class StopRequest:
    """Install with `with StopRequest(checkpointer) as stop:`; `stop.requested(step)` names the
    signal or is None. `deadline` (a `time.monotonic()` value, train.exit_duration_min): once
    past it, a finished step stops the run as a signal would, named `TIME_LIMIT_NAME`."""

    def __init__(self, checkpointer=None, deadline: float | None = None):
        self._signal: int | None = None
        self._deadline = deadline
        self._previous = {}
        self._agreement: jax.Array | None = None      # several processes: started last step
        self._checkpointer = checkpointer
        self.step: int | None = None                  # the last step finished (from `requested`)

    def __enter__(self) -> "StopRequest":
        # Python delivers signals to the main thread only, and installs handlers only there: a run
        # started from another thread (`mtjax.train` in a worker) trains without a stop request.
        for sig in SIGNALS if threading.current_thread() is threading.main_thread() else ():
            self._previous[sig] = signal.signal(sig, self._handle)
        if self._checkpointer is not None:
            guard_saves(self)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._signal is None and self._checkpointer is not None:
            guard_saves(None)

    def _handle(self, signum, frame) -> None:
        self._signal = signum
        arm_second_signal()

    # -- the guard a later signal asks (mtjax.interrupts.SaveGuard); called from its threads

    def unsealed(self) -> list[int]:
        return self._checkpointer.unsealed()

    def kept(self) -> str:
        """'the newest sealed checkpoint is step K in DIR; N steps are lost (K+1-S)', S the last step done."""
        sealed = self._checkpointer.sealed_steps()
        where = self._checkpointer.directory
        newest = sealed[-1] if sealed else None
        kept = (f"the newest sealed checkpoint is step {newest} in {where}" if newest is not None
                else f"no sealed checkpoint in {where}")
        if self.step is None:
            return kept
        lost = self.step - (newest or 0)
        if lost <= 0:
            return f"{kept}; no step is lost"
        first = (newest or 0) + 1
        return f"{kept}; {lost} step{'s' if lost > 1 else ''} lost ({first if lost == 1 else f'{first}-{self.step}'})"

    @property
    def requested_once(self) -> bool:
        """Whether this process has received a signal (whether or not the run has acted on it yet)."""
        return self._signal is not None

    def requested(self, step: int | None = None) -> str | None:
        """The signal received, if any, once `step` (when given) is finished. With several
        processes (each must call this once per step): the signal any of them had received one
        call earlier."""
        if step is not None:
            self.step = step
        signum = max(self._signal or 0, TIME_LIMIT if self._past_deadline() else 0)   # as the processes' maximum
        if _multi_process():     # each process's clock is its own: the maximum agrees on one step
            agreed, self._agreement = self._agreement, _start_agreement(signum)
            signum = 0 if agreed is None else int(agreed)
        if signum == TIME_LIMIT:
            return TIME_LIMIT_NAME
        return signal.Signals(signum).name if signum else None

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline


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

"""How a command-line run ends on SIGINT (Ctrl-C) or SIGTERM (a scheduler's notice).

The first signal raises `Interrupted` in the main thread. It is a BaseException, like
KeyboardInterrupt, so no `except Exception` swallows it, and every `with` and `finally`
on the way out runs: temporary files are removed, locks released, files this run created
before it started training are taken back. `cli.run` then prints one line and exits with
128 + the signal number. (While training, `training.signals.StopRequest` replaces this
first step: the signal is recorded and the loop stops at the next step with a checkpoint.)

Any later signal ends the process at once, whatever it is doing (waiting for a save,
cleaning up, or blocked in XLA, where Python's own handlers would wait: a watcher thread
counts signals as they arrive): one line on stderr and `os._exit`, which runs no Python
code that could print a traceback. What is on disk stays consistent because every file is written under
a temporary name and renamed into place: the last sealed checkpoint is intact, a
half-written one is removed at the next start.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The first SIGINT or SIGTERM of a command-line run."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


_ENDING = threading.Lock()   # held by the one thread that ends the process (the watcher or the handler)


def exit_at_once(signum, frame) -> None:
    """A second signal: one line, and the process ends now (no cleanup, no traceback). The
    watcher thread and Python's handler both see it: whichever comes second does nothing."""
    if not _ENDING.acquire(blocking=False):
        return
    name = signal.Signals(signum).name
    os.write(2, f"error: {name} again: stopped at once; the last sealed checkpoint is kept, "
                f"anything half-written is removed at the next start\n".encode())
    os._exit(128 + signum)


def arm_second_signal() -> None:
    """From now on any SIGINT/SIGTERM ends the process at once."""
    for sig in SIGNALS:
        signal.signal(sig, exit_at_once)


def _raise_interrupted(signum, frame) -> None:
    arm_second_signal()
    raise Interrupted(signum)


def _redeliver_if_swallowed(unraisable) -> None:
    """sys.unraisablehook: the signal landed in a finalizer or a garbage-collector callback
    (JAX has some), where Python prints an exception and drops it. Take it back and send the
    signal again: it is handled at the next opportunity, normally outside the finalizer."""
    if isinstance(unraisable.exc_value, Interrupted):
        for sig in SIGNALS:
            signal.signal(sig, _raise_interrupted)
        os.kill(os.getpid(), unraisable.exc_value.signum)
        return
    sys.__unraisablehook__(unraisable)


def _count_signals(read_fd: int) -> None:
    """Watcher thread: Python runs a signal's handler only when the main thread is back in the
    interpreter, and two signals that arrive while it waits in XLA (a step, a compile) make one
    call. The C-level handler also writes each signal's number to the wakeup fd, so counting
    here sees the second one at once, wherever the main thread is."""
    seen = 0
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in SIGNALS:
                seen += 1
                if seen >= 2:
                    exit_at_once(signum, None)


@contextlib.contextmanager
def raise_on_signals():
    """Within the block the first SIGINT/SIGTERM raises `Interrupted`, later ones exit at once.
    Does nothing outside the main thread (Python delivers signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in SIGNALS}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _redeliver_if_swallowed
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_count_signals, args=(read_fd,), name="mtjax-signal-counter", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)                # the watcher reads end-of-file and ends
        sys.unraisablehook = previous_hook
        if signal.getsignal(signal.SIGINT) is not exit_at_once:   # after a signal, stay armed to the end
            for sig, handler in previous.items():
                signal.signal(sig, handler)

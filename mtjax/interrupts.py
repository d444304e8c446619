"""How a command-line run ends on SIGINT (Ctrl-C) or SIGTERM (a scheduler's notice).

The first signal raises `Interrupted` in the main thread. It is a BaseException, like
KeyboardInterrupt, so no `except Exception` swallows it, and every `with` and `finally`
on the way out runs: temporary files are removed, locks released, files this run created
before it started training are taken back. `cli.run` then prints one line and exits with
128 + the signal number. (While training, `training.signals.StopRequest` replaces this
first step: the signal is recorded and the loop stops at the next step with a checkpoint.)
Where a library runs an asyncio event loop in the main thread (orbax starting a save, or
restoring), the first signal is held until the call returns (`deferred`): raised inside the
loop, it would close the loop under threads that still report to it, each printing a traceback.

A later signal ends the process without cleanup (one line on stderr and `os._exit`, which runs
no Python code that could print a traceback), counted by a watcher thread as signals arrive
(Python's own handlers would wait while the main thread is blocked in XLA, and merge two
signals into one call):
  - the second, while a training run's save is being written (`guard_saves`): the process
    waits for that save to be sealed, up to SEAL_WAIT_S, saying so on one line, then ends;
  - the second otherwise, a third, or the wait running out: the process ends at once. A key
    held down or hammered is one request: while waiting, a signal less than BURST_S after
    the one before it is part of the same burst and only the first after a pause ends the
    process at once (hammered Ctrl-C every 150 ms would otherwise end the wait 150 ms in).
The line ends by naming the newest sealed checkpoint and how many steps are lost. What is on
disk stays consistent because every file is written under a temporary name and renamed into
place: the last sealed checkpoint is intact, a half-written one is removed at the next start.

Signals are process-wide, so what the later ones do is one process-wide record (`_LATE`):
whether the watcher counts them, and the guard of the saves in flight.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The first SIGINT or SIGTERM of a command-line run."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


SEAL_WAIT_S = 60.0    # how long a second signal waits for a save in flight to be sealed
BURST_S = 0.5         # signals closer together than this are one burst (a hammered key)
_POLL_S = 0.01


class SaveGuard(Protocol):
    """What a training run tells the signal handling about its checkpoints."""

    def unsealed(self) -> list[int]:
        """Steps whose save has started and is not yet sealed on disk (callable from any thread)."""

    def kept(self) -> str:
        """A clause naming the newest sealed checkpoint and the steps lost beyond it."""


@dataclass
class _Later:
    """The process's record of signals after the first (see the module docstring)."""

    lock: threading.Lock = field(default_factory=threading.Lock)       # one thread ends the process
    count: int = 0               # signals after the first, so far
    watching: bool = False       # a watcher thread counts them (else Python's handler does)
    skip: int = 0                # signals we sent ourselves (a redelivery), not to be counted
    guard: SaveGuard | None = None
    waiting: bool = False
    signum: int = 0              # the signal that started the wait
    last: float = -1e9           # time.monotonic() of the latest signal, the first included
    resending: bool = False      # a first signal swallowed by a finalizer is being sent again


_LATE = _Later()
_NO_GUARD = "the last sealed checkpoint is kept, anything half-written is removed at the next start"


def guard_saves(guard: SaveGuard | None) -> None:
    """From now on a second signal waits for `guard`'s unsealed saves (None: it no longer does)."""
    _LATE.guard = guard


def _write(text: str) -> None:
    os.write(2, text.encode(errors="replace"))


def _end(signum: int, how: str) -> None:
    """Finish the stderr line with `how` and what was kept; exit 128 + signum. Only the first
    caller ends the process; any other returns at once."""
    if not _LATE.lock.acquire(blocking=False):
        return
    guard = _LATE.guard
    kept = _NO_GUARD if guard is None else guard.kept()
    prefix = "" if _LATE.waiting else f"error: {signal.Signals(signum).name} again: "
    _write(f"{prefix}{how}; {kept}\n")
    os._exit(128 + signum)


def _wait_then_end(signum: int, guard: SaveGuard, bound: float) -> None:
    """Thread: poll until every unsealed save is sealed or `bound` seconds pass, then end."""
    deadline = time.monotonic() + bound
    while guard.unsealed():
        if time.monotonic() >= deadline:
            _end(signum, f"not sealed after {bound:.0f} s: stopped")
            return
        time.sleep(_POLL_S)
    _end(signum, "sealed: stopped")


def late_signal(signum: int) -> None:
    """One signal after the first. The second waits (in a thread, up to SEAL_WAIT_S) for the
    guard's saves in flight, if any, and says so on the line it starts; later ones in the same
    burst (less than BURST_S after the one before) are ignored while it waits; any other ends
    the process at once."""
    now, previous = time.monotonic(), _LATE.last
    _LATE.last = now
    _LATE.count += 1
    if _LATE.waiting and now - previous < BURST_S:
        return
    guard = _LATE.guard
    unsealed = guard.unsealed() if guard is not None and _LATE.count == 1 else []
    if not unsealed:
        _end(signum, "stopped at once")
        return
    name, bound = signal.Signals(signum).name, SEAL_WAIT_S
    steps = f"step{'s' if len(unsealed) > 1 else ''} {', '.join(str(s) for s in unsealed)}"
    _write(f"error: {name} again: waiting up to {bound:.0f} s for checkpoint {steps} to be sealed "
           f"(a signal after a pause stops at once)... ")
    _LATE.waiting, _LATE.signum = True, signum
    threading.Thread(target=_wait_then_end, args=(signum, guard, bound), name="mtjax-seal-wait",
                     daemon=True).start()


def _finish_wait() -> None:
    """The main thread leaves the command while a second signal waits: its saves are as done as
    they will be. End now, finishing the line (a signal during the interpreter's shutdown would
    otherwise kill the process with no line at all)."""
    guard = _LATE.guard
    _end(_LATE.signum, "sealed: stopped" if guard is None or not guard.unsealed() else "stopped")


def first_signal_seen() -> None:
    """Note the time of the first signal (the start of a burst)."""
    _LATE.last = time.monotonic()


def exit_at_once(signum, frame) -> None:
    """Python's handler for the signals after the first. Where the watcher thread counts them
    (a command-line run), it has already acted on this one: nothing to do."""
    if not _LATE.watching:
        late_signal(signum)


def arm_second_signal() -> None:
    """From now on any SIGINT/SIGTERM is a later signal (`late_signal`)."""
    for sig in SIGNALS:
        signal.signal(sig, exit_at_once)


def _raise_interrupted(signum, frame) -> None:
    _LATE.resending = False
    arm_second_signal()
    raise Interrupted(signum)


@contextlib.contextmanager
def deferred():
    """Within the block a first SIGINT/SIGTERM is held, and raised as `Interrupted` when the block
    ends; later signals act as always. For library calls that run an asyncio event loop in the
    main thread, as orbax's save and restore do: an exception raised inside the loop closes it
    while the writer threads still report to it, and each of them then prints a traceback
    (`RuntimeError: Event loop is closed`). Does nothing unless `raise_on_signals` is in force."""
    if threading.current_thread() is not threading.main_thread() or \
            any(signal.getsignal(sig) is not _raise_interrupted for sig in SIGNALS):
        yield
        return
    held = []

    def hold(signum, frame):
        held.append(signum)
        arm_second_signal()           # from now on as after any first signal

    for sig in SIGNALS:
        signal.signal(sig, hold)
    try:
        yield
    except BaseException:
        if held:
            raise Interrupted(held[0]) from None
        raise
    finally:
        if not held:
            for sig in SIGNALS:
                signal.signal(sig, _raise_interrupted)
    if held:
        raise Interrupted(held[0])


def _redeliver_if_swallowed(unraisable) -> None:
    """sys.unraisablehook: the signal landed in a finalizer or a garbage-collector callback
    (JAX has some), where Python prints an exception and drops it. Take it back and send the
    signal again: it is handled at the next opportunity, normally outside the finalizer."""
    if isinstance(unraisable.exc_value, Interrupted):
        _LATE.skip += 1               # the watcher has counted it once already
        _LATE.resending = True
        for sig in SIGNALS:
            signal.signal(sig, _raise_interrupted)
        # Sent from another thread, a moment later: `os.kill` to this process runs the handler
        # before it returns, which would raise inside this hook (printed, then dropped).
        threading.Timer(_POLL_S, os.kill, (os.getpid(), unraisable.exc_value.signum)).start()
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
            if signum not in SIGNALS:
                continue
            if _LATE.skip:
                _LATE.skip -= 1
                continue
            seen += 1
            if seen >= 2:
                late_signal(signum)
            else:
                first_signal_seen()


@contextlib.contextmanager
def raise_on_signals():
    """Within the block the first SIGINT/SIGTERM raises `Interrupted`, later ones end the process
    (`late_signal`); after the block, when a signal came, the rest are ignored while the process
    exits. Does nothing outside the main thread (Python delivers signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in SIGNALS}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _redeliver_if_swallowed
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_count_signals, args=(read_fd,), name="mtjax-signal-counter", daemon=True).start()
    _LATE.watching = True
    try:
        yield
    finally:
        if _LATE.waiting:
            _finish_wait()
        _LATE.watching = False
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)                # the watcher reads end-of-file and ends
        sys.unraisablehook = previous_hook
        # After a signal the command's work is done and only the interpreter's exit is left, during
        # which Python puts the default handlers back: a hammered Ctrl-C would kill the process
        # there with no line. Ignore the rest instead.
        armed = signal.getsignal(signal.SIGINT) is exit_at_once or _LATE.resending
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if armed else handler)

"""Orbax's echoes of a failed save, kept off a command's stderr.

When an asynchronous checkpoint write fails (a full disk, a file-size limit), mtjax reports it
in one line (`checkpoint.checkpointer`), but orbax's own machinery prints more:
- tensorstore's completion callbacks, arriving after orbax closed its asyncio event loop, each
  print a traceback ending in `RuntimeError: Event loop is closed` straight to `sys.stderr`
  (not through `sys.excepthook`, `sys.unraisablehook` or logging): dozens of them;
- asyncio's logger reports the write futures whose exception orbax had already raised
  ("Future exception was never retrieved");
- at exit, the write coroutines orbax had created but not started when the write failed are
  collected: "RuntimeWarning: coroutine '...' was never awaited" (mtjax itself runs no coroutine).
- after a failed read (a checkpoint whose arrays cannot be read), the read coroutines of the
  other arrays end with the same kind of error, reported when they are collected ("Exception
  ignored in: <coroutine object _read_array_index_and_device_put ...>" and a traceback each).
All repeat, as noise, the failure mtjax has already named. `quiet_orbax_echoes` wraps stderr in
`EchoFilter`, which holds each traceback block until its last line and drops the block only
when that line is the closed-loop error and every frame is asyncio's own; anything else passes
through whole and in order. Only the command-line entry points install it (`mtjax.cli.run`).
"""
from __future__ import annotations

import logging
import sys
import threading
import warnings

_START = "Traceback (most recent call last):"
_CLOSED = "RuntimeError: Event loop is closed"
_ASYNCIO_FRAME = "/asyncio/"
_ORBAX = "/orbax/"


class _Thread:
    """What one thread has written and not yet passed on."""

    def __init__(self):
        self.partial = ""             # its unfinished last line
        self.held: list[str] = []     # a traceback block, held until its exception line


class EchoFilter:
    """A text stream that passes writes on to `stream`, line by line, except the traceback blocks
    of a callback posted to a closed asyncio loop (see the module docstring). Each thread's
    writes are read apart: tensorstore's callbacks print from several threads at once, and a
    traceback is written piece by piece, so the pieces of two threads' blocks interleave."""

    def __init__(self, stream):
        self._stream = stream
        self._lock = threading.Lock()
        self._threads: dict[int, _Thread] = {}

    def write(self, text: str) -> int:
        with self._lock:
            mine = self._threads.setdefault(threading.get_ident(), _Thread())
            lines = (mine.partial + text).split("\n")
            mine.partial = lines.pop()
            for line in lines:
                self._line(mine, line + "\n")
            if not mine.held and mine.partial and not _START.startswith(mine.partial):
                self._stream.write(mine.partial)       # an unfinished line that opens no block: as it comes
                mine.partial = ""
            if not mine.held and not mine.partial:
                del self._threads[threading.get_ident()]
        return len(text)

    def _line(self, mine: _Thread, line: str) -> None:
        if not mine.held:
            if line.rstrip("\n") == _START:
                mine.held = [line]
            else:
                self._stream.write(line)
            return
        mine.held.append(line)
        if line.startswith(" "):                    # a frame or its source line: the block goes on
            return
        block, mine.held = mine.held, []
        if not _is_closed_loop_echo(block):
            self._stream.write("".join(block))

    def flush(self) -> None:
        # A held block is not let out here: the traceback printers flush only once a block is
        # whole, and its last line settles it. An unfinished line outside a block goes out.
        with self._lock:
            for mine in self._threads.values():
                if not mine.held and mine.partial:
                    self._stream.write(mine.partial)
                    mine.partial = ""
        self._stream.flush()

    def __getattr__(self, name):                     # fileno, isatty, encoding, ...: the stream's
        return getattr(self._stream, name)


def _is_closed_loop_echo(block: list[str]) -> bool:
    frames = [line for line in block[1:-1] if line.startswith("  File ")]
    return (block[-1].rstrip("\n") == _CLOSED and bool(frames)
            and all(_ASYNCIO_FRAME in frame.replace("\\", "/") for frame in frames))


def quiet_orbax_echoes() -> None:
    """Install `EchoFilter` on sys.stderr (once), keep asyncio's logger to critical errors and
    drop the never-awaited coroutine warnings of an abandoned write."""
    if not isinstance(sys.stderr, EchoFilter) and sys.stderr is not None:
        sys.stderr = EchoFilter(sys.stderr)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)
    if not getattr(sys.unraisablehook, "_drops_orbax_coroutines", False):
        sys.unraisablehook = _without_orbax_coroutines(sys.unraisablehook)


def _without_orbax_coroutines(previous):
    """An unraisable-exception hook that drops those of orbax's own coroutines (collected after
    a failed read or write, whose error mtjax has reported) and passes every other to `previous`."""
    def hook(unraisable):
        code = getattr(unraisable.object, "cr_code", None)
        if code is not None and _ORBAX in code.co_filename.replace("\\", "/"):
            return
        previous(unraisable)
    hook._drops_orbax_coroutines = True
    return hook

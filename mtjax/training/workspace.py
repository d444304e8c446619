"""The directories a run writes: owned by one run at a time, and taken back if the run never starts.

One writer. A run holds an exclusive lock on `train.run_dir` (and on the checkpoint directory,
wherever it is) from before it reads any data until it exits. The lock is `flock` on the
file `<dir>/.mtjax.lock`: the kernel drops it when the holder's process ends, however it
ends, so a lock left by a killed run never blocks the next one. The file says who holds it
(pid, host, start time), for the message a second run prints when it is refused. The
holder deletes the file when it lets go; a run that opened the old file just before that
finds, once it has the lock, that the path no longer names its file, and starts over.
With several processes, process 0 takes the locks and tells the others the outcome.

Nothing left by a run that never started. Leaving the `with` block before `started()` is
called, by an exception (bad input found late, an interrupt) or not, removes what this run
created: the lock files, the directories it made, and the files given to `created`; the
directories that were there keep their modification times.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket

import jax
import numpy as np

from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config

LOCK_NAME = ".mtjax.lock"


def checkpoint_dir(cfg: Config) -> str:
    """Where the run's checkpoints go: checkpoint.dir, or <train.run_dir>/checkpoints."""
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(cfg.train.run_dir, "checkpoints"))


class DirectoryLock:
    """An exclusive, non-blocking lock on one directory (see the module docstring)."""

    def __init__(self, directory: str, key: str):
        self.directory, self.key = directory, key
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock; ConfigError naming the holder if another run has it. Returns whether
        this call created the lock file."""
        while True:
            fd, created = _create_or_open(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise ConfigError(self.key, f"{self.directory} is in use by another run ({holder}); wait for it "
                                            f"to end or choose another directory") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)     # the holder deleted the file as we opened it: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": datetime.datetime.now().isoformat(timespec="seconds")}).encode())
        self._fd = fd
        return created

    def release(self) -> None:
        """Delete the lock file, then let go (deleting first: no run can lock a file about to vanish)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def _create_or_open(path: str) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        return os.open(path, os.O_RDWR), False


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its name"


def _make_dirs(directory: str) -> list[str]:
    """os.makedirs, returning the directories it created (outermost first)."""
    missing, path = [], os.path.abspath(directory)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    return missing[::-1]


class Workspace:
    """`with Workspace(cfg) as ws:` locks the run's directories; `ws.started()` once the run is
    accepted; `ws.created(path)` for a file this run made before then."""

    def __init__(self, cfg: Config):
        self.targets = [(os.path.abspath(cfg.train.run_dir), "train.run_dir")]
        if cfg.checkpoint.enabled and checkpoint_dir(cfg) != self.targets[0][0]:
            self.targets.append((checkpoint_dir(cfg), "checkpoint.dir" if cfg.checkpoint.dir else "train.run_dir"))
        self._locks: list[DirectoryLock] = []
        self._new: list[str] = []           # created by this run, removed (last first) if it never starts
        self._times: dict[str, tuple[int, int]] = {}   # existing directories' (atime, mtime), restored then too
        self._started = False
        self._main = jax.process_index() == 0

    def __enter__(self) -> "Workspace":
        problem = self._lock_all() if self._main else None
        problem = _agree(problem)
        if problem is not None:
            self._take_back()
            raise ConfigError(*problem)
        return self

    def _lock_all(self) -> tuple[str, str] | None:
        """Process 0: every lock, or (key, problem) for the first that fails."""
        for directory, key in self.targets:
            try:
                self.make_dirs(directory)
                lock = DirectoryLock(directory, key)
                if lock.acquire():
                    self._new.append(lock.path)
                self._locks.append(lock)
            except ConfigError as e:
                return e.key, str(e)[len(e.key) + 2:]
            except OSError as e:
                return key, f"cannot lock {directory}: {e.strerror}"
        return None

    def make_dirs(self, directory: str) -> None:
        """os.makedirs, remembering what it made (removed, when empty, if the run never starts)
        or, when the directory exists, its times (a refused run leaves even those as they were)."""
        full = os.path.abspath(directory)
        if os.path.isdir(full) and full not in self._times:
            st = os.stat(full)
            self._times[full] = (st.st_atime_ns, st.st_mtime_ns)
        self._new += _make_dirs(directory)

    def created(self, *paths: str) -> None:
        """Files (or directories) this run has just made: removed if the run never starts."""
        self._new += [os.path.abspath(p) for p in paths]

    def started(self) -> None:
        """The run is accepted: from now on what it wrote stays."""
        self._started = True

    def __exit__(self, *exc) -> None:
        self._take_back()

    def _take_back(self) -> None:
        for lock in reversed(self._locks):
            lock.release()
        self._locks = []
        if self._started or not self._main:
            return
        for path in reversed(self._new):
            _remove(path)
        self._new = []
        for directory, times in self._times.items():
            with contextlib.suppress(OSError):
                os.utime(directory, ns=times)


def _remove(path: str) -> None:
    """Remove a file, or a directory if it is empty (another run may share a made directory)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError:
        pass


def _agree(problem: tuple[str, str] | None) -> tuple[str, str] | None:
    """Process 0's outcome on every process (the others only learn that it failed)."""
    if jax.process_count() == 1:
        return problem
    from jax.experimental import multihost_utils
    failed = int(multihost_utils.broadcast_one_to_all(np.int32(problem is not None)))
    if not failed:
        return None
    return problem or ("train.run_dir", "process 0 could not lock the run's directories (see its message)")

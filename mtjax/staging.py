"""Output that appears complete or not at all: a directory built beside its target and renamed
onto it at the end.

    with staged(target, "--out") as tmp:      # target: checked by cli_checks.output_path
        ...write everything under tmp...

The staging directory is `.NAME.staging-TOKEN` beside `NAME`. Its owner holds an exclusive
`flock` on the file `.NAME.staging-TOKEN.lock` (pid, host and start time inside, for people)
from before the directory exists until after it is renamed or removed, as training locks its
run directory (`training/workspace.py`). The kernel drops the lock when the process ends,
however it ends, so:

- on an error, a fault or a signal, the block's owner removes the staging directory, once the
  writers it started have stopped (`settle`: orbax's threads and tensorstore's write on after an
  interrupt reached the main thread, and would otherwise recreate the tree after its removal);
- a staging directory left by a process killed outright (`kill -9`, a second signal, a crash)
  has a lock file nobody holds: the next `staged` into the same directory takes the lock, removes
  both, and goes on. A live writer's lock cannot be taken, so its directory is never touched.
  (flock over NFS is only as good as the server's locking.)
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import secrets
import shutil
import socket
import time

from mtjax.config.errors import ConfigError, RunFault, describe_fault, is_fault

MARK = ".staging-"
LOCK = ".lock"
SETTLE_S = 0.3          # the staging path must stay gone this long before it counts as removed
SETTLE_LIMIT_S = 30.0   # ... and writers still recreating it after this are left to the next sweep


def _prefix(target: str) -> str:
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}{MARK}")


@contextlib.contextmanager
def staged(target: str, flag: str):
    """A fresh directory beside `target` (an absolute path that does not exist, or an empty
    directory) that becomes `target` when the block ends without error, and is removed otherwise.
    A fault inside the block (`is_fault`: a full disk, ...) is a RunFault naming `flag` and
    `target`, saying that nothing was written."""
    sweep(target)
    tmp, lock_fd = _prefix(target) + secrets.token_hex(6), None
    try:
        lock_fd = _lock(tmp + LOCK)
        os.mkdir(tmp)                              # umask applies, as for any directory the user makes
        yield tmp
        _commit(tmp, target, flag)
    except BaseException as e:                     # a signal may land anywhere, even before the yield
        _settle_despite_signal(tmp)
        if isinstance(e, RunFault):                # said of the staging path, which is gone now
            raise RunFault(str(e).replace(tmp, target)) from None
        if isinstance(e, Exception) and is_fault(e):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else describe_fault(e)
            raise RunFault(f"{flag}: cannot write {target}: {reason}; nothing was written") from None
        raise
    finally:
        if lock_fd is not None:
            _unlock(tmp + LOCK, lock_fd)
        else:   # a signal landed inside `_lock` or before its fd was bound: the name is ours alone
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp + LOCK)


def _commit(tmp: str, target: str, flag: str) -> None:
    """Rename `tmp` onto `target` (rename(2) replaces an empty directory); refused if something
    took the target meanwhile."""
    try:
        os.replace(tmp, target)
    except OSError as e:
        if os.path.lexists(target):
            raise ConfigError(flag, f"{target} was created by someone else while this ran; nothing was "
                                    "written") from None
        raise e


def _settle_despite_signal(path: str) -> None:
    """`settle`, finished even if the first SIGINT/SIGTERM lands during it (it then goes on)."""
    try:
        settle(path)
    except BaseException:
        settle(path)
        raise


def settle(path: str) -> None:
    """Remove `path` and keep removing it until it has stayed gone for SETTLE_S (a writer the
    caller could not stop yet may recreate it), up to SETTLE_LIMIT_S."""
    deadline, gone_since = time.monotonic() + SETTLE_LIMIT_S, None
    while time.monotonic() < deadline:
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= SETTLE_S:
            return
        time.sleep(0.02)


def sweep(target: str) -> list[str]:
    """Remove the staging directories beside `target` whose owner is gone (its lock is free).
    Returns what was removed."""
    prefix = _prefix(target)
    directory, start = os.path.dirname(prefix), os.path.basename(prefix)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        if name.startswith(start) and name.endswith(LOCK) and _take_stale(os.path.join(directory, name)):
            removed.append(os.path.join(directory, name[:-len(LOCK)]))
    return removed


def _take_stale(lock_path: str) -> bool:
    """If nobody holds `lock_path`: remove its staging directory and it; True then."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return False                               # gone already: another sweeper was first
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False                           # a live writer
        if not _same_file(fd, lock_path):
            return False                           # removed and reused while we opened it
        shutil.rmtree(lock_path[:-len(LOCK)], ignore_errors=True)
        os.unlink(lock_path)
        return True
    finally:
        os.close(fd)


def _lock(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)             # a fresh name: nobody else can hold it
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": datetime.datetime.now().isoformat(timespec="seconds")}).encode())
    except BaseException:
        _unlock(path, fd)
        raise
    return fd


def _unlock(path: str, fd: int) -> None:
    """Delete the lock file, then let go (a sweeper that opened it meanwhile sees it replaced)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False

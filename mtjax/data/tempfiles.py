"""Temporary files that name their owner, so a killed writer's leftovers can be swept.

Every file the data pipeline writes is first written at

    TARGET.HOST.PID.TOKEN.tmp

and renamed onto TARGET when complete. HOST is `socket.gethostname()`, PID the
writer's process id and TOKEN 12 random hex digits (several writers in one
process), so a temporary path is unique to its writer from the moment its name
is chosen: whoever chose it may remove it without further checks.

A writer that is killed (SIGKILL, or a second signal, which exits at once)
cannot remove its temporary file. The next writer into the same directory calls
`sweep_stale`, which removes those whose HOST is this host and whose PID is no
longer alive. Temporary files of other hosts (a shared file system) are never
touched: whether their writers live cannot be checked from here.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from typing import Callable

SUFFIX = ".tmp"
TOKEN_HEX_DIGITS = 12


def temp_path(target: str) -> str:
    """A fresh temporary path next to `target`, owned by this process."""
    token = secrets.token_hex(TOKEN_HEX_DIGITS // 2)
    return f"{target}.{socket.gethostname()}.{os.getpid()}.{token}{SUFFIX}"


def sweep_stale(directory: str, is_target: Callable[[str], bool]) -> list[str]:
    """Remove the temporaries in `directory` left by dead writers of this host.

    Only temporaries whose target name (the file name before .HOST.PID.TOKEN.tmp)
    satisfies `is_target` are considered. Returns the paths removed. Best
    effort: a directory that cannot be listed or a file that cannot be removed
    (another sweeper was first) is skipped, as the next sweep will retry.
    """
    owner = re.compile(rf"\.{re.escape(socket.gethostname())}\.(\d+)\.[0-9a-f]{{{TOKEN_HEX_DIGITS}}}"
                       rf"{re.escape(SUFFIX)}$")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        match = owner.search(name)
        if match is None or not is_target(name[:match.start()]) or _alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            os.remove(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def remove_quietly(path: str) -> None:
    """Remove `path` if it exists (cleanup must not fail on what is already gone)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    # Signal 0 checks existence only. EPERM means it exists under another user;
    # a zombie counts as alive until its parent reaps it (its files are then swept).
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

"""The error types a command-line run ends with: bad input (exit status 2) and faults (status 1)."""
import errno
import os
import sys


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key, self.problem = key, problem


class RunFault(RuntimeError):
    """Not bad input but a failure of the machine while running (a full disk, a save that could
    not be written); the message is one line saying what was lost and what was kept."""


def fault_types() -> tuple[type, ...]:
    """What the machine, not the input, gets wrong, as libraries raise it: OSError (a full disk, a
    read-only file system, permissions, I/O errors of numpy and orbax's files), MemoryError, and
    safetensors' error type once that library is loaded (a failed write, a full disk included)."""
    st = sys.modules.get("safetensors")
    return (OSError, MemoryError) + ((st.SafetensorError,) if st is not None else ())


# The machine's errors as libraries that do not raise OSError word them (tensorstore, under orbax:
# "... [OS error 28: No space left on device]"; gloo's collectives when a peer process of a job of
# several died: "Gloo all-reduce failed: ... Read error ...: Connection reset by peer").
OS_REASONS = tuple(os.strerror(n) for n in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES,
                                            errno.EPERM, errno.ECONNRESET, errno.EPIPE))
OS_REASONS += ("Connection closed by peer",)


def is_fault(e: BaseException) -> bool:
    """Whether `e` is the machine's failure (`fault_types`), or a library's error that says one
    or was raised from one (its cause or context)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, fault_types()):
            return True
        if isinstance(e, (ValueError, RuntimeError)) and any(reason in str(e) for reason in OS_REASONS):
            return True
        e = e.__cause__ or e.__context__
    return False


def describe_fault(e: BaseException) -> str:
    """A fault on one line: the file and the system's reason where the error says them."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename is not None else e.strerror
    return " ".join(str(e).split()) or type(e).__name__

"""The rules every command line's input goes through, whatever the command (train, inspect,
generate, convert, data.preprocess, pipeline): one place, so that a flag added tomorrow gets
them without a check of its own.

- Numbers: every `type=int` or `type=float` option of a parser made by `mtjax.cli` is read by
  `read_int` / `read_float`, which apply the limits of config values (`mtjax.config.load.coerce`):
  integers within |v| < 2**31 (beyond that a typo, and an overflow inside JAX), floats finite and
  representable in fp32. A flag's own domain (>= 1, in (0, 1], ...) is checked where it is used.
- Paths: every option naming a file or directory is read by `path` (not empty, UTF-8).
- Output paths (`output_path`): an empty name is refused, the path must not exist (or be an
  empty directory, where the command documents that), and its parent must exist, be a directory
  and be writable; commands check this before any work.
- Flags the user did not give (`given`): an error never names one; a defaulted value that does not
  fit is clamped to its documented meaning or reported against what the user did give.

Every refusal is a ConfigError naming the flag: one line `error: FLAG: ...`, exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import secrets

from mtjax.config.errors import ConfigError, RunFault


def _coerce(key: str, value, typ):
    from mtjax.config.load import coerce          # numpy and yaml: only when a number is read
    return coerce(key, value, typ)


def read_int(text: str) -> int:
    """argparse `type` for int options: a base-10 integer within the config limit."""
    value = int(text)                            # ValueError: argparse's "invalid int value"
    try:
        return _coerce("", value, int)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(e.problem) from None


def read_float(text: str) -> float:
    """argparse `type` for float options: finite and representable in fp32."""
    value = float(text)
    try:
        return _coerce("", value, float)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(e.problem) from None


read_int.__name__, read_float.__name__ = "int", "float"     # argparse names the type in its messages


def path(text: str) -> str:
    """argparse `type` for options that name a file or directory: not empty, valid UTF-8."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; name a path")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid UTF-8") from None
    return text


def text(value: str) -> str:
    """argparse `type` for options holding text to encode (a prompt): valid Unicode (undecodable
    bytes of a command line arrive as lone surrogates, which no tokenizer encodes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 (at character {e.start})") from None
    return value


def given(argv: list[str], *flags: str) -> bool:
    """Whether any of `flags` is on the command line (as `--flag value` or `--flag=value`; parsers
    here refuse abbreviations, so nothing else can set it)."""
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def utf8_path(flag: str, path: str) -> None:
    """Undecodable bytes of a command line arrive as lone surrogates; orbax, safetensors and
    TensorBoard need UTF-8 paths."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(flag, f"{path!r} is not valid UTF-8") from None


def output_parent(flag: str, path: str) -> str:
    """The absolute parent directory of `path`, which must exist, be a directory and be writable
    (a read-only file system counts as not writable: access(2) says EROFS). A parent on a disk
    too full for one more entry is a fault (RunFault, status 1), not bad input."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(flag, f"{parent}: output directory does not exist or is not a directory")
    problem = None if os.access(parent, os.W_OK | os.X_OK) else errno.EACCES
    problem = problem or _create_in(parent)
    if problem in (errno.ENOSPC, errno.EDQUOT):
        raise RunFault(f"{flag}: {parent}: {os.strerror(problem)}; nothing was written")
    if problem is not None:
        raise ConfigError(flag, f"{parent}: output directory is not writable")
    return parent


def _create_in(directory: str) -> int | None:
    """None if a directory can be made (and removed) in `directory`, else the errno: access(2)
    says yes to root where the file system says no (sysfs, some FUSE and network mounts). The
    directory's times are put back, so a refused command leaves it as it was."""
    st = os.stat(directory)
    probe = os.path.join(directory, f".mtjax-probe-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
        return None
    except OSError as e:
        return e.errno
    finally:
        with contextlib.suppress(OSError):
            os.utime(directory, ns=(st.st_atime_ns, st.st_mtime_ns))


def output_path(flag: str, path: str, empty_dir_ok: bool = False) -> str:
    """`path` as an absolute path, if the command may create it there (see the module docstring).
    The current directory (or one above it) is refused even when empty: renaming onto it would
    leave the shell in a deleted directory."""
    if not path.strip():
        raise ConfigError(flag, "is empty; name the path to create")
    utf8_path(flag, path)
    full = os.path.abspath(path)
    if os.path.lexists(full):
        empty_dir = os.path.isdir(full) and not os.path.islink(full) and not os.listdir(full)
        if not (empty_dir and empty_dir_ok):
            kind = "a directory that is not empty" if os.path.isdir(full) else "a file" if os.path.isfile(full) else ""
            raise ConfigError(flag, f"{path} already exists{f' ({kind})' if kind else ''}; name a new "
                                    f"{'(or empty) ' if empty_dir_ok else ''}path")
        cwd = os.getcwd()
        if cwd == full or cwd.startswith(full.rstrip(os.sep) + os.sep):
            raise ConfigError(flag, f"{path} is the current directory; name a new directory")
    output_parent(flag, full)
    return full

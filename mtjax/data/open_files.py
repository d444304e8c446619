"""Token files mapped while they are read, at most `capacity` at a time, whatever the number of corpora.

A memory map of a .bin holds a file descriptor for as long as it lives (Python's mmap keeps a
duplicate of the one it was made from), so a blend that kept every corpus mapped would need one
descriptor per corpus and stop at the process's limit (RLIMIT_NOFILE, `ulimit -n`, often 1024),
when Megatron's users blend thousands of files. `OpenFiles` maps a file when it is first read and
keeps the `capacity` most recently read ones mapped; reading one more unmaps the least recently
read (a view handed out earlier keeps its own file mapped until it is dropped). Reads are the same
slices of the same maps as when every file stayed mapped; a blend of more corpora than `capacity`
pays an open and a map (under 0.1 ms) for each read of a corpus not among the recent ones.

The file is checked to be the one the index was checked against when its dataset was opened (same
device, inode and size). Another file under its name is read only if it holds the same tokens
(`same_content`, the dataset's check of its size, crc32 and largest id against the index: the
processes of a multi-host job each build the default corpus and rename their copy over the
others'); a corpus made again with other tokens while a run reads it is refused, not read as garbage.
"""
from __future__ import annotations

import errno
import mmap
import os
import resource
from collections import OrderedDict
from typing import Callable

import numpy as np

from mtjax.data.errors import DataError

MAX_CAPACITY = 4096    # maps: far below Linux's default of 65530 per process (vm.max_map_count)


def descriptor_limit() -> int | None:
    """The process's soft limit on open files; None when it is unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def default_capacity() -> int:
    """Files kept mapped: a quarter of the descriptor limit (at least 2), at most MAX_CAPACITY."""
    limit = descriptor_limit()
    return MAX_CAPACITY if limit is None else max(2, min(MAX_CAPACITY, limit // 4))


def too_many_open(path: str, e: OSError) -> OSError:
    """`e` again, or for EMFILE an OSError whose one line names the limit that was reached."""
    if e.errno != errno.EMFILE:
        return e
    return OSError(e.errno, f"cannot open: the process has reached its limit of {descriptor_limit()} open files "
                            "(RLIMIT_NOFILE; raise it with `ulimit -n`)", path)


def file_identity(st: os.stat_result) -> tuple[int, int, int]:
    """What says a file is still the one that was checked: (device, inode, size)."""
    return st.st_dev, st.st_ino, st.st_size


class OpenFiles:
    """The token arrays of recently read files, mapped; at most `capacity` of them
    (`default_capacity()` when None). One instance is shared by every corpus of a run."""

    def __init__(self, capacity: int | None = None):
        self.capacity = default_capacity() if capacity is None else int(capacity)
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._maps: OrderedDict[str, np.ndarray] = OrderedDict()    # least recently read first

    def __len__(self) -> int:
        return len(self._maps)

    def tokens(self, path: str, dtype: np.dtype, count: int, identity: tuple[int, int, int],
               same_content: Callable[[int], bool] | None = None) -> np.ndarray:
        """The `count` tokens of `path`, mapped read-only; DataError if the file is no longer `identity`
        and `same_content(fd)` (None: never) does not find the same tokens in the file open as fd."""
        mapped = self._maps.get(path)
        if mapped is not None:
            self._maps.move_to_end(path)
            return mapped
        while len(self._maps) >= self.capacity:
            self._maps.popitem(last=False)          # unmapped once no view of it is left
        mapped = self._map(path, dtype, count, identity, same_content)
        self._maps[path] = mapped
        return mapped

    @staticmethod
    def _map(path: str, dtype: np.dtype, count: int, identity: tuple[int, int, int],
             same_content: Callable[[int], bool] | None) -> np.ndarray:
        """The file mapped read-only (mmap and frombuffer: half the cost of np.memmap's set-up)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise DataError(f"{path}: removed since it was opened") from None
        except OSError as e:
            raise too_many_open(path, e) from None
        try:
            if file_identity(os.fstat(fd)) != identity and not (same_content is not None and same_content(fd)):
                raise DataError(f"{path}: changed since it was opened (made again while in use?); "
                                f"restart to read the new file")
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)     # holds a descriptor of its own
        except OSError as e:
            raise too_many_open(path, e) from None
        finally:
            os.close(fd)
        return np.frombuffer(mapped, dtype=dtype, count=count)

"""Writing `PREFIX.bin` and `PREFIX.idx` (format in `indexed.py`): all or nothing.

Both files are written under temporary names (see `tempfiles`) and renamed into place only in
`finalize`; an exception, a KeyboardInterrupt or `Interrupted` included, removes everything
the writer wrote.
"""
from __future__ import annotations

import os
import zlib

import numpy as np

from mtjax.data import tempfiles
from mtjax.data.index_format import DTYPE_CODES, dtype_code, encode_index

LIST_PIECE = 1 << 18        # ids of a list converted at a time (`IndexedWriter._converted`)

class IndexedWriter:
    """Appends documents to PREFIX.bin/.idx; nothing appears until `finalize`.

    Use as a context manager to finalize on success and remove everything
    written on any exception. Starting a writer sweeps the temporaries of
    PREFIX that dead writers of this host left behind. `record` says how the
    tokens are made (`tokenizer.record`); training refuses data without one.
    """

    def __init__(self, prefix: str, dtype, record: dict | None = None):
        self.prefix = os.fspath(prefix)
        self.record = record
        self.dtype = DTYPE_CODES[dtype_code(dtype)]
        self._limit = int(np.iinfo(self.dtype).max)
        directory, base = os.path.split(os.path.abspath(self.prefix))
        targets = {base + ".bin", base + ".idx"}
        tempfiles.sweep_stale(directory, targets.__contains__)
        self._finals = {self.prefix + ".bin": tempfiles.temp_path(self.prefix + ".bin"),
                        self.prefix + ".idx": tempfiles.temp_path(self.prefix + ".idx")}
        self._identity: dict[str, tuple[int, int]] = {}  # final path -> (st_dev, st_ino) of our temp
        self._offsets = [0]
        self._crc = 0
        self._max_id = -1
        self._state = "open"  # -> "committed" or "discarded"
        self._bin = None
        try:
            self._bin = self._create(self.prefix + ".bin")
        except BaseException:
            self._discard()
            raise

    def _create(self, final: str):
        f = open(self._finals[final], "xb")
        stat = os.fstat(f.fileno())
        self._identity[final] = (stat.st_dev, stat.st_ino)
        return f

    def add_document(self, tokens) -> None:
        """Append one document (a 1-D sequence of ids in the dtype's range)."""
        if self._state != "open":
            raise RuntimeError(f"IndexedWriter: add_document after the writer was {self._state}")
        arr = self._converted(tokens)
        if arr.size:
            self._max_id = max(self._max_id, int(arr.max()))
        self._bin.write(arr)
        self._crc = zlib.crc32(arr, self._crc)
        self._offsets.append(self._offsets[-1] + arr.size)

    def _converted(self, tokens) -> np.ndarray:
        """The document as a contiguous array of the token dtype, every id checked before anything
        is written. A list is converted LIST_PIECE ids at a time: a huge document (one text file)
        costs 2 or 4 bytes a token here, not an int64 copy of it and then one of its bytes."""
        if not isinstance(tokens, list):
            return np.ascontiguousarray(self._checked(np.asarray(tokens)), self.dtype)
        out = np.empty(len(tokens), self.dtype)
        for at in range(0, len(tokens), LIST_PIECE):
            piece = self._checked(np.asarray(tokens[at:at + LIST_PIECE]))
            out[at:at + piece.size] = piece
        return out

    def _checked(self, arr: np.ndarray) -> np.ndarray:
        if arr.ndim != 1:
            raise ValueError(f"a document must be 1-D, got shape {arr.shape}")
        if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() > self._limit):
            raise ValueError(f"token ids must be integers in [0, {self._limit}] for {self.dtype}")
        return arr

    @property
    def documents(self) -> int:
        """Documents added so far."""
        return len(self._offsets) - 1

    @property
    def tokens(self) -> int:
        """Tokens added so far."""
        return self._offsets[-1]

    def finalize(self) -> str:
        """Write the index and move both files into place; returns PREFIX.

        All or nothing: on any exception nothing this writer wrote remains,
        not even a .bin already renamed into place.
        """
        if self._state != "open":
            raise RuntimeError(f"IndexedWriter: finalize after the writer was {self._state}")
        try:
            _close_synced(self._bin)
            index = encode_index(self.dtype, np.asarray(self._offsets), self._max_id, self._crc, self.record)
            with self._create(self.prefix + ".idx") as f:
                f.write(index)
                f.flush()
                os.fsync(f.fileno())
            # .bin first: a crash in between leaves the new .bin next to an
            # older .idx (or none), which IndexedDataset reports against the .bin.
            for final, tmp in self._finals.items():
                os.replace(tmp, final)
            self._state = "committed"
        except BaseException:
            self._discard()
            raise
        return self.prefix

    def abort(self) -> None:
        """Discard everything written so far (nothing once finalized)."""
        if self._state != "committed":
            self._discard()

    def _discard(self) -> None:
        # Our files are recognized by inode, so this is right wherever the
        # exception struck: before, between or after the two renames.
        self._state = "discarded"
        if self._bin is not None:
            try:
                self._bin.close()
            except OSError:
                pass  # a failed write (a full disk) fails again on close; the data is discarded anyway
        for final, tmp in self._finals.items():
            tempfiles.remove_quietly(tmp)
            if final in self._identity and _identity(final) == self._identity[final]:
                tempfiles.remove_quietly(final)

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.finalize()


def _identity(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _close_synced(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()

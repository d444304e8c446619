"""Memory-mapped token files: `PREFIX.bin` holds tokens, `PREFIX.idx` says where.

Format (all little-endian; our own, in the spirit of Megatron's):

    PREFIX.bin   the tokens of every document back to back, uint16 when the
                 vocabulary has fewer than 65536 ids, else uint32.
    PREFIX.idx   a 40-byte header, then int64 offsets[n_docs + 1]:
                   magic    8 bytes  b"MTJAXIDX"
                   version  uint32   FORMAT_VERSION
                   dtype    uint32   1 = uint16, 2 = uint32
                   n_docs   uint64
                   tokens   uint64   total tokens in .bin
                   crc32    uint32   zlib.crc32 of the whole .bin
                   (4 bytes of padding)
                 document d is tokens[offsets[d]:offsets[d + 1]];
                 offsets[0] = 0 and offsets[n_docs] = tokens.

`IndexedWriter` writes both files under temporary names and renames them into
place only in `finalize`, so an interrupted write leaves no PREFIX.bin/.idx.
`IndexedDataset` checks every invariant above on open and raises `DataError`
naming the file at fault; the crc check (a full read of .bin) can be skipped.
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib

import numpy as np

from mtjax.data.errors import DataError

MAGIC = b"MTJAXIDX"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQQI4x")
DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
OFFSET_DTYPE = np.dtype("<i8")
CRC_CHUNK_BYTES = 16 << 20


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest token dtype of the format that holds ids < vocab_size."""
    return DTYPE_CODES[1] if vocab_size <= 65536 else DTYPE_CODES[2]


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype).newbyteorder("<")
    for code, candidate in DTYPE_CODES.items():
        if candidate == dtype:
            return code
    raise ValueError(f"token dtype must be uint16 or uint32, got {dtype}")


class IndexedWriter:
    """Appends documents to PREFIX.bin/.idx; nothing appears until `finalize`.

    Use as a context manager to finalize on success and discard the
    temporary files on an exception.
    """

    def __init__(self, prefix: str, dtype):
        self.prefix = os.fspath(prefix)
        self.dtype = DTYPE_CODES[_dtype_code(dtype)]
        self._max_id = np.iinfo(self.dtype).max
        self._dir = os.path.dirname(os.path.abspath(self.prefix))
        self._base = os.path.basename(self.prefix)
        fd, self._bin_tmp = tempfile.mkstemp(prefix=self._base + ".", suffix=".bin.tmp", dir=self._dir)
        self._bin = os.fdopen(fd, "wb")
        self._idx_tmp: str | None = None
        self._offsets = [0]
        self._crc = 0
        self._done = False

    def add_document(self, tokens) -> None:
        """Append one document (a 1-D sequence of ids in the dtype's range)."""
        if self._done:
            raise RuntimeError("IndexedWriter: add_document after finalize/abort")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be 1-D, got shape {arr.shape}")
        if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() > self._max_id):
            raise ValueError(f"token ids must be integers in [0, {self._max_id}] for {self.dtype}")
        data = arr.astype(self.dtype, copy=False).tobytes()
        self._bin.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._offsets.append(self._offsets[-1] + arr.size)

    @property
    def documents(self) -> int:
        """Documents added so far."""
        return len(self._offsets) - 1

    @property
    def tokens(self) -> int:
        """Tokens added so far."""
        return self._offsets[-1]

    def finalize(self) -> str:
        """Write the index and atomically move both files into place; returns PREFIX."""
        if self._done:
            raise RuntimeError("IndexedWriter: finalize called twice or after abort")
        self._done = True
        try:
            _close_synced(self._bin)
            offsets = np.asarray(self._offsets, dtype=OFFSET_DTYPE)
            header = HEADER.pack(MAGIC, FORMAT_VERSION, _dtype_code(self.dtype),
                                 len(offsets) - 1, int(offsets[-1]), self._crc)
            fd, self._idx_tmp = tempfile.mkstemp(prefix=self._base + ".", suffix=".idx.tmp", dir=self._dir)
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(offsets.tobytes())
                f.flush()
                os.fsync(f.fileno())
            for tmp in (self._bin_tmp, self._idx_tmp):
                os.chmod(tmp, 0o644)  # mkstemp creates 0600
            # .bin first: a crash in between leaves a .bin without an .idx, which
            # IndexedDataset reports as missing, never a stale pairing.
            os.replace(self._bin_tmp, self.prefix + ".bin")
            os.replace(self._idx_tmp, self.prefix + ".idx")
        except BaseException:
            self._remove_tmp()
            raise
        return self.prefix

    def abort(self) -> None:
        """Discard everything written so far."""
        self._done = True
        self._bin.close()
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        for tmp in (self._bin_tmp, self._idx_tmp):
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


def _close_synced(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx; documents are memmap slices.

    Attributes: `prefix`, `dtype`, `tokens` (total count), `offsets`
    (int64 [n_docs + 1]), `crc32` (of .bin, from the header) and
    `fingerprint` (crc32 and size of the .idx, which covers the .bin's crc:
    changes whenever the data does; used to key derived caches).
    """

    def __init__(self, prefix: str, verify: bool = True):
        self.prefix = os.fspath(prefix)
        self.idx_path = self.prefix + ".idx"
        self.bin_path = self.prefix + ".bin"
        self._read_index()
        self._tokens = self._open_bin(verify)

    def _read_index(self) -> None:
        path = self.idx_path
        raw = _read_file(path)
        if len(raw) < HEADER.size:
            raise DataError(f"{path}: truncated index ({len(raw)} bytes, the header alone is {HEADER.size})")
        magic, version, code, n_docs, tokens, crc = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise DataError(f"{path}: not an mtjax index file (bad magic {magic!r})")
        if version != FORMAT_VERSION:
            raise DataError(f"{path}: unsupported index version {version} (this code reads {FORMAT_VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown token dtype code {code}")
        expected = HEADER.size + OFFSET_DTYPE.itemsize * (n_docs + 1)
        if len(raw) != expected:
            raise DataError(f"{path}: {len(raw)} bytes but the header's {n_docs} documents need "
                            f"{expected}; truncated or corrupted")
        offsets = np.frombuffer(raw, dtype=OFFSET_DTYPE, offset=HEADER.size).astype(np.int64)
        if offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise DataError(f"{path}: document offsets do not start at 0 and increase monotonically")
        if offsets[-1] != tokens:
            raise DataError(f"{path}: document offsets end at {offsets[-1]} but the header says {tokens} tokens")
        self.dtype = DTYPE_CODES[code]
        self.tokens = int(tokens)
        self.crc32 = int(crc)
        self.offsets = offsets
        self.fingerprint = f"{zlib.crc32(raw):08x}-{len(raw)}"

    def _open_bin(self, verify: bool) -> np.ndarray:
        path = self.bin_path
        if not os.path.isfile(path):
            raise DataError(f"{path}: file not found")
        size, expected = os.path.getsize(path), self.tokens * self.dtype.itemsize
        if size != expected:
            raise DataError(f"{path}: {size} bytes but the index says {self.tokens} {self.dtype.name} "
                            f"tokens ({expected} bytes); truncated or corrupted")
        if verify:
            crc = _crc32_file(path)
            if crc != self.crc32:
                raise DataError(f"{path}: crc32 {crc:08x} differs from the index's {self.crc32:08x}; "
                                f"the file is corrupted")
        if self.tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(self.tokens,))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document i (a read-only view into the memmap)."""
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range [0, {len(self)})")
        return self._tokens[self.offsets[i]:self.offsets[i + 1]]

    @property
    def doc_lengths(self) -> np.ndarray:
        """int64 [n_docs]: tokens per document."""
        return np.diff(self.offsets)


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def _crc32_file(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CRC_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc

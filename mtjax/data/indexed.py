"""Memory-mapped token files: `PREFIX.bin` holds tokens, `PREFIX.idx` says where and how they were made.

Format version 3 (all little-endian; our own, in the spirit of Megatron's):

    PREFIX.bin   the tokens of every document back to back, uint16 when the
                 vocabulary has at most 65536 ids, else uint32.
    PREFIX.idx   a 56-byte header, the tokenizer record, then int64 offsets[n_docs + 1]:
                   magic       8 bytes  b"MTJAXIDX"
                   version     uint32   FORMAT_VERSION
                   dtype       uint32   1 = uint16, 2 = uint32
                   n_docs      uint64
                   tokens      uint64   total tokens in .bin
                   max_id      int64    largest token id in .bin, -1 when it is empty
                   bin_crc     uint32   zlib.crc32 of the whole .bin
                   record_len  uint32   bytes of the record (a multiple of 8)
                   idx_crc     uint32   zlib.crc32 of the whole .idx, this field read as 0
                   (4 bytes of padding)
                 the record: JSON (ASCII, space-padded) saying how the tokens were made,
                   {"tokenizer": {"name": "byte"} or {"name", "bytes", "crc32"} of the
                   tokenizer.json, "vocab_size", "eod_id", "bos_id", "add_bos"}
                   (`tokenizer.record`); {} when the writer was given none;
                 document d is tokens[offsets[d]:offsets[d + 1]];
                 offsets[0] = 0 and offsets[n_docs] = tokens.

`IndexedWriter` writes both files under temporary names (see `tempfiles`) and
renames them into place only in `finalize`; an exception, a KeyboardInterrupt
or `Interrupted` included, removes everything it wrote.

`IndexedDataset` checks the index's own checksum before it believes any other
field (only magic and version are read first: they say which format this is),
so damage anywhere in the .idx is reported against the .idx, and damage to the
tokens (their crc, and their largest id, computed in one pass) against the
.bin. That full read of the .bin can be skipped (`verify=False`). Files of
versions 1 and 2 (no tokenizer record: nothing says which tokenizer made them)
are refused: re-create them with `python -m mtjax.data.preprocess`.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np

from mtjax.data import tempfiles
from mtjax.data.errors import DataError

MAGIC = b"MTJAXIDX"
FORMAT_VERSION = 3
PREAMBLE = struct.Struct("<8sI")  # magic, version: the same in every format version
HEADER = struct.Struct("<8sIIQQqIII4x")
IDX_CRC_AT = HEADER.size - 8  # the last field but the padding
V2_HEADER = struct.Struct("<8sIIQQqII")  # what the fingerprint is computed over (see `fingerprint`)
DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
OFFSET_DTYPE = np.dtype("<i8")
CRC_CHUNK_BYTES = 16 << 20
REBUILD_HINT = "re-create it with `python -m mtjax.data.preprocess`"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest token dtype of the format that holds ids < vocab_size."""
    return DTYPE_CODES[1] if vocab_size <= 65536 else DTYPE_CODES[2]


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype).newbyteorder("<")
    for code, candidate in DTYPE_CODES.items():
        if candidate == dtype:
            return code
    raise ValueError(f"token dtype must be uint16 or uint32, got {dtype}")


def fingerprint(code: int, offsets: bytes, tokens: int, max_id: int, bin_crc: int) -> str:
    """What identifies the tokens and their documents, whatever the record says: the crc and size
    that version 2's index of the same data had (so checkpoints and sample-index caches made
    from version-2 files still match the same data made again)."""
    n_docs = len(offsets) // OFFSET_DTYPE.itemsize - 1
    crc = zlib.crc32(offsets, zlib.crc32(V2_HEADER.pack(MAGIC, 2, code, n_docs, tokens, max_id, bin_crc, 0)))
    return f"{crc:08x}-{V2_HEADER.size + len(offsets)}"


def _index_crc(raw: bytes) -> int:
    """crc32 of an .idx's bytes with the idx_crc field read as zero."""
    crc = zlib.crc32(raw[:IDX_CRC_AT])
    crc = zlib.crc32(b"\0\0\0\0", crc)
    return zlib.crc32(raw[IDX_CRC_AT + 4:], crc)


def _encode_record(record: dict | None) -> bytes:
    text = json.dumps(record or {}, sort_keys=True, ensure_ascii=True).encode("ascii")
    return text + b" " * (-len(text) % 8)        # the offsets stay 8-byte aligned


def encode_index(dtype, offsets: np.ndarray, max_id: int, bin_crc: int, record: dict | None = None) -> bytes:
    """The .idx bytes for documents at `offsets` (int64 [n_docs + 1]) made as `record` says."""
    offsets = np.asarray(offsets, dtype=OFFSET_DTYPE)
    meta = _encode_record(record)
    fields = (MAGIC, FORMAT_VERSION, _dtype_code(dtype), len(offsets) - 1, int(offsets[-1]), max_id, bin_crc,
              len(meta))
    body = meta + offsets.tobytes()
    crc = _index_crc(HEADER.pack(*fields, 0) + body)
    return HEADER.pack(*fields, crc) + body


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
        self.dtype = DTYPE_CODES[_dtype_code(dtype)]
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
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be 1-D, got shape {arr.shape}")
        if arr.size:
            if not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() > self._limit:
                raise ValueError(f"token ids must be integers in [0, {self._limit}] for {self.dtype}")
            self._max_id = max(self._max_id, int(arr.max()))
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


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx; documents are memmap slices.

    Attributes: `prefix`, `idx_path`, `bin_path`, `dtype`, `tokens` (total
    count), `offsets` (int64 [n_docs + 1]), `max_token_id` (largest id in the
    .bin, -1 when it holds no tokens), `bin_crc32` (from the header),
    `record` (how the tokens were made, `tokenizer.record`; None when the
    writer recorded nothing) and `fingerprint` (of the tokens and document
    boundaries, see `fingerprint`: it changes whenever the data does; used to
    key derived caches and to recognize a checkpoint's data).
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
        _check_preamble(path, raw)
        if len(raw) < HEADER.size:
            raise DataError(f"{path}: truncated index ({len(raw)} bytes, the header alone is {HEADER.size})")
        _, _, code, n_docs, tokens, max_id, bin_crc, record_len, idx_crc = HEADER.unpack_from(raw)
        crc = _index_crc(raw)
        if crc != idx_crc:
            raise DataError(f"{path}: index checksum mismatch (computed {crc:08x}, header says "
                            f"{idx_crc:08x}); the index is truncated or corrupted, {REBUILD_HINT}")
        # From here on the fields are as written; what fails now is a writer's bug.
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown token dtype code {code}")
        start = HEADER.size + record_len
        expected = start + OFFSET_DTYPE.itemsize * (n_docs + 1)
        if record_len % 8 or len(raw) != expected:
            raise DataError(f"{path}: {len(raw)} bytes but the header's {n_docs} documents and {record_len}-byte "
                            f"record need {expected}")
        record = _decode_record(path, raw[HEADER.size:start])
        offsets = np.frombuffer(raw, dtype=OFFSET_DTYPE, offset=start).astype(np.int64)
        if offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise DataError(f"{path}: document offsets do not start at 0 and increase monotonically")
        if offsets[-1] != tokens:
            raise DataError(f"{path}: document offsets end at {offsets[-1]} but the header says {tokens} tokens")
        dtype = DTYPE_CODES[code]
        if (max_id < 0) != (tokens == 0) or max_id < -1 or max_id > np.iinfo(dtype).max:
            raise DataError(f"{path}: largest token id {max_id} is impossible for {tokens} {dtype.name} tokens")
        self.dtype = dtype
        self.tokens = int(tokens)
        self.max_token_id = int(max_id)
        self.bin_crc32 = int(bin_crc)
        self.offsets = offsets
        self.record = record or None
        self.fingerprint = fingerprint(code, raw[start:], int(tokens), int(max_id), int(bin_crc))

    def _open_bin(self, verify: bool) -> np.ndarray:
        path = self.bin_path
        if os.path.isdir(path):
            raise DataError(f"{path}: is a directory, not a token file")
        if not os.path.isfile(path):
            raise DataError(f"{path}: file not found")
        size, expected = os.path.getsize(path), self.tokens * self.dtype.itemsize
        if size != expected:
            raise DataError(f"{path}: {size} bytes but the index says {self.tokens} {self.dtype.name} "
                            f"tokens ({expected} bytes); truncated or corrupted")
        if self.tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        tokens = np.memmap(path, dtype=self.dtype, mode="r", shape=(self.tokens,))
        if verify:
            crc, max_id = _scan(tokens)
            if crc != self.bin_crc32:
                raise DataError(f"{path}: crc32 {crc:08x} differs from the index's {self.bin_crc32:08x}; "
                                f"the file is corrupted")
            if max_id != self.max_token_id:
                raise DataError(f"{path}: largest token id {max_id} differs from the index's "
                                f"{self.max_token_id}; the file is corrupted")
        return tokens

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


def _decode_record(path: str, raw: bytes) -> dict:
    try:
        record = json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        record = None
    if not isinstance(record, dict):
        raise DataError(f"{path}: the tokenizer record is not a JSON object")
    return record


def _check_preamble(path: str, raw: bytes) -> None:
    """Magic and version, the only fields read before the index's checksum."""
    if len(raw) < PREAMBLE.size:
        raise DataError(f"{path}: truncated index ({len(raw)} bytes, the header alone is {HEADER.size})")
    magic, version = PREAMBLE.unpack_from(raw)
    if magic != MAGIC:
        raise DataError(f"{path}: not an mtjax index file (bad magic {magic!r})")
    if version in (1, 2):
        raise DataError(f"{path}: index format version {version} does not record which tokenizer made the data "
                        f"(this code reads version {FORMAT_VERSION}); {REBUILD_HINT}")
    if version != FORMAT_VERSION:
        raise DataError(f"{path}: unknown index format version {version} (this code reads "
                        f"{FORMAT_VERSION}); corrupted, or written by a newer mtjax")


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not an index file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def _scan(tokens: np.ndarray) -> tuple[int, int]:
    """(crc32 of the bytes, largest id) of a token array, in one chunked pass."""
    crc, max_id = 0, -1
    step = CRC_CHUNK_BYTES // tokens.itemsize
    for start in range(0, len(tokens), step):
        chunk = tokens[start:start + step]
        crc = zlib.crc32(chunk, crc)
        max_id = max(max_id, int(chunk.max()))
    return crc, max_id

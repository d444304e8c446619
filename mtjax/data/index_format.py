"""The index format of `PREFIX.idx` (version 3): its header, its record, its checksums.

The layout is described in `indexed.py`. Encoding is used by the writer, the checks read
before anything else (magic and version, then the index's own checksum) by the reader.
"""
from __future__ import annotations

import json
import struct
import zlib

import numpy as np

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


def dtype_code(dtype) -> int:
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


def index_crc(raw: bytes) -> int:
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
    fields = (MAGIC, FORMAT_VERSION, dtype_code(dtype), len(offsets) - 1, int(offsets[-1]), max_id, bin_crc,
              len(meta))
    body = meta + offsets.tobytes()
    crc = index_crc(HEADER.pack(*fields, 0) + body)
    return HEADER.pack(*fields, crc) + body


def decode_record(path: str, raw: bytes) -> dict:
    try:
        record = json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        record = None
    if not isinstance(record, dict):
        raise DataError(f"{path}: the tokenizer record is not a JSON object")
    return record


def check_preamble(path: str, raw: bytes) -> None:
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

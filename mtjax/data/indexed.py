"""Memory-mapped token files: `PREFIX.bin` holds tokens, `PREFIX.idx` says where and how they were made.

Format version 3 (all little-endian; our own, in the spirit of Megatron's; the header's
encoding and checks are in `index_format.py`):

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

`IndexedWriter` (`indexed_writer.py`) writes both files under temporary names (see `tempfiles`) and
renames them into place only in `finalize`; an exception, a KeyboardInterrupt
or `Interrupted` included, removes everything it wrote.

`IndexedDataset` (here) checks the index's own checksum before it believes any other
field (only magic and version are read first: they say which format this is),
so damage anywhere in the .idx is reported against the .idx, and damage to the
tokens (their crc, and their largest id, computed in one pass) against the
.bin. That full read of the .bin can be skipped (`verify=False`). Files of
versions 1 and 2 (no tokenizer record: nothing says which tokenizer made them)
are refused: re-create them with `python -m mtjax.data.preprocess`.
"""

from __future__ import annotations

import errno
import os
import zlib

import numpy as np

from mtjax.data.errors import DataError
from mtjax.data.index_format import (CRC_CHUNK_BYTES, DTYPE_CODES, FORMAT_VERSION, HEADER, OFFSET_DTYPE, REBUILD_HINT,
                                     check_preamble, decode_record, dtype_for_vocab, encode_index, fingerprint,
                                     index_crc)
from mtjax.data.indexed_writer import IndexedWriter
from mtjax.data.open_files import OpenFiles, file_identity, too_many_open

__all__ = ["FORMAT_VERSION", "HEADER", "IndexedDataset", "IndexedWriter", "dtype_for_vocab", "encode_index",
           "fingerprint"]


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx; documents are memmap slices.

    Attributes: `prefix`, `idx_path`, `bin_path`, `dtype`, `tokens` (total
    count), `offsets` (int64 [n_docs + 1]), `max_token_id` (largest id in the
    .bin, -1 when it holds no tokens), `bin_crc32` (from the header),
    `record` (how the tokens were made, `tokenizer.record`; None when the
    writer recorded nothing) and `fingerprint` (of the tokens and document
    boundaries, see `fingerprint`: it changes whenever the data does; used to
    key derived caches and to recognize a checkpoint's data).

    The index is read whole and closed; the .bin is checked (size, and with
    `verify` its crc and largest id) and closed, then mapped only while it is
    read, through `files` (`open_files.OpenFiles`: shared by the corpora of a
    blend, it bounds how many are mapped at once; each dataset has its own of
    one file when None).
    """

    def __init__(self, prefix: str, verify: bool = True, files: OpenFiles | None = None):
        self.prefix = os.fspath(prefix)
        self.idx_path = self.prefix + ".idx"
        self.bin_path = self.prefix + ".bin"
        self._files = OpenFiles(1) if files is None else files
        self._read_index()
        self._identity = self._check_bin(verify)

    def _read_index(self) -> None:
        path = self.idx_path
        raw = _read_file(path)
        check_preamble(path, raw)
        if len(raw) < HEADER.size:
            raise DataError(f"{path}: truncated index ({len(raw)} bytes, the header alone is {HEADER.size})")
        _, _, code, n_docs, tokens, max_id, bin_crc, record_len, idx_crc = HEADER.unpack_from(raw)
        crc = index_crc(raw)
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
        record = decode_record(path, raw[HEADER.size:start])
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

    def _check_bin(self, verify: bool) -> tuple[int, int, int]:
        """The .bin's `file_identity`, once its size (and with `verify` its crc and largest id) match the
        index; the file is closed again: it is mapped when read (`_tokens`)."""
        path = self.bin_path
        if os.path.isdir(path):
            raise DataError(f"{path}: is a directory, not a token file")
        if not os.path.isfile(path):    # (a FIFO would block the open)
            raise DataError(f"{path}: file not found")
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                size, expected = st.st_size, self.tokens * self.dtype.itemsize
                if size != expected:
                    raise DataError(f"{path}: {size} bytes but the index says {self.tokens} {self.dtype.name} "
                                    f"tokens ({expected} bytes); truncated or corrupted")
                if verify and self.tokens:
                    self._verify(_scan(f, self.dtype))
        except FileNotFoundError:
            raise DataError(f"{path}: file not found") from None
        except OSError as e:
            raise too_many_open(path, e) from None
        return file_identity(st)

    def _verify(self, scanned: tuple[int, int]) -> None:
        crc, max_id = scanned
        if crc != self.bin_crc32:
            raise DataError(f"{self.bin_path}: crc32 {crc:08x} differs from the index's {self.bin_crc32:08x}; "
                            f"the file is corrupted")
        if max_id != self.max_token_id:
            raise DataError(f"{self.bin_path}: largest token id {max_id} differs from the index's "
                            f"{self.max_token_id}; the file is corrupted")

    @property
    def _tokens(self) -> np.ndarray:
        """All the tokens: the .bin mapped (through `files`), or an empty array when it holds none."""
        if self.tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        return self._files.tokens(self.bin_path, self.dtype, self.tokens, self._identity, self._same_tokens)

    def _same_tokens(self, fd: int) -> bool:
        """Whether the .bin, replaced since it was checked and open as `fd`, holds the same tokens:
        its size, crc32 and largest id are the index's (another process of a multi-host job renamed
        its copy of the same corpus over it). It is then the file read from here on."""
        st = os.fstat(fd)
        if st.st_size != self.tokens * self.dtype.itemsize:
            return False
        with os.fdopen(os.dup(fd), "rb") as f:
            crc, max_id = _scan(f, self.dtype)
        if (crc, max_id) != (self.bin_crc32, self.max_token_id):
            return False
        self._identity = file_identity(st)
        return True

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

    def ends_with(self, token: int) -> np.ndarray:
        """bool [n_docs]: whether each document's last token is `token` (False for an empty one)."""
        ends = np.asarray(self.offsets[1:], np.int64)
        if self.tokens == 0:
            return np.zeros(len(ends), bool)
        last = self._tokens[np.maximum(ends - 1, 0)]
        return (ends > np.asarray(self.offsets[:-1], np.int64)) & (last == token)


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not an index file") from None
    except OSError as e:
        if e.errno == errno.EMFILE:
            raise too_many_open(path, e) from None
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def _scan(f, dtype: np.dtype) -> tuple[int, int]:
    """(crc32 of the bytes, largest id) of the token file open as `f`, in one chunked pass."""
    crc, max_id = 0, -1
    step = CRC_CHUNK_BYTES // dtype.itemsize * dtype.itemsize
    while chunk := f.read(step):
        crc = zlib.crc32(chunk, crc)
        max_id = max(max_id, int(np.frombuffer(chunk, dtype=dtype).max()))
    return crc, max_id

"""GPT samples: fixed-length windows over a shuffled stream of documents.

`GPTDataset(indexed, seq_len, seed, split, valid_fraction)[i]` is an int32
array of seq_len + 1 tokens: inputs are [:-1], labels [1:]. Index i may be
any non-negative integer; it reads epoch e = i // len(ds), whose sample
order is its own seeded shuffle (see `sample_index` for the layout).

The index arrays are a pure function of (data, seq_len, seed, split,
valid_fraction). With `cache_dir` they are cached there under a hash of those
inputs, as an .npz of three int64 arrays (doc_ids, start_doc, start_offset),
loaded without pickle and checked against the layout's invariants: a cache
that cannot be read or breaks one is reported (one line to `report`) and
rebuilt. Constructing a dataset writes nothing; `save_cache()` writes the
cache (atomically) once the caller has accepted the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Callable

import numpy as np

from mtjax.data import sample_index as si
from mtjax.data import tempfiles
from mtjax.data.errors import DataError, one_line
from mtjax.data.indexed import IndexedDataset

INDEX_CACHE_VERSION = 1  # bump when the layout in sample_index changes
CACHE_ARRAYS = ("doc_ids", "start_doc", "start_offset")
NPZ_MAGIC = b"PK\x03\x04"  # an .npz is a zip archive


def warn(line: str) -> None:
    """The default `report`: one `warning: ...` line on stderr."""
    print(f"warning: {line}", file=sys.stderr, flush=True)


class GPTDataset:
    """Samples of one split; `len()` is samples per epoch.

    Public arrays (int64): `doc_ids` [m] the split's documents in stream
    order; `start_doc` [N] and `start_offset` [N] locate each sample in it.
    `loaded_from_cache` says whether they came from `cache_path`. `report`
    receives one line (naming the cache file) for each problem with the
    cache that was worked around: a damaged file rebuilt, a failed save.
    """

    def __init__(self, indexed: IndexedDataset, seq_len: int, seed: int, split: str = "train",
                 valid_fraction: float = 0.0, cache_dir: str | None = None,
                 report: Callable[[str], None] = warn):
        if split not in si.SPLITS:
            raise ValueError(f"split must be one of {si.SPLITS}, got {split!r}")
        if seq_len < 1 or seed < 0:
            raise ValueError(f"need seq_len >= 1 and seed >= 0, got {seq_len} and {seed}")
        self.indexed, self.seq_len, self.seed = indexed, seq_len, seed
        self.split, self.valid_fraction = split, float(valid_fraction)
        self.report = report
        self.cache_path = None if cache_dir is None else os.path.join(
            cache_dir, f"gpt-{split}-L{seq_len}-{self._cache_key()}.npz")
        arrays = self._load_cache()
        self.loaded_from_cache = arrays is not None
        if arrays is None:
            arrays = self._build()
        self._save_pending = self.cache_path is not None and not self.loaded_from_cache
        self.doc_ids, self.start_doc, self.start_offset = arrays
        if len(self.start_doc) < 1:
            tokens = int(indexed.doc_lengths[self.doc_ids].sum())
            held = len(indexed) - len(self.doc_ids) if split == "train" and self.valid_fraction else 0
            why = f" (valid_fraction {self.valid_fraction} holds out {held} of its {len(indexed)})" if held else ""
            if split == "valid" and self.valid_fraction:     # what would mend it: a larger share, or a corpus of its own
                why = (f" (valid_fraction {self.valid_fraction} holds out these of its {len(indexed)}: raise it, or give "
                       "data.valid_path)")
            raise DataError(f"{indexed.idx_path}: the {split} split has {tokens} tokens in "
                            f"{len(self.doc_ids)} documents{why}, fewer than one sample of {seq_len + 1}")
        self._order_memo: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.start_doc)

    def __getitem__(self, i: int) -> np.ndarray:
        """int32 [seq_len + 1]: sample at position i (any i >= 0; epochs wrap)."""
        if i < 0:
            raise IndexError(f"sample position must be >= 0, got {i}")
        epoch, j = divmod(int(i), len(self))
        return self.window(int(self.sample_order(epoch)[j]))

    def window(self, sample: int) -> np.ndarray:
        """int32 [seq_len + 1]: stream[sample*L : sample*L + L + 1], read doc by doc."""
        k, offset = int(self.start_doc[sample]), int(self.start_offset[sample])
        parts, need = [], self.seq_len + 1
        while need > 0:  # always ends: the index only holds windows inside the stream
            part = self.indexed.doc(int(self.doc_ids[k]))[offset:offset + need]
            parts.append(part)
            need -= len(part)
            k, offset = k + 1, 0
        return np.concatenate(parts).astype(np.int32)

    def sample_order(self, epoch: int) -> np.ndarray:
        """int64 [N]: sample read at each position of `epoch` (last epoch memoized)."""
        memo = self._order_memo
        if memo is None or memo[0] != epoch:
            memo = (epoch, si.sample_order(len(self), self.seed, self.split, epoch))
            self._order_memo = memo
        return memo[1]

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        train_ids, valid_ids = si.split_documents(len(self.indexed), self.seed, self.valid_fraction)
        ids = train_ids if self.split == "train" else valid_ids
        doc_ids = si.shuffle_documents(ids, self.seed, self.split)
        start_doc, start_offset = si.build_sample_index(self.indexed.doc_lengths[doc_ids], self.seq_len)
        return doc_ids, start_doc, start_offset

    def _cache_key(self) -> str:
        inputs = [INDEX_CACHE_VERSION, self.indexed.fingerprint, self.seq_len, self.seed,
                  self.split, repr(self.valid_fraction)]
        return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]

    def _load_cache(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        path = self.cache_path
        if path is None or not os.path.lexists(path):
            return None
        try:
            arrays = _read_npz(path)
            si.check_sample_index(*arrays, self.indexed.doc_lengths, self.seq_len)
        except Exception as e:  # whatever is wrong with a derived file, rebuilding mends it
            self.report(f"{path}: damaged sample index cache ({one_line(e)}); rebuilding it")
            return None
        return tuple(a.astype(np.int64) for a in arrays)

    def save_cache(self) -> None:
        """Write the index arrays to `cache_path` (a temporary file, then a rename).

        Does nothing without a cache_dir, when the arrays were loaded from the
        cache, or when called again. Call it once the run has been accepted:
        a run refused after opening its data must leave no files. An OSError
        (a full disk, a read-only directory) is reported and otherwise
        ignored: the cache only saves time.
        """
        if not self._save_pending:
            return
        self._save_pending = False
        arrays = dict(zip(CACHE_ARRAYS, (self.doc_ids, self.start_doc, self.start_offset)))
        try:
            _write_npz(self.cache_path, arrays)
        except OSError as e:
            self.report(f"{self.cache_path}: cannot save the sample index cache "
                        f"({e.strerror or one_line(e)}); going on without it")


def _read_npz(path: str) -> tuple[np.ndarray, ...]:
    """The CACHE_ARRAYS of an .npz, read without pickle; raises on anything else."""
    if not os.path.isfile(path):
        raise ValueError("a directory, not a file" if os.path.isdir(path) else "not a regular file")
    with open(path, "rb") as f:
        if f.read(len(NPZ_MAGIC)) != NPZ_MAGIC:
            raise ValueError("not an .npz archive")
    with np.load(path, allow_pickle=False) as z:
        missing = [name for name in CACHE_ARRAYS if name not in z.files]
        if missing:
            raise ValueError(f"no array {', '.join(missing)}")
        return tuple(z[name] for name in CACHE_ARRAYS)


def _write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tempfiles.sweep_stale(directory, lambda name: name.startswith("gpt-") and name.endswith(".npz"))
    tmp = tempfiles.temp_path(path)
    try:
        with open(tmp, "xb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        tempfiles.remove_quietly(tmp)
        raise

"""GPT samples: fixed-length windows over a shuffled stream of documents.

`GPTDataset(indexed, seq_len, seed, split, valid_fraction)[i]` is an int32
array of seq_len + 1 tokens: inputs are [:-1], labels [1:]. Index i may be
any non-negative integer; it reads epoch e = i // len(ds), whose sample
order is its own seeded shuffle (see `sample_index` for the layout).

The index arrays are a pure function of (data, seq_len, seed, split,
valid_fraction); with `cache_dir` they are saved there once (atomically)
under a hash of those inputs and reloaded by later runs and other hosts.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np

from mtjax.data.errors import DataError
from mtjax.data.indexed import IndexedDataset
from mtjax.data import sample_index as si

INDEX_CACHE_VERSION = 1  # bump when the layout in sample_index changes


class GPTDataset:
    """Samples of one split; `len()` is samples per epoch.

    Public arrays (int64): `doc_ids` [m] the split's documents in stream
    order; `start_doc` [N] and `start_offset` [N] locate each sample in it.
    """

    def __init__(self, indexed: IndexedDataset, seq_len: int, seed: int, split: str = "train",
                 valid_fraction: float = 0.0, cache_dir: str | None = None):
        if split not in si.SPLITS:
            raise ValueError(f"split must be one of {si.SPLITS}, got {split!r}")
        if seq_len < 1 or seed < 0:
            raise ValueError(f"need seq_len >= 1 and seed >= 0, got {seq_len} and {seed}")
        self.indexed, self.seq_len, self.seed = indexed, seq_len, seed
        self.split, self.valid_fraction = split, float(valid_fraction)
        self.cache_path = None if cache_dir is None else os.path.join(
            cache_dir, f"gpt-{split}-L{seq_len}-{self._cache_key()}.npz")
        arrays = self._load_cache()
        self.loaded_from_cache = arrays is not None
        if arrays is None:
            arrays = self._build()
            self._save_cache(arrays)
        self.doc_ids, self.start_doc, self.start_offset = arrays
        if len(self.start_doc) < 1:
            tokens = int(indexed.doc_lengths[self.doc_ids].sum())
            raise DataError(f"{indexed.idx_path}: the {split} split has {tokens} tokens in "
                            f"{len(self.doc_ids)} documents, fewer than one sample of {seq_len + 1}")
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

    def _load_cache(self):
        if self.cache_path is None or not os.path.isfile(self.cache_path):
            return None
        try:
            with np.load(self.cache_path) as z:
                arrays = (z["doc_ids"], z["start_doc"], z["start_offset"])
        except (OSError, ValueError, KeyError):
            return None  # unreadable cache: it is derived data, so rebuild it
        return arrays

    def _save_cache(self, arrays) -> None:
        if self.cache_path is None:
            return
        directory = os.path.dirname(self.cache_path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gpt-index.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                doc_ids, start_doc, start_offset = arrays
                np.savez(f, doc_ids=doc_ids, start_doc=start_doc, start_offset=start_offset)
            os.replace(tmp, self.cache_path)
        except BaseException:
            os.remove(tmp)
            raise

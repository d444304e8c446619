"""Pure functions that lay out GPT training samples over a set of documents.

Legend: n = documents in the dataset, m = documents in a split,
N = samples per epoch, L = seq_len.

1. `split_documents`: a seeded permutation of the n document ids; its first
   max(1, round(fraction * n)) ids (0 when fraction == 0, all n when it is 1:
   a corpus used whole for validation) form the valid split, the rest the
   train split. Both are returned sorted.
2. `shuffle_documents`: a seeded permutation of a split's ids gives the
   stream order; concatenating those documents (each already ending in EOD)
   gives one token stream of T tokens.
3. `build_sample_index`: sample j is stream[j*L : j*L + L + 1] (inputs and
   labels shifted by one share the array), for j < N = (T - 1) // L. It is
   located by (start_doc[j], start_offset[j]): the position in stream order
   of the document holding token j*L, and that token's offset within it, so
   reading a sample touches only the documents it overlaps (as Megatron's
   sample index does).
4. `sample_order`: a seeded permutation of the N samples, one per epoch.

Seeds are numpy SeedSequence entropy lists [seed, purpose, ...], so the
streams for different purposes, splits and epochs are independent.
"""

from __future__ import annotations

import numpy as np

SPLITS = ("train", "valid")
_PURPOSE_SPLIT, _PURPOSE_DOCS, _PURPOSE_EPOCH = 1, 2, 3


def split_documents(n_docs: int, seed: int, valid_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train_ids, valid_ids), disjoint, sorted, together all of range(n_docs)."""
    if not 0.0 <= valid_fraction <= 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1], got {valid_fraction}")
    n_valid = max(1, round(valid_fraction * n_docs)) if valid_fraction > 0 else 0
    perm = np.random.default_rng([seed, _PURPOSE_SPLIT]).permutation(n_docs)
    return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])


def shuffle_documents(doc_ids: np.ndarray, seed: int, split: str) -> np.ndarray:
    """int64 [m]: the split's document ids in stream order."""
    rng = np.random.default_rng([seed, _PURPOSE_DOCS, SPLITS.index(split)])
    return rng.permutation(np.asarray(doc_ids, dtype=np.int64))


def build_sample_index(stream_doc_lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(start_doc, start_offset), int64 [N] each, for documents of these lengths in stream order."""
    lengths = np.asarray(stream_doc_lengths, dtype=np.int64)
    doc_start = np.concatenate([[0], np.cumsum(lengths)])  # [m + 1] stream offset of each doc
    n_samples = max(0, int(doc_start[-1]) - 1) // seq_len
    starts = np.arange(n_samples, dtype=np.int64) * seq_len
    # The last document starting at or before each sample start; side="right"
    # steps over empty documents, which share their start with the next one.
    start_doc = np.searchsorted(doc_start, starts, side="right") - 1
    return start_doc, starts - doc_start[start_doc]


def sample_order(n_samples: int, seed: int, split: str, epoch: int) -> np.ndarray:
    """int64 [N]: which sample is read at each position of this epoch."""
    rng = np.random.default_rng([seed, _PURPOSE_EPOCH, SPLITS.index(split), epoch])
    return rng.permutation(n_samples)


def check_sample_index(doc_ids, start_doc, start_offset, doc_lengths: np.ndarray, seq_len: int) -> None:
    """Raise ValueError naming the first invariant of step 3 these arrays break.

    For a split of documents `doc_ids` (ids in [0, n), n = len(doc_lengths)) in
    stream order: start_doc and start_offset are integer [N] with
    N = (T - 1) // L, start_doc[j] in [0, m), start_offset[j] within that
    document, and sample j starting at stream position j * L. Costs O(m + N),
    far less than reading the samples.
    """
    arrays = {"doc_ids": doc_ids, "start_doc": start_doc, "start_offset": start_offset}
    for name, a in arrays.items():
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{name} is {a.dtype} of shape {a.shape}, not a 1-D integer array")
    n, m = len(doc_lengths), len(doc_ids)
    if m and (doc_ids.min() < 0 or doc_ids.max() >= n):
        raise ValueError(f"doc_ids outside [0, {n})")
    lengths = doc_lengths[doc_ids.astype(np.int64)]
    doc_start = np.concatenate([[0], np.cumsum(lengths)])  # [m + 1]
    n_samples = max(0, int(doc_start[-1]) - 1) // seq_len
    if len(start_doc) != n_samples or len(start_offset) != n_samples:
        raise ValueError(f"{len(start_doc)} start_doc and {len(start_offset)} start_offset entries "
                         f"where the documents hold {n_samples} samples")
    if n_samples and (start_doc.min() < 0 or start_doc.max() >= m):
        raise ValueError(f"start_doc outside [0, {m})")
    start_doc, start_offset = start_doc.astype(np.int64), start_offset.astype(np.int64)
    if np.any((start_offset < 0) | (start_offset >= lengths[start_doc])):
        raise ValueError("start_offset outside its document")
    if np.any(doc_start[start_doc] + start_offset != np.arange(n_samples) * seq_len):
        raise ValueError(f"samples do not start every {seq_len} tokens of the stream")

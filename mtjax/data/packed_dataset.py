"""Rows packed from fine-tuning samples (`sft.py`), no sample split across rows.

`PackedDataset(indexed, seq_len, seed, eod, split, valid_fraction)[i]` is an int32 row of s + 1
tokens, as `GPTDataset`'s: the split's samples, in a seeded shuffled order, are packed best-fit
(each goes in the row it fills the most of those it fits in, else starts one; `pack_best_fit`),
and padding fills the rest of each row. A token carries `NO_LOSS` where predicting it carries no
loss: a prompt token, and the padding, which is the end-of-document id (each padding token is
then a one-token document of its own under document masking). So with `data.document_masking`
the samples of a row neither see nor position each other, and the loss (training and validation
alike) counts the response tokens and their EOD only. Index i reads epoch i // len(ds), whose
row order is its own shuffle; the packing itself is the same in every epoch.

The split holds out `valid_fraction` of the samples (`sample_index.split_documents` over sample
ids). A sample longer than s + 1 tokens (data made with a larger --seq-len) is refused. A sample
whose response does not end in EOD was cut to fit the --seq-len it was made with: it takes a row
of its own (where that --seq-len is below the model's, padding follows it, and the padding's
first EOD ends its document), since a sample packed after it would join its document.
"""
from __future__ import annotations

import bisect

import numpy as np

from mtjax.data import sample_index as si
from mtjax.data.errors import DataError
from mtjax.data.indexed import IndexedDataset
from mtjax.data.sft import NO_LOSS


def pack_best_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, bounds): samples of these `lengths` (each <= capacity) into rows of `capacity`
    tokens, best-fit in the order given (each sample goes in the open row it fills the most,
    else starts a row); row r holds samples order[bounds[r]:bounds[r + 1]], in the order given.
    order int64 [m], bounds int64 [rows + 1]."""
    free: list[tuple[int, int]] = []                 # (tokens left, row), sorted
    row_of = np.empty(len(lengths), np.int64)
    rows = 0
    for k, n in enumerate(lengths.tolist()):
        i = bisect.bisect_left(free, (n, -1))        # the row with the fewest tokens left that fit n
        if i < len(free):
            left, r = free.pop(i)
        else:
            left, r, rows = capacity, rows, rows + 1
        row_of[k] = r
        if left - n > 0:
            bisect.insort(free, (left - n, r))
    order = np.argsort(row_of, kind="stable")
    return order, np.searchsorted(row_of[order], np.arange(rows + 1))


class PackedDataset:
    """Rows of one split; `len()` is rows per epoch. Public: `samples` (int64 [m], sample ids row
    by row), `bounds` (row r: samples[bounds[r]:bounds[r + 1]]), `padding` (padding tokens, all rows)."""

    loaded_from_cache = False

    def __init__(self, indexed: IndexedDataset, seq_len: int, seed: int, eod: int, split: str = "train",
                 valid_fraction: float = 0.0):
        self.indexed, self.seq_len, self.seed, self.eod, self.split = indexed, seq_len, seed, eod, split
        if len(indexed) % 2:
            raise DataError(f"{indexed.idx_path}: {len(indexed)} documents, an odd count; fine-tuning data "
                            f"holds a prompt and a response per sample")
        lengths = indexed.doc_lengths.reshape(-1, 2).sum(axis=1)         # prompt + response per sample
        cut = ~indexed.ends_with(eod)[1::2]      # a response without its EOD was cut to fit (`sft.py`)
        train, valid = si.split_documents(len(lengths), seed, valid_fraction)
        self.samples = si.shuffle_documents(train if split == "train" else valid, seed, split)
        longest = int(lengths[self.samples].max()) if len(self.samples) else 0
        if longest > seq_len + 1:
            k = int(self.samples[int(np.argmax(lengths[self.samples]))])
            raise DataError(f"{indexed.idx_path}: sample {k} has {longest} tokens, more than model.seq_len + 1 = "
                            f"{seq_len + 1}; make the data with --seq-len {seq_len}")
        if len(self.samples) == 0:
            why = (f" (valid_fraction {valid_fraction} holds out {len(valid)} of its {len(lengths)})"
                   if split == "train" and valid_fraction else "")
            raise DataError(f"{indexed.idx_path}: the {split} split has no samples{why}")
        # a cut sample fills a row alone: nothing may follow it before an EOD ends its document
        packed = np.where(cut, seq_len + 1, lengths)
        order, self.bounds = pack_best_fit(packed[self.samples], seq_len + 1)
        self.samples = self.samples[order]
        self.padding = len(self) * (seq_len + 1) - int(lengths[self.samples].sum())
        self._order_memo: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            raise IndexError(f"sample position must be >= 0, got {i}")
        epoch, j = divmod(int(i), len(self))
        memo = self._order_memo       # one shuffle per epoch, not one per row read (O(rows) each)
        if memo is None or memo[0] != epoch:
            memo = self._order_memo = (epoch, si.sample_order(len(self), self.seed, self.split, epoch))
        return self.row(int(memo[1][j]))

    def row(self, r: int) -> np.ndarray:
        """int32 [s + 1]: row r's samples, prompts marked `NO_LOSS`, then padding (EOD, `NO_LOSS`)."""
        out = np.full(self.seq_len + 1, self.eod | NO_LOSS, np.int32)
        at = 0
        for k in self.samples[self.bounds[r]:self.bounds[r + 1]].tolist():
            prompt, response = self.indexed.doc(2 * k), self.indexed.doc(2 * k + 1)
            out[at:at + len(prompt)] = prompt.astype(np.int32) | NO_LOSS
            at += len(prompt)
            out[at:at + len(response)] = response
            at += len(response)
        return out

    def save_cache(self) -> None:
        """Nothing to cache: the packing is computed in one pass at start-up."""

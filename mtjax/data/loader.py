"""Global batches from a dataset, addressed by a single integer position.

The data position (samples consumed so far) is the loader's only state. A
trainer saves it with its checkpoint and passes it back on resume, so the
resumed run reads exactly the samples the uninterrupted run would have.

With several processes each one may read only its rows of every global batch
(`rows`, from Trainer.local_rows); the position still counts global samples, so
it means the same on every process and in a checkpoint.
"""

from __future__ import annotations

import numpy as np


class BatchLoader:
    """`next_batch()` returns samples [position, position + global_batch) and advances.

    `rows` (sorted row indices into the global batch) restricts every batch to
    those rows: sample `position + r` for each r. None reads all rows.
    """

    def __init__(self, dataset, global_batch: int, position: int = 0, rows=None):
        if global_batch < 1 or position < 0:
            raise ValueError(f"need global_batch >= 1 and position >= 0, got {global_batch}, {position}")
        self.dataset = dataset
        self.global_batch = global_batch
        self.position = position
        self.rows = range(global_batch) if rows is None else [int(r) for r in rows]
        if any(not 0 <= r < global_batch for r in self.rows):
            raise ValueError(f"rows must lie in [0, {global_batch})")

    def batch_at(self, position: int) -> np.ndarray:
        """int32 [len(rows), seq_len + 1]: the batch starting at `position`; no state change."""
        return np.stack([self.dataset[position + r] for r in self.rows])

    def next_batch(self) -> np.ndarray:
        """The batch at `position`; then `position += global_batch` (all processes' rows)."""
        batch = self.batch_at(self.position)
        self.position += self.global_batch
        return batch


def host_slice(batch: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """Rows of a global batch this process feeds: contiguous block `process_index` of `process_count`."""
    rows = batch.shape[0]
    if rows % process_count:
        raise ValueError(f"global batch of {rows} rows does not split over {process_count} processes")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} outside [0, {process_count})")
    per = rows // process_count
    return batch[process_index * per:(process_index + 1) * per]

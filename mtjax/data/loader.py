"""Global batches from a dataset, addressed by a single integer position.

The data position (samples consumed so far) is the loader's only state. A
trainer saves it with its checkpoint and passes it back on resume, so the
resumed run reads exactly the samples the uninterrupted run would have.
"""

from __future__ import annotations

import numpy as np


class BatchLoader:
    """`next_batch()` returns samples [position, position + global_batch) and advances."""

    def __init__(self, dataset, global_batch: int, position: int = 0):
        if global_batch < 1 or position < 0:
            raise ValueError(f"need global_batch >= 1 and position >= 0, got {global_batch}, {position}")
        self.dataset = dataset
        self.global_batch = global_batch
        self.position = position

    def batch_at(self, position: int) -> np.ndarray:
        """int32 [global_batch, seq_len + 1]: the batch starting at `position`; no state change."""
        return np.stack([self.dataset[position + k] for k in range(self.global_batch)])

    def next_batch(self) -> np.ndarray:
        """The batch at `position`; then `position += global_batch`."""
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

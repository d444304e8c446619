"""Sequence halves under sequence parallelism (`parallel.half_batch_axis=sequence`, `block.halved`):
the order of the residual stream's rows, so that each half gathers in position order.

Shape legend: b micro-batch, s sequence, t tensor size, n = s/2t a rank's rows of one half.
"""
from __future__ import annotations

import numpy as np


def stream_order(s: int, t: int) -> np.ndarray:
    """Sequence halves under sequence parallelism: the position at each of the stream's s rows
    [s] (the embedding takes the tokens in this order). Rank r's s/t rows are its n = s/2t rows of
    each half, [r n, (r + 1) n) then s/2 + [r n, (r + 1) n), so that each half's all-gather over
    `tensor` brings its positions in order: [0, s/2) for the first half, [s/2, s) for the second."""
    return np.arange(s).reshape(2, t, s // (2 * t)).transpose(1, 0, 2).reshape(s)


def in_position_order(x, t: int):
    """x [b, s, ...] in `stream_order` (the stream gathered over `tensor`) -> in position order."""
    b, s = x.shape[:2]
    return x.reshape(b, t, 2, s // (2 * t), *x.shape[2:]).swapaxes(1, 2).reshape(x.shape)

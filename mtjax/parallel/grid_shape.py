"""The arithmetic of the tensor grid's shape, apart from JAX: which grids there are and the side q
of a grid of t devices (t = q^2 depth). Validation (`mtjax.config.validate`) asks it before any
device exists; `grid.py` builds the grid from it."""
from __future__ import annotations

import math

GRIDS = ("1d", "2d", "2.5d")


def grid_side(tensor: int, depth: int) -> int | None:
    """q with q^2 depth = tensor, or None when there is none."""
    if depth < 1 or tensor % depth:
        return None
    q = math.isqrt(tensor // depth)
    return q if q * q * depth == tensor else None

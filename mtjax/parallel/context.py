"""What a layer needs to know about the mesh it runs on: static sizes only."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mtjax.parallel.grid import Grid


@dataclass(frozen=True)
class ParallelContext:
    """Static parallel layout seen by the model code.

    `tensor` is t, the number of shards of every tensor-parallel weight. At
    initialisation (global shapes) and on one device t = 1, and every
    operator in tensor_ops is the identity. Inside `shard_map` over a mesh
    with tensor size t, modules declare local shapes (heads/t, f/t, V/t).
    `sp` says sequence parallelism is active: the step plan resolves it once (asked for and
    t > 1), and no module re-derives it. `context` is c: with c > 1 each device holds s/c of
    every row (`parallel/context_ops.py`), and attention crosses the `context` axis by
    `context_attention` (all_gather | ring, `model/context_attention.py`). `tensor_overlap` (only
    with sp): the sequence-parallel all-gathers and reduce-scatters run as ring steps inside the
    column and row layers' matmuls (`parallel/collective_matmul.py`).
    """

    tensor: int = 1
    sp: bool = False
    context: int = 1
    context_attention: str = "all_gather"
    ring_by_all_to_all: bool = False   # ring steps (ring attention, collective matmuls) as all-to-alls (`ring.py`)
    grid: Grid | None = None     # 2d / 2.5d: the tensor axis as a q x q (x d) grid (`parallel/grid.py`)
    tensor_overlap: bool = False
    half_batches: bool = False   # each layer's micro-batch as two interleaved halves (`parallel/half_batches.py`)
    half_batch_group: int = 1    # consecutive layers interleaved as one unit (`block.halved`; config default 4)
    half_batch_axis: str = "batch"   # the halves: of the micro-batch's rows, or of its sequence (`block.halved`)
    # mixture of experts (`parallel/expert_dispatch.py`): e expert ranks in groups of consecutive
    # replicas along `expert_axes` (data, and context when c > 1), `replicas` = d c of them
    expert: int = 1
    expert_axes: tuple = ("data",)
    replicas: int = 1
    experts_split: bool = False  # e = d c: the expert weights arrive as this rank's E/e (else whole)
    batch_rows: int = 0          # B, the global batch the auxiliary losses average over; 0: none (no training)

    @property
    def sequence_halves(self) -> bool:
        """The layers run the halves of the sequence (`block.halved`), not of the batch."""
        return self.half_batches and self.half_batch_axis == "sequence"

    @property
    def joins_columns(self) -> bool:
        """The column layers sharing an input run one sequence-parallel gathered matmul over their
        columns side by side (`parallel/async_linear.py`; not the ring of `tensor_overlap`, not a
        grid's blocks), so their kernels can come joined (`model/joined_columns.py`)."""
        return self.sp and self.tensor > 1 and not self.tensor_overlap and self.grid is None

    def half_batch_unit(self, layers: int) -> int:
        """The layers one half-batch unit runs in a run of `layers` (`block.halved`): gcd(g, layers);
        0 without half batches."""
        return math.gcd(self.half_batch_group, layers) if self.half_batches else 0

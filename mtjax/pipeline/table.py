"""The pipeline table (`Schedule`) and what is read off it: per-kind costs, lockstep time, stashes.

Notation and the rules a table obeys are in `mtjax.pipeline.schedules`, which builds tables;
this module only holds and reads them. p stages, m micro-batches, v chunks per stage; F, B, W
are a chunk's forward, input-gradient backward and weight-gradient work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

NONE = -1
MAX_COST_UNITS = 2 ** 32   # per kind; times a table's ticks (< 2^22 at the CLI's limits) and 3 kinds, within int64

Op = tuple[int, int]  # (micro_batch, chunk)
Costs = tuple[Fraction, Fraction, Fraction]  # (F, B, W) of one chunk


def parse_costs(costs) -> Costs:
    """(F, B) or (F, B, W) numbers or strings ('0.5', '3/4') -> exact (F, B, W); (F, B) means W = 0,
    i.e. B is the whole backward. F and B must be > 0, W >= 0."""
    if len(costs) not in (2, 3):
        raise ValueError(f"costs are F,B or F,B,W; got {len(costs)} values")
    try:
        f, b, w = (*(Fraction(str(c).strip()) for c in costs), Fraction(0))[:3]
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"costs must be numbers, got {','.join(map(str, costs))}") from None
    if f <= 0 or b <= 0 or w < 0:
        raise ValueError(f"costs need F > 0, B > 0 and W >= 0, got {','.join(map(str, costs))}")
    scale = math.lcm(f.denominator, b.denominator, w.denominator)
    if max(f, b, w) * scale > MAX_COST_UNITS:   # tables sum them in int64: keep every sum exact
        raise ValueError(f"costs are too large or too finely divided to add up exactly (F, B and W in units of "
                         f"their common denominator at most 2^32), got {','.join(map(str, costs))}")
    return f, b, w


def default_costs(split: bool) -> Costs:
    """(1, 1, 1) for split schedules; (1, 2, 0) otherwise: forward 1, whole backward 2."""
    return parse_costs((1, 1, 1) if split else (1, 2))


@dataclass(frozen=True, eq=False)
class Schedule:
    """A pipeline schedule: int32 tables [ticks, p], NONE (-1) where a slot is empty.

    `forward_mb`/`forward_chunk` say which (micro-batch, local chunk 0..v-1) a stage's
    forward slot runs at each tick; `backward_mb`/`backward_chunk` the same for the
    backward slot; `weight_mb`/`weight_chunk` for the weight slot, all NONE unless the
    schedule is split (then the backward slot computes only the input gradient, B).
    A forward-only schedule (evaluation) has no backwards.
    """
    name: str
    stages: int           # p
    micro_batches: int    # m
    chunks: int           # v: model chunks per stage, 1 unless interleaved (2 for zbv)
    forward_mb: np.ndarray
    forward_chunk: np.ndarray
    backward_mb: np.ndarray
    backward_chunk: np.ndarray
    weight_mb: np.ndarray | None = None      # None: no weight slot (filled with NONE)
    weight_chunk: np.ndarray | None = None
    layout: str = "loop"  # "loop": chunk c of stage i is virtual stage c p + i; "v": i and 2p - 1 - i
    max_in_flight_cap: int = 0               # the cap the table was built under; 0 = none

    def __post_init__(self):
        if self.weight_mb is None:
            empty = np.full(self.forward_mb.shape, NONE, np.int32)
            empty.flags.writeable = False
            object.__setattr__(self, "weight_mb", empty)
            object.__setattr__(self, "weight_chunk", empty)

    @property
    def ticks(self) -> int:
        return self.forward_mb.shape[0]

    @property
    def has_backward(self) -> bool:
        return bool((self.backward_mb != NONE).any())

    @property
    def split(self) -> bool:
        """Whether the backward is split into B (backward slot) and W (weight slot)."""
        return bool((self.weight_mb != NONE).any())

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """j of local chunk `chunk` on `stage`: c p + i (loop), or i / 2p - 1 - i (v)."""
        return virtual_stage(self.layout, self.stages, stage, chunk)

    def stage_cost(self, recompute: bool = False, costs=None) -> np.ndarray:
        """[ticks, p] what each stage computes per tick: F per forward, B (+ W unsplit, + F recomputing)
        per backward, W per weight gradient; costs default to `default_costs` (1 and 2 unsplit)."""
        units, scale = self._cost_units(recompute, costs)
        return units if scale == 1 else units / scale

    def _cost_units(self, recompute: bool, costs) -> tuple[np.ndarray, int]:
        """`stage_cost` as exact integers in units of 1/scale."""
        f, b, w = parse_costs(costs) if costs is not None else default_costs(self.split)
        backward = b + (0 if self.split else w) + (f if recompute else 0)
        scale = math.lcm(f.denominator, backward.denominator, w.denominator)
        f, backward, w = (int(x * scale) for x in (f, backward, w))
        cost = f * (self.forward_mb != NONE) + backward * (self.backward_mb != NONE) + w * (self.weight_mb != NONE)
        return cost.astype(np.int64), scale

    def time_over_ideal(self, recompute: bool = False, costs=None) -> Fraction:
        """Lockstep time (sum over ticks of the slowest stage's cost) over one stage's busy time."""
        cost, _ = self._cost_units(recompute, costs)
        return Fraction(int(cost.max(axis=1).sum()), int(cost.sum(axis=0).max()))

    @property
    def bubble_fraction(self) -> Fraction:
        """Waiting time over compute time in the cost model: time_over_ideal - 1, i.e. (p-1)/m,
        or (p-1)/(v m) interleaved, when the table meets Megatron's bubble."""
        return self.time_over_ideal() - 1

    def max_in_flight(self) -> np.ndarray:
        """[p] per stage, the most (micro-batch, chunk) pairs whose forward has run and whose
        backward has not yet finished, counted within a tick after its forward slot: the stashes
        a stage must hold at once: min(m, 2(p - i) - 1) for 1F1B on stage i, m for GPipe,
        min(v m, (v + 1) p - 2i - 1) interleaved."""
        if not self.has_backward:
            return np.ones(self.stages, np.int64)
        return _most_pending(self.forward_mb, self.backward_mb)

    def slots_held(self) -> np.ndarray:
        """[p] per stage, the most pairs whose forward has run and whose backward has not finished:
        `max_in_flight` unsplit; split, until W has run, since B leaves W's (X, dY) in the slot its
        residuals held (`buffers.plan_buffers(shared_stash=True)`). What a cap N bounds (N v)."""
        if not self.split:
            return self.max_in_flight()
        return _most_pending(self.forward_mb, self.weight_mb)

    def w_pending(self) -> np.ndarray:
        """[p] per stage, the most pairs whose B has run (this tick or earlier) and whose W has not
        finished: what W still needs, each matmul's input and output gradient (zeros unsplit)."""
        if not self.split:
            return np.zeros(self.stages, np.int64)
        return _most_pending(self.backward_mb, self.weight_mb)

    def timeline(self) -> list[dict]:
        """One row per (tick, stage), empty slots included, for plots and tables."""
        return [{"tick": t, "stage": i,
                 "forward": _op_or_none(self.forward_mb[t, i], self.forward_chunk[t, i]),
                 "backward": _op_or_none(self.backward_mb[t, i], self.backward_chunk[t, i]),
                 "weight": _op_or_none(self.weight_mb[t, i], self.weight_chunk[t, i])}
                for t in range(self.ticks) for i in range(self.stages)]

    def cost_model(self, recompute: bool = False, costs=None) -> dict:
        """The figures `python -m mtjax.pipeline show` prints, computed from the table."""
        ratio = self.time_over_ideal(recompute, costs)
        return {"schedule": self.name, "stages": self.stages, "micro_batches": self.micro_batches,
                "virtual_stages": self.chunks, "ticks": self.ticks,
                "bubble_fraction": float(ratio - 1), "time_over_ideal": float(ratio),
                "max_in_flight": [int(n) for n in self.max_in_flight()]}


def virtual_stage(layout: str, p: int, stage: int, chunk: int) -> int:
    """Loop: c p + i (Megatron's interleaving). V: stage i holds i (chunk 0) and 2p - 1 - i (chunk 1)."""
    if layout == "v":
        return stage if chunk == 0 else 2 * p - 1 - stage
    return chunk * p + stage


def stage_and_chunk(layout: str, p: int, j: int) -> tuple[int, int]:
    """The (stage, local chunk) holding virtual stage j: the inverse of `virtual_stage`."""
    if layout == "v":
        return (j, 0) if j < p else (2 * p - 1 - j, 1)
    return j % p, j // p


def _most_pending(start_mb: np.ndarray, end_mb: np.ndarray) -> np.ndarray:
    """[p] max over ticks t of #(start <= t) - #(end < t): items started and not yet ended at t."""
    started = np.cumsum(start_mb != NONE, axis=0)
    ended = np.cumsum(end_mb != NONE, axis=0) - (end_mb != NONE)
    return (started - ended).max(axis=0, initial=0)


def _op_or_none(mb, chunk) -> dict | None:
    return None if mb == NONE else {"micro_batch": int(mb), "chunk": int(chunk)}

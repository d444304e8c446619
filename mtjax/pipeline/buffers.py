"""Where a stage keeps what it received: arrival and slot tables derived from a schedule (numpy).

Notation: p stages, v chunks per stage, virtual stage j = c p + i for chunk c of
stage i; virtual stage j + 1 lives on stage (i + 1) mod p.

The activation that stage i - 1 sends at tick T (its forward of micro-batch mb,
virtual stage j - 1) lands on stage i at tick T + 1, for its chunk holding j,
and stays until stage i's backward of (mb, j) has used it (the backward
recomputes the chunk from this input). Gradients flow the other way and stay
until the backward that consumes them. Slot (c, mb mod S): S is the smallest
number for which no two micro-batches sharing a slot are held at the same time.
For 1F1B this comes out about p (the stash is bounded by the schedule, not by
m); for GPipe it is m.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtjax.pipeline.schedules import BACKWARD, FORWARD, Schedule


@dataclass(frozen=True)
class BufferPlan:
    fwd_mb: np.ndarray       # [ticks, p] micro-batch whose activation arrives now, or -1
    fwd_chunk: np.ndarray    # [ticks, p] the receiving chunk
    bwd_mb: np.ndarray       # [ticks, p] micro-batch whose gradient arrives now, or -1
    bwd_chunk: np.ndarray    # [ticks, p]
    fwd_slots: int           # S_f activation slots per chunk
    bwd_slots: int           # S_b gradient slots per chunk


def _arrivals(s: Schedule, action: int) -> tuple[np.ndarray, np.ndarray]:
    """(mb, chunk) arriving at each (tick, stage) from a neighbour's `action` one tick before."""
    p, v = s.stages, s.chunks
    step = 1 if action == FORWARD else -1           # activations go up, gradients down
    mbs, chunks = np.full_like(s.micro_batch, -1), np.full_like(s.chunk, -1)
    for i in range(p):
        src = (i - step) % p
        for t in range(1, s.ticks):
            if s.action[t - 1, src] != action:
                continue
            j = int(s.chunk[t - 1, src]) * p + src + step      # receiving virtual stage
            if 0 <= j < p * v:
                assert j % p == i
                mbs[t, i], chunks[t, i] = s.micro_batch[t - 1, src], j // p
    return mbs, chunks


def _spans(s: Schedule, mbs, chunks, stage: int) -> list[tuple[int, int, int, int]]:
    """(chunk, mb, first tick held, last tick held) on `stage`."""
    out = []
    for t in np.nonzero(mbs[:, stage] >= 0)[0]:
        mb, c = int(mbs[t, stage]), int(chunks[t, stage])
        done = np.nonzero((s.action[:, stage] == BACKWARD) & (s.micro_batch[:, stage] == mb)
                          & (s.chunk[:, stage] == c))[0]
        out.append((c, mb, int(t), int(done[0])))
    return out


def _clash(spans, slots: int) -> bool:
    for a, (c_a, mb_a, start_a, end_a) in enumerate(spans):
        for c_b, mb_b, start_b, end_b in spans[a + 1:]:
            if c_a == c_b and mb_a % slots == mb_b % slots and start_a <= end_b and start_b <= end_a:
                return True
    return False


def _fewest_slots(s: Schedule, mbs, chunks) -> int:
    spans = [_spans(s, mbs, chunks, i) for i in range(s.stages)]
    for slots in range(1, s.micro_batches + 1):
        if not any(_clash(stage_spans, slots) for stage_spans in spans):
            return slots
    raise AssertionError("m slots per chunk never clash")


def plan_buffers(s: Schedule) -> BufferPlan:
    fwd, bwd = _arrivals(s, FORWARD), _arrivals(s, BACKWARD)
    return BufferPlan(*fwd, *bwd, _fewest_slots(s, *fwd), _fewest_slots(s, *bwd))

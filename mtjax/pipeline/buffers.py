"""Where a stage keeps what it received: slot tables derived from a schedule (numpy, v = 1).

Activations sent at tick T by stage i - 1 (its forward of micro-batch mb) land
on stage i at tick T + 1 and stay until stage i's backward of mb has used
them (the backward recomputes the stage from this input). Gradients sent by
stage i + 1 land at T + 1 and stay until stage i's backward of mb. A slot is
mb mod S; S is the smallest number for which no two micro-batches that share
a slot are held at the same time on any stage. For 1F1B this is about p (the
stash is bounded by the schedule, not by m); for GPipe it is m.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtjax.pipeline.schedules import BACKWARD, FORWARD, Schedule


@dataclass(frozen=True)
class BufferPlan:
    fwd_arrival: np.ndarray    # [ticks, p] micro-batch whose activation arrives now, or -1
    bwd_arrival: np.ndarray    # [ticks, p] micro-batch whose gradient arrives now, or -1
    fwd_slots: int             # S_f: activation slots per stage
    bwd_slots: int             # S_b: gradient slots per stage


def _arrivals(s: Schedule, action: int, shift: int) -> np.ndarray:
    """arrival[T, i] = mb if stage i - shift ran `action` on mb at tick T - 1."""
    out = np.full_like(s.micro_batch, -1)
    p = s.stages
    for i in range(p):
        src = i - shift
        if 0 <= src < p:
            sent = s.action[:-1, src] == action
            out[1:, i] = np.where(sent, s.micro_batch[:-1, src], -1)
    return out


def _intervals(s: Schedule, arrival: np.ndarray, stage: int) -> list[tuple[int, int, int]]:
    """(mb, first tick held, last tick held) on `stage`."""
    spans = []
    for tick in np.nonzero(arrival[:, stage] >= 0)[0]:
        mb = int(arrival[tick, stage])
        done = np.nonzero((s.action[:, stage] == BACKWARD) & (s.micro_batch[:, stage] == mb))[0]
        spans.append((mb, int(tick), int(done[0])))
    return spans


def _fewest_slots(s: Schedule, arrival: np.ndarray) -> int:
    spans = [_intervals(s, arrival, i) for i in range(s.stages)]
    for slots in range(1, s.micro_batches + 1):
        if all(not _clash(stage_spans, slots) for stage_spans in spans):
            return slots
    raise AssertionError("unreachable: m slots never clash")


def _clash(spans, slots: int) -> bool:
    for a, (mb_a, start_a, end_a) in enumerate(spans):
        for mb_b, start_b, end_b in spans[a + 1:]:
            if mb_a % slots == mb_b % slots and start_a <= end_b and start_b <= end_a:
                return True
    return False


def plan_buffers(s: Schedule) -> BufferPlan:
    if s.chunks != 1:
        raise NotImplementedError("the executor runs one model chunk per stage")
    fwd, bwd = _arrivals(s, FORWARD, 1), _arrivals(s, BACKWARD, -1)
    return BufferPlan(fwd, bwd, _fewest_slots(s, fwd), _fewest_slots(s, bwd))

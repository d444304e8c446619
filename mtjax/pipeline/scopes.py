"""The named scopes of a schedule's work, for reading the compiled step (`mtjax.inspect`).

The executor runs each tick's forward, backward, head and (split) weight gradients under their
own `jax.named_scope`s (`tick.py`); the compiled program holds every branch once, so what a pipe
rank executes is read from the schedule's table: in which ticks the rank takes each scope's
branch. `scope_weights` gives the shares (for counting FLOPs, bytes and kernel time per rank),
`loop_scope_table` the ticks themselves (for the lockstep time: a tick lasts as long as its
slowest rank's work, `hlo_report.gpu_report`).
"""
from __future__ import annotations

import numpy as np

from mtjax.pipeline.chunk import EMBED_SCOPE
from mtjax.pipeline.schedules import NONE, Schedule
from mtjax.pipeline.table import stage_and_chunk
from mtjax.pipeline.tick import BACKWARD_SCOPE, FINAL_SCOPE, FORWARD_SCOPE, HEAD_SCOPE, WEIGHT_SCOPE


def scope_table(schedule: Schedule, ticks: int | None = None) -> list[dict[str, np.ndarray]]:
    """Per stage, {scope: bool [n]}: which of the first n = `ticks` ticks (default: all) run each
    scope's work: forwards, backwards (B when split), the head (the backwards of the last
    virtual stage) and, split, the weight gradients (W)."""
    p, v, n = schedule.stages, schedule.chunks, schedule.ticks if ticks is None else ticks
    has_f, has_b = schedule.forward_mb[:n] != NONE, schedule.backward_mb[:n] != NONE
    has_w = schedule.weight_mb[:n] != NONE
    last_rank, last_chunk = stage_and_chunk(schedule.layout, p, p * v - 1)
    head = has_b & (schedule.backward_chunk[:n] == last_chunk)
    return [{FORWARD_SCOPE: has_f[:, i], BACKWARD_SCOPE: has_b[:, i],
             HEAD_SCOPE: head[:, i] if i == last_rank else np.zeros(n, bool), WEIGHT_SCOPE: has_w[:, i]}
            for i in range(p)]


def scope_ticks(schedule: Schedule, ticks: int | None = None) -> list[dict[str, int]]:
    """Per stage, how many of the first `ticks` ticks (default: all) run each scope's work
    (`scope_table`'s counts)."""
    return [{scope: int(a.sum()) for scope, a in table.items()} for table in scope_table(schedule, ticks)]


def loop_scope_table(schedule: Schedule, reduce_last: bool = False) -> list[dict[str, np.ndarray]]:
    """Per stage, {named scope of the tick loop's work: bool [the loop's ticks]}: `scope_table`
    over the ticks the loop runs (all, or all but the last when that one runs after it:
    `reduce_last`, as `pipeline_grads` with a sink where `last_backward_reduces`), with the
    embedding's work (EMBED_SCOPE, within a forward or backward), which runs where stage 0 works
    on chunk 0."""
    loop = schedule.ticks - 1 if reduce_last else schedule.ticks
    first = {FORWARD_SCOPE: schedule.forward_chunk[:loop, 0], BACKWARD_SCOPE: schedule.backward_chunk[:loop, 0]}
    out = []
    for i, table in enumerate(scope_table(schedule, loop)):
        for scope, chunk in first.items():
            table[f"{scope}/{EMBED_SCOPE}"] = chunk == 0 if i == 0 else np.zeros(loop, bool)
        out.append(table)
    return out


def scope_weights(schedule: Schedule, reduce_last: bool = False) -> list[dict[str, float]]:
    """Per stage, {named scope: the share of the tick loop's iterations that run its work}
    (`loop_scope_table`'s means); with `reduce_last`, every stage then runs the last tick once,
    under FINAL_SCOPE (weight 1), and stage 0 the embedding's backward in it."""
    out = []
    for i, table in enumerate(loop_scope_table(schedule, reduce_last)):
        weights = {scope: float(a.mean()) for scope, a in table.items()}
        if reduce_last:
            weights |= {FINAL_SCOPE: 1.0, f"{FINAL_SCOPE}/{EMBED_SCOPE}": float(i == 0)}
        out.append(weights)
    return out

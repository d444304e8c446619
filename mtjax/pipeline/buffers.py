"""Where a stage keeps what it holds between ticks: slot tables derived from a schedule (numpy).

Notation: p stages, v chunks per stage, virtual stage j = c p + i for chunk c of
stage i; virtual stage j + 1 lives on stage (i + 1) mod p. In zbv's V layout stage i holds
virtual stages i and 2p - 1 - i, so a value may come from stage i - 1, from i + 1, or (the turn
of the V on stage p - 1) from the stage itself (`channel`).

A stage holds five kinds of value (six when the schedule is split), each in a ring of slots
shared by all its chunks:
  activations  from the tick after the previous virtual stage's forward sent it
               until this stage's forward of (mb, j) reads it;
  gradients    from the tick after the next virtual stage's backward sent it until
               this stage's backward of (mb, j) reads it;
  stash        what the forward of (mb, j) keeps for its backward (the residuals
               that `train.recompute` leaves), from the forward to the backward;
  head input   on the last virtual stage only, the chunk's output, from its forward
               to the backward that runs the head and the loss on it;
  prefix       on virtual stage 0 only, what the embedding and a dense prefix
               (`Transformer.embed_and_prefix`) keep for their backward, from the forward to
               the backward (B) of (mb, 0): a ring sized for stage 0's chunk 0 alone, so that
               the stash's slots (every stage's, every chunk's) do not widen by it;
  W stash      split schedules: what B of (mb, j) leaves for W (each matmul's X and dY),
               from B to W.
The stash proper holds what waits for B, the W stash what waits for W. With `shared_stash` the two
share one set of slots: B reads its slot and leaves W's (X, dY) in it, so a slot is held from F to W
(`Schedule.slots_held`: at most N v under a cap N), each the larger of the two kinds, instead of
one ring sized for the most any stage waits for B plus one for W.
Within a tick the executor files arrivals, then runs the forward slot, then the
backward slot, then the weight slot; a slot is reused only from the tick after its last read. Slots are
given out greedily in order of first use (interval colouring), which needs exactly
as many slots as values held at once; every stage gets the same ring sizes (SPMD).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtjax.pipeline.schedules import NONE, Schedule
from mtjax.pipeline.table import stage_and_chunk


@dataclass(frozen=True)
class TickTables:
    """What the executor does at each (tick, stage), as int32 arrays [ticks, p] (NONE = nothing)."""
    act_in_prev: np.ndarray   # slot to file the activation that arrives now from stage i - 1 (`channel`),
    act_in_next: np.ndarray   #   from stage i + 1 (V layout),
    act_in_self: np.ndarray   #   from this stage's own last forward (V layout, stage p - 1)
    grad_in_prev: np.ndarray  # the same for the gradient that arrives now (V layout),
    grad_in_next: np.ndarray  #   from stage i + 1,
    grad_in_self: np.ndarray  #   from this stage's own last backward (V layout, stage p - 1)
    fwd_mb: np.ndarray        # forward slot: micro-batch,
    fwd_chunk: np.ndarray     #   local chunk,
    fwd_act: np.ndarray       #   activation slot it reads (NONE on virtual stage 0: it embeds),
    fwd_stash: np.ndarray     #   stash slot it writes,
    fwd_head: np.ndarray      #   head-input slot it writes (last virtual stage only),
    fwd_prefix: np.ndarray    #   prefix-stash slot it writes (virtual stage 0 only)
    bwd_mb: np.ndarray        # backward slot: micro-batch,
    bwd_chunk: np.ndarray     #   local chunk,
    bwd_grad: np.ndarray      #   gradient slot it reads (NONE on the last virtual stage: the head's),
    bwd_stash: np.ndarray     #   stash slot it reads,
    bwd_head: np.ndarray      #   head-input slot it reads (last virtual stage only),
    bwd_prefix: np.ndarray    #   prefix-stash slot it reads (virtual stage 0 only),
    bwd_wstash: np.ndarray    #   W-stash slot it writes (split schedules)
    w_mb: np.ndarray          # weight slot (split schedules): micro-batch,
    w_chunk: np.ndarray       #   local chunk,
    w_wstash: np.ndarray      #   W-stash slot it reads


@dataclass(frozen=True)
class BufferPlan:
    tables: TickTables
    act_slots: int
    grad_slots: int
    stash_slots: int
    head_slots: int
    w_stash_slots: int        # 1 (unused) unless the schedule is split; stash_slots when shared
    shared_stash: bool = False  # B's residuals and W's (X, dY) take turns in one ring (split only)
    prefix_slots: int = 1     # virtual stage 0's embedding and dense prefix (`TickTables.fwd_prefix`)


def _tick_of(s: Schedule, mbs: np.ndarray, chunks: np.ndarray, stage: int) -> dict:
    """{(mb, chunk): tick} of one slot kind's operations on `stage`."""
    return {(int(mbs[t, stage]), int(chunks[t, stage])): t for t in np.nonzero(mbs[:, stage] != NONE)[0]}


def _colour(intervals: list[tuple[int, int, tuple]]) -> tuple[dict, int]:
    """Slots for [start, end] intervals (inclusive ticks): {key: slot}, and how many slots."""
    free_from: list[int] = []           # per slot, the first tick it may be written again
    slot_of = {}
    for start, end, key in sorted(intervals):
        slot = next((k for k, t in enumerate(free_from) if t <= start), len(free_from))
        if slot == len(free_from):
            free_from.append(0)
        free_from[slot] = end + 1
        slot_of[key] = slot
    return slot_of, len(free_from)


def channel(layout: str, receiver: int, sender: int, step: int) -> str:
    """How a value sent towards virtual stage j + step (+1 activations, -1 gradients) from stage
    `sender` reaches stage `receiver`: "prev" (from stage i - 1), "next" (from i + 1) or "self" (a
    V's turn on stage p - 1). In the loop layout activations always come from the previous stage
    and gradients from the next, cyclically (at p = 2 both are the other stage)."""
    if layout == "loop":
        return "prev" if step > 0 else "next"
    if sender == receiver:
        return "self"
    return "prev" if sender == receiver - 1 else "next"


def plan_buffers(s: Schedule, shared_stash: bool = False) -> BufferPlan:
    """The slot tables of `s`; `shared_stash` (split schedules) gives the stash and the W stash one ring."""
    shared_stash = shared_stash and s.split
    p, last = s.stages, s.stages * s.chunks - 1
    shape = s.forward_mb.shape
    tab = {name: np.full(shape, NONE, np.int32) for name in TickTables.__dataclass_fields__}
    tab.update(fwd_mb=s.forward_mb.copy(), fwd_chunk=s.forward_chunk.copy(),
               bwd_mb=s.backward_mb.copy(), bwd_chunk=s.backward_chunk.copy(),
               w_mb=s.weight_mb.copy(), w_chunk=s.weight_chunk.copy())
    sizes = {"act": 1, "grad": 1, "stash": 1, "head": 1, "wstash": 1, "prefix": 1}
    forwards = [_tick_of(s, s.forward_mb, s.forward_chunk, i) for i in range(p)]
    backwards = [_tick_of(s, s.backward_mb, s.backward_chunk, i) for i in range(p)]
    for i in range(p):
        fwd, bwd = forwards[i], backwards[i]
        weights = _tick_of(s, s.weight_mb, s.weight_chunk, i)
        held = {"act": [], "grad": [], "stash": [], "head": [], "prefix": [],
                "wstash": [] if shared_stash else [(bwd[op], w, op) for op, w in weights.items()]}
        for (mb, c), t in fwd.items():
            j = s.virtual_stage(i, c)
            if j > 0:   # the activation of virtual stage j - 1, from the tick after it ran
                sender, sc = stage_and_chunk(s.layout, p, j - 1)
                held["act"].append((forwards[sender][mb, sc] + 1, t, (mb, c), channel(s.layout, i, sender, +1)))
            if (mb, c) in bwd:
                held["stash"].append((t, weights[mb, c] if shared_stash else bwd[mb, c], (mb, c), None))
                if j == last:
                    held["head"].append((t, bwd[mb, c], (mb, c), None))
                if j == 0:
                    held["prefix"].append((t, bwd[mb, c], (mb, c), None))
        for (mb, c), t in bwd.items():
            j = s.virtual_stage(i, c)
            if j < last:   # the gradient from virtual stage j + 1, from the tick after its backward
                sender, sc = stage_and_chunk(s.layout, p, j + 1)
                held["grad"].append((backwards[sender][mb, sc] + 1, t, (mb, c), channel(s.layout, i, sender, -1)))
        held["wstash"] = [(*interval, None) for interval in held["wstash"]]
        for kind, intervals in held.items():
            slots, n = _colour([(start, end, key) for start, end, key, _ in intervals])
            sizes[kind] = max(sizes[kind], n)
            for start, end, key, via in intervals:
                k = slots[key]
                if kind == "act":
                    tab[f"act_in_{via}"][start, i], tab["fwd_act"][end, i] = k, k
                elif kind == "grad":
                    tab[f"grad_in_{via}"][start, i], tab["bwd_grad"][end, i] = k, k
                elif kind == "wstash":
                    tab["bwd_wstash"][start, i], tab["w_wstash"][end, i] = k, k
                elif kind == "stash" and shared_stash:   # F writes, B reads and writes W's, W reads
                    tab["fwd_stash"][start, i], tab["w_wstash"][end, i] = k, k
                    tab["bwd_stash"][bwd[key], i] = tab["bwd_wstash"][bwd[key], i] = k
                else:
                    tab[f"fwd_{kind}"][start, i], tab[f"bwd_{kind}"][end, i] = k, k
    for a in tab.values():
        a.flags.writeable = False
    return BufferPlan(TickTables(**tab), sizes["act"], sizes["grad"], sizes["stash"], sizes["head"],
                      sizes["stash"] if shared_stash else sizes["wstash"], shared_stash, sizes["prefix"])

"""The lockstep simulator every schedule builder shares: each stage's forward and backward slots
filled tick by tick from its orders, each operation as soon as its dependency allows, under an
optional memory cap; and `fastest`, which keeps the quickest of several candidate tables.

The rules a table obeys (notation, dependencies, the cap) are in `mtjax.pipeline.schedules`;
`whole_backward` (gpipe, 1f1b, interleaved) and `zero_bubble` (zb, zbv) build on this module.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq

import numpy as np

from mtjax.pipeline.table import NONE, Op, Schedule, stage_and_chunk, virtual_stage


def check_sizes(p: int, m: int, v: int, interleaved: bool) -> None:
    """ValueError unless p stages, m micro-batches and v chunks make a table (interleaving: p | m)."""
    if p < 1:
        raise ValueError(f"stages must be >= 1, got {p}")
    if v < 1:
        raise ValueError(f"virtual stages must be >= 1, got {v}")
    if m < p:
        raise ValueError(f"micro-batches ({m}) must be >= stages ({p})")
    if interleaved and m % p:
        raise ValueError(f"interleaving needs micro-batches ({m}) to be a multiple of stages ({p})")
    if not interleaved and v != 1:
        raise ValueError(f"virtual stages ({v}) > 1 need the interleaved schedule")


def per_stage(order: list, p: int) -> list[list[Op]]:
    """One order for every stage, or already one per stage."""
    return order if order and isinstance(order[0], list) else [order] * p


def _ready(kind: str, mb: int, j: int, t: int, done: dict, finished: dict, last: int) -> bool:
    """Whether F or B of (mb, virtual stage j) may run at tick t (module doc): its input was sent at
    an earlier tick (`done`), or on the last virtual stage B's forward ran this tick (`finished`)."""
    if kind == "F":
        return j == 0 or done.get(("F", mb, j - 1), t) < t
    if j < last:
        return done.get(("B", mb, j + 1), t) < t
    return min(done.get(("F", mb, j), t + 1), finished.get(("F", mb, j), t + 1)) <= t


def _next_forward(todo: list[Op], room: bool, ready, window: int) -> int | None:
    """Index in `todo` of the forward a stage runs now, or None: the next in order when its input is
    there, unless it starts a micro-batch (chunk 0) and the cap leaves no `room`; then the first later
    forward (among the next `window`) of a micro-batch already started (a later chunk) whose input
    is there: started work proceeds (its stashes were promised when it started)."""
    mb, c = todo[0]
    if c != 0 or room:
        return 0 if ready(mb, c) else None
    return next((k for k, (mb, c) in enumerate(todo[:window]) if c != 0 and ready(mb, c)), None)


class _BackwardQueue:
    """Under a cap, each stage's backwards whose input is there, by their place in its order: B(mb, j)
    from the tick after B(mb, j + 1) ran (`sent`, `tick_ends`), B(mb, last) from F(mb, last)'s tick."""

    def __init__(self, orders: list[list[Op]], layout: str, p: int):
        self.place = [{op: k for k, op in enumerate(order)} for order in orders]
        self.heaps: list[list[tuple[int, int, int]]] = [[] for _ in orders]    # (place, mb, chunk)
        self.arriving: list[tuple[int, int, int]] = []                          # (stage, chunk, mb)
        self.layout, self.p = layout, p

    def turned(self, i: int, op: Op) -> None:
        """F(mb, last) ran on stage i: B(mb, last) may run this tick (if there are backwards)."""
        if op in self.place[i]:
            heapq.heappush(self.heaps[i], (self.place[i][op], *op))

    def pop(self, i: int) -> Op:
        """Stage i's first ready backward in its order, (NONE, NONE) if none."""
        return heapq.heappop(self.heaps[i])[1:] if self.heaps[i] else (NONE, NONE)

    def sent(self, mb: int, j: int) -> None:
        """B(mb, j) ran: B(mb, j - 1) may run from the next tick."""
        if j > 0:
            self.arriving.append((*stage_and_chunk(self.layout, self.p, j - 1), mb))

    def tick_ends(self) -> None:
        for i, c, mb in self.arriving:
            heapq.heappush(self.heaps[i], (self.place[i][mb, c], mb, c))
        self.arriving.clear()


def simulate(name: str, p: int, m: int, v: int, forwards: list, backwards: list,
             backward_after_forwards: bool = False, *, layout: str = "loop", cap: int = 0,
             warmup: list[int] | None = None) -> Schedule:
    """Fill each stage's two slots tick by tick with its next forward and next backward, each as
    soon as its dependency (module doc) allows. `forwards`/`backwards` are one order for every
    stage or one per stage. With `warmup` ([p]) a stage runs one operation per tick in Megatron's
    order instead: warmup[i] forwards, then a forward and a backward alternately, then backwards.
    With `cap` > 0 a stage starts a micro-batch (its chunk 0) only while the stashes it holds or has
    promised to started micro-batches (v each, one fewer per backward run) leave v under cap v, and
    a backward may overtake the next one in order when that one waits."""
    last = v * p - 1
    fw, bw = per_stage(forwards, p), per_stage(backwards, p)
    done: dict[tuple[str, int, int], int] = {}  # ("F" | "B", mb, virtual stage) -> tick
    nf, nb = [0] * p, [0] * p
    committed = [0] * p        # stashes held or promised: v per started micro-batch, - 1 per backward
    todo = [list(order) for order in fw]                # forwards not run yet, in order
    queue = _BackwardQueue(bw, layout, p)
    rows = []
    while any(nf[i] < len(fw[i]) or nb[i] < len(bw[i]) for i in range(p)):
        t, row, finished = len(rows), [], {}
        for i in range(p):
            f = b = (NONE, NONE)
            forward_turn = warmup is None or (nf[i] < len(fw[i]) and nf[i] - warmup[i] <= nb[i])
            room = not cap or committed[i] + v <= cap * v
            j_of = functools.partial(virtual_stage, layout, p, i)
            k = _next_forward(todo[i], room, lambda mb, c: _ready("F", mb, j_of(c), t, done, finished, last),
                              2 * v * p) \
                if forward_turn and todo[i] else None
            if k is not None:
                mb, c = f = todo[i].pop(k)
                nf[i] += 1
                finished[("F", mb, j_of(c))] = t
                committed[i] += v if c == 0 else 0
                if j_of(c) == last:
                    queue.turned(i, (mb, c))
            backward_turn = warmup is None or not forward_turn
            if backward_turn and nb[i] < len(bw[i]) and not (backward_after_forwards and nf[i] < len(fw[i])):
                if cap:      # the first backward in order whose input is there (`_BackwardQueue`)
                    b = queue.pop(i)
                else:        # the next in order, when its input is there
                    mb, c = bw[i][nb[i]]
                    b = (mb, c) if _ready("B", mb, j_of(c), t, done, finished, last) else (NONE, NONE)
                if b[0] != NONE:
                    nb[i] += 1
                    committed[i] -= 1
                    finished[("B", b[0], j_of(b[1]))] = t
                    queue.sent(b[0], j_of(b[1]))
            row.append((*f, *b))
        if all(r == (NONE,) * 4 for r in row):
            if cap:
                raise ValueError(f"max_in_flight={cap} is too small for {name} at p={p}, v={v}: "
                                 f"its order deadlocks at tick {t}")
            raise RuntimeError(f"{name}: operation orders deadlock at tick {t}")
        done.update(finished)
        queue.tick_ends()
        rows.append(row)
    table = np.array(rows, dtype=np.int32).reshape(len(rows), p, 4)   # [ticks, p, (fmb, fc, bmb, bc)]
    table.flags.writeable = False  # the views below inherit it: a Schedule is immutable
    return Schedule(name, p, m, v, table[..., 0], table[..., 1], table[..., 2], table[..., 3],
                    layout=layout, max_in_flight_cap=cap)


def in_order(m: int) -> list[Op]:
    return [(k, 0) for k in range(m)]


def fastest(candidates: list[Schedule], costs=None, cap: int = 0) -> Schedule:
    """Of the candidates whose stashes stay within cap v on every stage (all when cap = 0), the one
    with the least lockstep time at `costs`, then the fewest stashes (summed over stages); the first
    on a tie. This is how a builder places work under a memory cap."""
    ok = [s for s in candidates if not cap or (s.slots_held() <= cap * s.chunks).all()]
    best = min(ok, key=lambda s: (s.time_over_ideal(costs=costs), int(s.slots_held().sum())))
    return dataclasses.replace(best, max_in_flight_cap=cap)


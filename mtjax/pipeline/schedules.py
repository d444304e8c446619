"""Pipeline schedules as data: a table tick x stage -> (forward slot, backward slot[, weight slot]).

Notation: p stages, m micro-batches, v model chunks (virtual stages) per stage.
Stage i's chunk c holds virtual stage j = c*p + i, i.e. layer block j of v*p;
virtual stage j + 1 lives on stage (i + 1) mod p (chunk c + 1 after stage p - 1).

A tick holds, on every stage, at most one chunk forward (the forward slot) and then
at most one chunk backward (the backward slot). Warm-up ticks hold only forwards,
cool-down ticks only backwards. What a stage sends at tick T (its forward's output
up, its backward's input gradient down) is usable from tick T + 1, so
  F(mb, j) needs F(mb, j - 1) at an earlier tick,
  B(mb, j) needs B(mb, j + 1) at an earlier tick, and
  B(mb, v*p - 1) needs F(mb, v*p - 1) at the same tick or earlier (the forward slot
  runs first, so the loss stage turns a micro-batch around within one tick).

Cost model (the executor's, in lockstep): a chunk forward costs 1, its backward 2
(3 when the backward recomputes the forward). Stages only wait for each other at
the end of a tick, where they exchange activations and gradients, so a tick lasts
as long as its slowest stage: the stage's forward plus its backward. With both slots
filled in steady state every stage is busy 3 units a tick, and the ticks that wait
are only the warm-up (forwards, cost 1) and the cool-down (backwards, cost 2):
  1f1b:         (p - 1) + 3m + 2(p - 1) = 3(m + p - 1), time / busy = 1 + (p - 1)/m;
  interleaved:  the same count in chunk units, 3(vm + p - 1), so 1 + (p - 1)/(v m);
  gpipe:        m + p - 1 forward ticks then m + p - 1 backward ticks, 1 + (p - 1)/m.
`time_over_ideal` computes this from the table, not from these formulas.

Each builder writes Megatron's order of forwards and of backwards per stage, and
`_simulate` runs each slot's next operation as soon as its dependency allows
(GPipe additionally starts a stage's backwards only after its last forward).

Split schedules (`zero_bubble`: zb, zbv) cut each backward in two (Qi et al., ICLR 2024):
B, the gradient of the stage's input (on the critical path), and W, the gradient of its
weights, which runs in a third slot after B within the tick, at B's tick or later:
  W(mb, j) needs B(mb, j) at the same tick or earlier, on the same stage.
Costs are (F, B, W) per chunk; an unsplit backward costs B + W, so (1, 2) means (1, 1, 1)
for gpipe/1f1b/interleaved. zbv lays chunks in a V (layout "v": stage i holds virtual
stages i and 2p - 1 - i) instead of a loop (layout "loop": chunk c is virtual stage c p + i).

A memory cap N (`max_in_flight`, 0 = none) bounds the stashes a stage holds (waiting for B, and
for split schedules then for W: `Schedule.slots_held`) to N micro-batches of a whole stage: N v
(micro-batch, chunk) pairs, a chunk's stash being 1/v of the stage's. A stage starts a micro-batch (its chunk-0 forward) only while the stashes
it holds or has promised to micro-batches already started (v each, one fewer per backward)
leave room for v more, so started work always proceeds; a backward may then overtake the next
one in its order while that one waits. A fixed order can still deadlock under a small cap
(GPipe below m): ValueError. Each builder offers a few candidate tables (its own, the capped
one, Megatron's one-operation-per-tick order) and `fastest` keeps the quickest within the cap.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq

import numpy as np

from mtjax.pipeline.table import NONE, Op, Schedule, stage_and_chunk, virtual_stage

SCHEDULES = ("gpipe", "1f1b", "interleaved")     # whole backwards (parallel.schedule)
SPLIT_SCHEDULES = ("zb", "zbv")                    # backwards split into B and W (parallel.schedule)


def chunks_per_stage(name: str, v: int) -> int:
    """The model chunks a stage of schedule `name` holds: 2 for zbv (its V), else v."""
    return 2 if name == "zbv" else v


def _validate(p: int, m: int, v: int, interleaved: bool) -> None:
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


def _per_stage(order: list, p: int) -> list[list[Op]]:
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


def _simulate(name: str, p: int, m: int, v: int, forwards: list, backwards: list,
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
    fw, bw = _per_stage(forwards, p), _per_stage(backwards, p)
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


def _in_order(m: int) -> list[Op]:
    return [(k, 0) for k in range(m)]


def fastest(candidates: list[Schedule], costs=None, cap: int = 0) -> Schedule:
    """Of the candidates whose stashes stay within cap v on every stage (all when cap = 0), the one
    with the least lockstep time at `costs`, then the fewest stashes (summed over stages); the first
    on a tie. This is how a builder places work under a memory cap."""
    ok = [s for s in candidates if not cap or (s.slots_held() <= cap * s.chunks).all()]
    best = min(ok, key=lambda s: (s.time_over_ideal(costs=costs), int(s.slots_held().sum())))
    return dataclasses.replace(best, max_in_flight_cap=cap)


def gpipe(p: int, m: int, max_in_flight: int = 0) -> Schedule:
    """GPipe: every forward (pipelined), then every backward (pipelined in reverse stage order).
    A stage stashes all m micro-batches (a smaller cap deadlocks: ValueError)."""
    _validate(p, m, 1, interleaved=False)
    return _simulate("gpipe", p, m, 1, _in_order(m), _in_order(m), backward_after_forwards=True,
                     cap=max_in_flight)


def one_f_one_b(p: int, m: int, max_in_flight: int = 0, costs=None) -> Schedule:
    """1F1B: forwards flow up from tick i on stage i; once the first gradient arrives (tick
    2(p-1) - i) every tick also holds a backward. Stage i stashes 2(p - i) - 1 micro-batches
    at most, whatever m: one forward and one backward per tick, where Megatron's asynchronous
    1F1B alternates them and stashes p - i.

    Under a cap N > 0, the faster at `costs` (`fastest`) of: the same table with stage i
    starting a micro-batch only while it holds fewer than N; and Megatron's own order in
    lockstep, one operation per tick, min(p - i, N) - 1 warm-up forwards (min(p - i, N) held)."""
    _validate(p, m, 1, interleaved=False)
    table = _simulate("1f1b", p, m, 1, _in_order(m), _in_order(m), cap=max_in_flight)
    if not max_in_flight:
        return table
    warmup = [min(p - i, max_in_flight) - 1 for i in range(p)]
    return fastest([one_f_one_b(p, m), table, _simulate("1f1b", p, m, 1, _in_order(m), _in_order(m),
                                                        cap=max_in_flight, warmup=warmup)], costs, max_in_flight)


def interleaved(p: int, m: int, v: int, max_in_flight: int = 0, costs=None) -> Schedule:
    """Interleaved 1F1B: v chunks per stage cut the bubble to (p-1)/(v*m) at the cost of v times the sends.

    Forwards run micro-batches in groups of p per chunk (chunk 0 for mbs 0..p-1, chunk 1 for
    mbs 0..p-1, ..., then chunk 0 for mbs p..2p-1, ...), as Megatron orders them; backwards in
    the same order with the chunks reversed. Stage i stashes min(v m, (v + 1) p - 2i - 1) pairs.
    Under a cap N (>= p, or the order deadlocks), the faster of that table capped and Megatron's
    one-operation-per-tick order with 2(p - i - 1) + (v - 1) p warm-up forwards, capped.
    """
    _validate(p, m, v, interleaved=True)

    def op(k: int, backward: bool) -> Op:  # the k-th forward or backward of a stage
        group, c = divmod(k, p * v)
        c //= p
        return group * p + k % p, v - 1 - c if backward else c

    fw, bw = [op(k, False) for k in range(m * v)], [op(k, True) for k in range(m * v)]
    table = _simulate("interleaved", p, m, v, fw, bw, cap=max_in_flight)
    if not max_in_flight:
        return table
    warmup = [min(2 * (p - i - 1) + (v - 1) * p, m * v) for i in range(p)]
    try:
        return fastest([interleaved(p, m, v), table,
                        _simulate("interleaved", p, m, v, fw, bw, cap=max_in_flight, warmup=warmup)], costs, max_in_flight)
    except ValueError:      # Megatron's order deadlocks under this cap; the capped table does not
        return table


def forward_only(p: int, m: int, v: int = 1, layout: str = "loop") -> Schedule:
    """Evaluation: the forwards of 1F1B (or interleaved when v > 1; zbv's in its V layout), no
    backward slots."""
    if layout == "v":
        from mtjax.pipeline.zero_bubble import v_orders   # it builds on this module
        _validate(p, m, 1, interleaved=False)
        return _simulate("forward", p, m, 2, v_orders(p, m)[0], [], layout="v")
    _validate(p, m, v, interleaved=v > 1)
    order = [(group * p + k % p, (k // p) % v) for group in range(m // p) for k in range(p * v)] if v > 1 \
        else _in_order(m)
    return _simulate("forward", p, m, v, order, [])


def make_schedule(name: str, p: int, m: int, v: int = 1, max_in_flight: int = 0, costs=None) -> Schedule:
    """The schedule `name` (SCHEDULES or SPLIT_SCHEDULES) under the cap `max_in_flight` (0 = the
    schedule's own), its work placed for `costs` (`default_costs`) when that matters; ValueError
    for invalid sizes or a cap the schedule's order cannot meet."""
    if max_in_flight < 0:
        raise ValueError(f"max_in_flight must be >= 0 (0 = the schedule's own), got {max_in_flight}")
    if name in SPLIT_SCHEDULES:
        from mtjax.pipeline import zero_bubble   # it builds on this module
        if v != 1:
            raise ValueError(f"virtual stages ({v}) > 1 need the interleaved schedule (zbv always has 2 chunks)")
        return (zero_bubble.zb if name == "zb" else zero_bubble.zbv)(p, m, max_in_flight, costs)
    if name == "interleaved":
        return interleaved(p, m, v, max_in_flight, costs)
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES + SPLIT_SCHEDULES)}")
    _validate(p, m, v, interleaved=False)
    return gpipe(p, m, max_in_flight) if name == "gpipe" else one_f_one_b(p, m, max_in_flight, costs)


def render(s: Schedule, costs=None) -> str:
    """Text timeline: a header, then one line per stage; a cell is the tick's forward, backward and
    weight gradient ('F3' / 'B1' / 'W0' / 'F3B1W0', '.' when idle; a chunk letter follows the
    micro-batch when v > 1). The header's time over ideal is at `costs` (`default_costs`)."""
    def op(letter: str, mb, c) -> str:
        if mb == NONE:
            return ""
        suffix = "" if s.chunks == 1 else chr(ord("a") + int(c)) if s.chunks <= 26 else f".{int(c)}"
        return f"{letter}{int(mb)}{suffix}"

    cells = [[op("F", s.forward_mb[t, i], s.forward_chunk[t, i]) + op("B", s.backward_mb[t, i], s.backward_chunk[t, i])
              + op("W", s.weight_mb[t, i], s.weight_chunk[t, i]) or "." for t in range(s.ticks)]
             for i in range(s.stages)]
    width = max(len(c) for row in cells for c in row)
    head = (f"{s.name}: p={s.stages} stages, m={s.micro_batches} micro-batches, v={s.chunks} chunks | "
            f"{s.ticks} ticks | time over ideal {float(s.time_over_ideal(costs=costs)):.3f} | "
            f"most in flight {int(s.max_in_flight().max())}")
    if s.split:
        head += f" | most W-pending {int(s.w_pending().max())}"
    label = len(f"stage {s.stages - 1}")
    lines = [f"{f'stage {i}':<{label}} | " + " ".join(c.ljust(width) for c in row).rstrip()
             for i, row in enumerate(cells)]
    return "\n".join([head, *lines])

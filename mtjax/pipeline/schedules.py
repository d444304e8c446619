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
  gpipe:        m + p - 1 ticks of forwards then m + p - 1 of backwards, sharing one tick (the
                last stage's turn), so 2(m + p - 1) - 1 ticks; again 1 + (p - 1)/m.
`time_over_ideal` computes this from the table, not from these formulas.

Each builder writes Megatron's order of forwards and of backwards per stage, and
`lockstep.simulate` runs each slot's next operation as soon as its dependency allows
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
(micro-batch, chunk) pairs, a chunk's stash being 1/v of the stage's. A stage starts a micro-batch
(its chunk-0 forward) only while the stashes
it holds or has promised to micro-batches already started (v each, one fewer per backward)
leave room for v more, so started work always proceeds; a backward may then overtake the next
one in its order while that one waits. A fixed order can still deadlock under a small cap
(GPipe below m): ValueError. Each builder offers a few candidate tables (its own, the capped
one, Megatron's one-operation-per-tick order) and `fastest` keeps the quickest within the cap.
"""
from __future__ import annotations

from mtjax.pipeline import zero_bubble
from mtjax.pipeline.lockstep import check_sizes, in_order, simulate
from mtjax.pipeline.table import NONE, Op, Schedule  # noqa: F401  (NONE, Schedule: re-exported for the executor)
from mtjax.pipeline.whole_backward import gpipe, interleaved, one_f_one_b

SCHEDULES = ("gpipe", "1f1b", "interleaved")     # whole backwards (parallel.schedule)
SPLIT_SCHEDULES = ("zb", "zbv")                    # backwards split into B and W (parallel.schedule)


def chunks_per_stage(name: str, v: int) -> int:
    """The model chunks a stage of schedule `name` holds: 2 for zbv (its V), else v."""
    return 2 if name == "zbv" else v


def forward_only(p: int, m: int, v: int = 1, layout: str = "loop") -> Schedule:
    """Evaluation: the forwards of 1F1B (or interleaved when v > 1; zbv's in its V layout), no
    backward slots."""
    if layout == "v":
        check_sizes(p, m, 1, interleaved=False)
        return simulate("forward", p, m, 2, zero_bubble.v_orders(p, m)[0], [], layout="v")
    check_sizes(p, m, v, interleaved=v > 1)
    order = [(group * p + k % p, (k // p) % v) for group in range(m // p) for k in range(p * v)] if v > 1 \
        else in_order(m)
    return simulate("forward", p, m, v, order, [])


def make_schedule(name: str, p: int, m: int, v: int = 1, max_in_flight: int = 0, costs=None) -> Schedule:
    """The schedule `name` (SCHEDULES or SPLIT_SCHEDULES) under the cap `max_in_flight` (0 = the
    schedule's own), its work placed for `costs` (`default_costs`) when that matters; ValueError
    for invalid sizes or a cap the schedule's order cannot meet."""
    if max_in_flight < 0:
        raise ValueError(f"max_in_flight must be >= 0 (0 = the schedule's own), got {max_in_flight}")
    if name in SPLIT_SCHEDULES:
        if v != 1:
            raise ValueError(f"virtual stages ({v}) > 1 need the interleaved schedule (zbv always has 2 chunks)")
        return (zero_bubble.zb if name == "zb" else zero_bubble.zbv)(p, m, max_in_flight, costs)
    if name == "interleaved":
        return interleaved(p, m, v, max_in_flight, costs)
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES + SPLIT_SCHEDULES)}")
    check_sizes(p, m, v, interleaved=False)
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

"""Zero-bubble schedules as tables (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

Notation as in `schedules`: p stages, m micro-batches, v chunks per stage, virtual stage j.
Each backward is split into B (the gradient of the chunk's input, sent down: the critical
path) and W (the gradient of its weights: nothing waits for it). A tick holds on every
stage at most one F, one B and one W, in that order; costs (F, B, W) are per chunk and a
tick lasts as long as its slowest stage's F + B + W (`Schedule.stage_cost`).

  zb   (ZB-H1 in lockstep): F and B where a 1F1B order puts them (each as soon as its input
       is there), then `place_weights`: the W's go where they fit in a tick's time, the rest
       into W-only ticks at the end. Two 1F1B tables are tried and the faster kept: 1F1B's
       lockstep diagonal (an F and a B per tick) and Megatron's order (one F or B per tick,
       p - i held on stage i). On the diagonal, with W <= min(F, B) and m >= 2p - 2, the time
       equals the lower bound
           m(F + B + W) + (p - 1)(F + B - W)
       (`zb_lower_bound`): the p - 1 warm-up ticks cost F, the p - 1 cool-down ticks B, and
       of the m W's a stage runs, p - 1 fit in ticks another stage lengthens, p - 1 go into
       the W-only ticks and the other m - 2p + 2 lengthen a tick of every stage at once.
       With F = B Megatron's order meets the same bound at Megatron's memory.
  zbv  (ZB-V in lockstep): two chunks per stage in a V, stage i holding virtual stages i and
       2p - 1 - i, so stage 0 computes the loss. Micro-batch k's F on virtual stage j is
       ordered at 2k + j and its B at 2k + 4p - 2 - j: the two chunks of a stage alternate
       ticks (i and 2p - 1 - i differ in parity), so in steady state every tick holds an F
       and a B on every stage. Its warm-up is 2p - 1 chunk-forward ticks and its cool-down
       2p - 1 chunk-backward ticks, each half a stage's work: in lockstep the V gains nothing
       over ZB-H1 (docs/benchmarks.md has the numbers).

Memory: a cap N (`max_in_flight`) bounds the stashes a stage holds to N v (micro-batch, chunk)
pairs, each from its F until its W (`Schedule.slots_held`): B files W's (X, dY) in the slot its
residuals held (`stash.PackedStash`), so one ring of N v slots serves both kinds, and
`place_weights` runs a W early where the next forward would exceed the cap. Waiting for W holds
less than waiting for B (`Schedule.w_pending` against `max_in_flight`): each matmul's input and
output gradient, 36 s b h bytes per layer in 16-bit (Q, K and V each keep their own copy of the
input), against Korthikanti's 34 s b h + 5 a s^2 b for a stashed forward.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from mtjax.pipeline.lockstep import check_sizes, fastest, in_order, simulate
from mtjax.pipeline.table import NONE, Op, Schedule, default_costs, parse_costs, virtual_stage


def zb_lower_bound(p: int, m: int, costs=None):
    """ZB-H1's time over one stage's busy time: (m(F + B + W) + (p - 1)(F + B - W)) / (m(F + B + W))."""
    f, b, w = parse_costs(costs) if costs is not None else default_costs(True)
    return (m * (f + b + w) + (p - 1) * (f + b - w)) / (m * (f + b + w))


class _Backlogs:
    """The W's a stage still has waiting at the end when, after tick t, each free slot takes one if
    any waits: b_n = max(b_{n-1} + step_n, 0) over the later ticks' step = released - free, i.e.
    b_end = max(b_t + S_end, S_end - min_{k>t} S_k) with S the prefix sums of step from t + 1.
    With C the prefix sums over all ticks, S_end = C[-1] - C[t] and S_end - min S_k = C[-1] -
    min_{k>t} C[k]: one pass for every t (per tick a fresh sum made placing quadratic in ticks)."""

    def __init__(self, step: np.ndarray):
        self.sums = np.cumsum(step, axis=0)                                     # C, [ticks, p]
        self.least_after = np.minimum.accumulate(self.sums[::-1], axis=0)[::-1]  # min_{k>=t} C[k]

    def final(self, backlog: np.ndarray, t: int) -> np.ndarray:
        """[p] waiting at the end from `backlog` waiting after tick t."""
        if t + 1 >= len(self.sums):
            return backlog
        end = self.sums[-1]
        return np.maximum(backlog + end - self.sums[t], end - self.least_after[t + 1])


def place_weights(s: Schedule, costs=None, cap: int | None = None) -> Schedule:
    """`s` with a weight slot: each stage's W's in the order of its B's, none before its B, and
    within a cap N (default the table's, `Schedule.max_in_flight_cap`; 0 = none) on the stashes
    held from F to W (`Schedule.slots_held`).

    A W is free at tick t on stage i when the stage's F + B there leave room for it under the
    tick's slowest stage. Stages take free slots as soon as a W waits (first come, first served
    maximises the W's placed by any tick); what is left, T = the most any stage has left, goes into
    T W-only ticks at the end. So the time is sum_t max_i (F + B)[t, i] + W T. One exception moves
    W's earlier, never later: a tick where giving a W to every stage that has one waiting and no
    free slot would leave fewer W-only ticks at the end is lengthened by at most W to hold them,
    for at most the W it saves, which keeps W-pending short.

    Under a cap N (N v pairs) a stage also takes its next W where leaving it would hold more than
    N v at the next tick's forward: a W is forced at tick t when #F(<= t + 1) - #W(<= t) > N v.
    One W a tick always suffices and one is always waiting, since the F/B table keeps
    #F(<= t + 1) - #B(<= t) <= N v: at worst each W runs in its B's tick, which holds no more
    than the F/B table does."""
    f, b, w = parse_costs(costs) if costs is not None else default_costs(True)
    scale = math.lcm(f.denominator, b.denominator, w.denominator)
    base = int(f * scale) * (s.forward_mb != NONE) + int(b * scale) * (s.backward_mb != NONE)  # [ticks, p]
    free = base.max(axis=1, keepdims=True) - base >= int(w * scale)
    released = (s.backward_mb != NONE).astype(np.int64)           # W's that become runnable at each tick
    arrived = np.cumsum(released, axis=0)
    queues = [[(int(s.backward_mb[t, i]), int(s.backward_chunk[t, i])) for t in np.nonzero(released[:, i])[0]]
              for i in range(s.stages)]
    cap = (s.max_in_flight_cap if cap is None else cap) * s.chunks
    forwards = np.cumsum(s.forward_mb != NONE, axis=0)
    placed = np.zeros(s.stages, np.int64)
    backlogs = _Backlogs(released - free)
    rows = []
    for t in range(s.ticks):
        waiting = arrived[t] - placed
        take = free[t] & (waiting > 0)
        if cap:   # the W's the next tick's forward needs done to stay within the cap
            take |= (forwards[min(t + 1, s.ticks - 1)] - placed > cap) & (waiting > 0)
        left = waiting - take
        extra = ~free[t] & (left > 0)
        if extra.any() and backlogs.final(left - extra, t).max() < backlogs.final(left, t).max():
            take |= extra
        rows.append(_take(queues, placed, take))
    while (placed < len(queues[0])).any():                      # the W-only ticks
        rows.append(_take(queues, placed, placed < len(queues[0])))
    return _with_weights(s, np.array(rows, np.int32))


def _take(queues: list[list[Op]], placed: np.ndarray, take: np.ndarray) -> list[tuple[int, int]]:
    """One tick's weight slots [p] of (mb, chunk): stage i's next W where take[i]; advances `placed`."""
    row = []
    for i, queue in enumerate(queues):
        row.append(queue[placed[i]] if take[i] else (NONE, NONE))
        placed[i] += bool(take[i])
    return row


def _with_weights(s: Schedule, weights: np.ndarray) -> Schedule:
    """`s` with weight tables from weights [ticks', p, 2], the other tables padded with idle ticks."""
    extra = weights.shape[0] - s.ticks

    def frozen(a: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a, dtype=np.int32)
        a.flags.writeable = False
        return a

    def pad(a: np.ndarray) -> np.ndarray:
        return frozen(np.concatenate([a, np.full((extra, s.stages), NONE, np.int32)]))

    return dataclasses.replace(s, forward_mb=pad(s.forward_mb), forward_chunk=pad(s.forward_chunk),
                               backward_mb=pad(s.backward_mb), backward_chunk=pad(s.backward_chunk),
                               weight_mb=frozen(weights[..., 0]), weight_chunk=frozen(weights[..., 1]))


def zb(p: int, m: int, max_in_flight: int = 0, costs=None) -> Schedule:
    """ZB-H1 in lockstep: the faster at `costs` (`fastest`, fewer stashes on a tie) of two 1F1B
    tables for F and B, each given its W's by `place_weights`: 1F1B's own (an F and a B per tick,
    2(p - i) - 1 held on stage i), and Megatron's order run one F or B per tick with p - i - 1
    warm-up forwards (p - i held, Megatron's memory). A cap N > 0 bounds both (N - 1 warm-up)."""
    check_sizes(p, m, 1, interleaved=False)
    order, cap = in_order(m), max_in_flight
    warmup = [min(p - i, cap or p) - 1 for i in range(p)]
    tables = [simulate("zb", p, m, 1, order, order, cap=cap),
              simulate("zb", p, m, 1, order, order, cap=cap, warmup=warmup)]
    return fastest([place_weights(t, costs) for t in tables], costs, cap)


def v_orders(p: int, m: int) -> tuple[list[list[Op]], list[list[Op]]]:
    """Per stage, its forwards ordered by 2k + j and its backwards by 2k - j (module doc)."""
    ops = [(k, c) for k in range(m) for c in (0, 1)]
    forwards = [sorted(ops, key=lambda op, i=i: 2 * op[0] + virtual_stage("v", p, i, op[1])) for i in range(p)]
    backwards = [sorted(ops, key=lambda op, i=i: 2 * op[0] - virtual_stage("v", p, i, op[1])) for i in range(p)]
    return forwards, backwards


def zbv(p: int, m: int, max_in_flight: int = 0, costs=None) -> Schedule:
    """ZB-V in lockstep: `v_orders` in a V layout, each F and B as soon as its input is there, then
    `place_weights`. Under a cap N > 0, the faster of that table (if its stashes stay within 2N: a
    chunk's stash is half a stage's) and the same orders run under the cap (`simulate`)."""
    check_sizes(p, m, 1, interleaved=False)
    forwards, backwards = v_orders(p, m)
    tables = [simulate("zbv", p, m, 2, forwards, backwards, layout="v", cap=cap)
              for cap in sorted({0, max_in_flight})]
    return fastest([place_weights(t, costs, max_in_flight) for t in tables], costs, max_in_flight)

"""Schedules whose backward is whole (B and W in one slot): GPipe, 1F1B and interleaved 1F1B, in
Megatron's orders, run by the lockstep simulator (`lockstep`). Rules and notation: `schedules`.
"""
from __future__ import annotations

from mtjax.pipeline.lockstep import check_sizes, fastest, in_order, simulate
from mtjax.pipeline.table import Op, Schedule


def gpipe(p: int, m: int, max_in_flight: int = 0) -> Schedule:
    """GPipe: every forward (pipelined), then every backward (pipelined in reverse stage order).
    A stage stashes all m micro-batches (a smaller cap deadlocks: ValueError)."""
    check_sizes(p, m, 1, interleaved=False)
    return simulate("gpipe", p, m, 1, in_order(m), in_order(m), backward_after_forwards=True,
                    cap=max_in_flight)


def one_f_one_b(p: int, m: int, max_in_flight: int = 0, costs=None) -> Schedule:
    """1F1B: forwards flow up from tick i on stage i; once the first gradient arrives (tick
    2(p-1) - i) every tick also holds a backward. Stage i stashes 2(p - i) - 1 micro-batches
    at most, whatever m: one forward and one backward per tick, where Megatron's asynchronous
    1F1B alternates them and stashes p - i.

    Under a cap N > 0, the fastest at `costs` within the cap (`fastest`) of: the uncapped table
    (when it fits); the same table with stage i starting a micro-batch only while it holds fewer
    than N; and Megatron's own order in lockstep, one operation per tick, min(p - i, N) - 1
    warm-up forwards (min(p - i, N) held)."""
    check_sizes(p, m, 1, interleaved=False)
    table = simulate("1f1b", p, m, 1, in_order(m), in_order(m), cap=max_in_flight)
    if not max_in_flight:
        return table
    warmup = [min(p - i, max_in_flight) - 1 for i in range(p)]
    return fastest([one_f_one_b(p, m), table, simulate("1f1b", p, m, 1, in_order(m), in_order(m),
                                                       cap=max_in_flight, warmup=warmup)], costs, max_in_flight)


def interleaved(p: int, m: int, v: int, max_in_flight: int = 0, costs=None) -> Schedule:
    """Interleaved 1F1B: v chunks per stage cut the bubble to (p-1)/(v*m) at the cost of v times the sends.

    Forwards run micro-batches in groups of p per chunk (chunk 0 for mbs 0..p-1, chunk 1 for
    mbs 0..p-1, ..., then chunk 0 for mbs p..2p-1, ...), as Megatron orders them; backwards in
    the same order with the chunks reversed. Stage i stashes min(v m, (v + 1) p - 2i - 1) pairs.
    Under a cap N, the fastest within the cap (`fastest`) of: the uncapped table (when it fits),
    that table capped, and Megatron's one-operation-per-tick order with 2(p - i - 1) + (v - 1) p
    warm-up forwards, capped; that order deadlocks under a small N (below 6 at p 4, v 2, m 8), and the
    capped table is then the answer.
    """
    check_sizes(p, m, v, interleaved=True)

    def op(k: int, backward: bool) -> Op:  # the k-th forward or backward of a stage
        group, c = divmod(k, p * v)
        c //= p
        return group * p + k % p, v - 1 - c if backward else c

    fw, bw = [op(k, False) for k in range(m * v)], [op(k, True) for k in range(m * v)]
    table = simulate("interleaved", p, m, v, fw, bw, cap=max_in_flight)
    if not max_in_flight:
        return table
    warmup = [min(2 * (p - i - 1) + (v - 1) * p, m * v) for i in range(p)]
    try:
        capped = simulate("interleaved", p, m, v, fw, bw, cap=max_in_flight, warmup=warmup)
        return fastest([interleaved(p, m, v), table, capped], costs, max_in_flight)
    except ValueError:      # Megatron's order deadlocks under this cap; the capped table does not
        return table


"""Pipeline schedules as data: a table tick x stage -> (action, micro-batch, chunk).

Notation: p stages, m micro-batches, v model chunks (virtual stages) per stage.
Stage i's chunk c holds virtual stage j = c*p + i, i.e. layer block j of v*p;
virtual stage j + 1 lives on stage (i + 1) mod p (chunk c + 1 after stage p - 1).

Time model (the simplification): a tick is the time of one chunk's forward, and a
backward takes the same time. In one tick each stage runs at most one forward or
one backward. Activations (forward) and gradients (backward) sent at tick T are
usable from tick T + 1, so
  F(mb, j) needs F(mb, j - 1) at an earlier tick,
  B(mb, j) needs B(mb, j + 1) at an earlier tick, and
  B(mb, v*p - 1) needs F(mb, v*p - 1) at an earlier tick (the loss stage may
  run the backward right after the forward).
Megatron's bubble formulas assume the same thing up to a scale factor. The bubble
is (p - 1)(t_f + t_b) per stage against m(t_f + t_b) of work, so the ratio does
not depend on t_b / t_f. With t_b = t_f every count below is a whole number of ticks.

Each builder writes one ordered list of operations per stage, in Megatron's
order, and `_simulate` runs them greedily: at every tick a stage runs its next
operation if that operation's dependency finished at an earlier tick, and
otherwise idles. The counts this gives (each stage is busy 2mv ticks):
  gpipe, 1f1b:  ticks = 2(m + p - 1); each stage idles 2(p - 1) ticks,
                bubble_fraction = (p - 1)/m, idle_fraction = (p - 1)/(m + p - 1);
  interleaved:  ticks = 2(mv + p - 1); each stage idles 2(p - 1) ticks of 1/v of
                a stage's work, so bubble_fraction = (p - 1)/(v*m).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

IDLE, FORWARD, BACKWARD = 0, 1, 2
SCHEDULES = ("gpipe", "1f1b", "interleaved")
_LETTER = {IDLE: "-", FORWARD: "F", BACKWARD: "B"}

Op = tuple[int, int, int]  # (action, micro_batch, chunk)


@dataclass(frozen=True, eq=False)
class Schedule:
    """A pipeline schedule. `action`, `micro_batch` and `chunk` are int32 arrays [ticks, p].

    `micro_batch` and `chunk` are -1 where the action is IDLE; `chunk` is local to
    the stage (0..v-1).
    """
    name: str
    stages: int           # p
    micro_batches: int    # m
    chunks: int           # v: model chunks per stage, 1 unless interleaved
    action: np.ndarray
    micro_batch: np.ndarray
    chunk: np.ndarray

    @property
    def ticks(self) -> int:
        return self.action.shape[0]

    @property
    def bubble_fraction(self) -> Fraction:
        """Idle ticks over busy ticks per stage, averaged over stages: (p-1)/m, or (p-1)/(v*m) interleaved.

        This is the paper's definition: bubble time over ideal compute time.
        """
        busy = (self.action != IDLE).sum(axis=0)
        ratios = [Fraction(int(self.ticks - b), int(b)) for b in busy]
        return sum(ratios, Fraction(0)) / self.stages

    @property
    def idle_fraction(self) -> Fraction:
        """Idle slots over all slots of the table: (p-1)/(m+p-1) for gpipe and 1f1b."""
        return Fraction(int((self.action == IDLE).sum()), self.action.size)

    def max_in_flight(self) -> np.ndarray:
        """[p] per stage, the most (micro-batch, chunk) pairs whose forward has run and backward has not.

        These are the activations a stage must stash: p - i for 1F1B on stage i,
        m for GPipe.
        """
        step = (self.action == FORWARD).astype(np.int64) - (self.action == BACKWARD)
        return np.cumsum(step, axis=0).max(axis=0, initial=0)

    def timeline(self) -> list[dict]:
        """One row per (tick, stage), idle slots included, for plots and tables."""
        return [{"tick": t, "stage": i, "action": _LETTER[int(self.action[t, i])],
                 "micro_batch": int(self.micro_batch[t, i]), "chunk": int(self.chunk[t, i])}
                for t in range(self.ticks) for i in range(self.stages)]


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


def _warmup_then_steady(forwards: list[Op], backwards: list[Op], warmup: int) -> list[Op]:
    """Megatron's per-stage order: `warmup` forwards, then one forward one backward, then the backwards left."""
    n = len(forwards)
    ops = forwards[:warmup]
    for k in range(n - warmup):
        ops += [forwards[warmup + k], backwards[k]]
    return ops + backwards[n - warmup:]


def _simulate(name: str, p: int, m: int, v: int, orders: list[list[Op]]) -> Schedule:
    """Run each stage's ordered operations as soon as their dependency has finished (see module doc)."""
    last = v * p - 1
    finished: dict[tuple[int, int, int], int] = {}  # (action, mb, virtual stage) -> tick
    nxt = [0] * p
    rows: list[list[Op]] = []
    while any(nxt[i] < len(orders[i]) for i in range(p)):
        t, row = len(rows), []
        for i in range(p):
            if nxt[i] == len(orders[i]):
                row.append((IDLE, -1, -1))
                continue
            action, mb, c = op = orders[i][nxt[i]]
            j = c * p + i
            if action == FORWARD:
                dep = (FORWARD, mb, j - 1) if j > 0 else None
            else:
                dep = (BACKWARD, mb, j + 1) if j < last else (FORWARD, mb, j)
            ready = dep is None or finished.get(dep, t) < t
            row.append(op if ready else (IDLE, -1, -1))
            nxt[i] += ready
        if all(a == IDLE for a, _, _ in row):
            raise RuntimeError(f"{name}: operation orders deadlock at tick {t}")
        for i, (action, mb, c) in enumerate(row):
            if action != IDLE:
                finished[(action, mb, c * p + i)] = t
        rows.append(row)
    table = np.array(rows, dtype=np.int32).reshape(len(rows), p, 3)  # [ticks, p, (action, mb, chunk)]
    table.flags.writeable = False  # the views below inherit it: a Schedule is immutable
    return Schedule(name, p, m, v, table[..., 0], table[..., 1], table[..., 2])


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every forward (pipelined), then every backward (pipelined in reverse stage order)."""
    _validate(p, m, 1, interleaved=False)
    fwd = [(FORWARD, k, 0) for k in range(m)]
    bwd = [(BACKWARD, k, 0) for k in range(m)]
    return _simulate("gpipe", p, m, 1, [fwd + bwd] * p)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): stage i runs min(p-i-1, m) warm-up forwards, then alternates, then cools down.

    At most p - i micro-batches are in flight on stage i, not m as in GPipe; the bubble is the same.
    """
    _validate(p, m, 1, interleaved=False)
    fwd = [(FORWARD, k, 0) for k in range(m)]
    bwd = [(BACKWARD, k, 0) for k in range(m)]
    return _simulate("1f1b", p, m, 1, [_warmup_then_steady(fwd, bwd, min(p - i - 1, m)) for i in range(p)])


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B: v chunks per stage cut the bubble to (p-1)/(v*m) at the cost of v times the sends.

    Forwards run micro-batches in groups of p per chunk (chunk 0 for mbs 0..p-1,
    chunk 1 for mbs 0..p-1, ..., then chunk 0 for mbs p..2p-1, ...); backwards in the
    same order with the chunks reversed. Stage i warms up with (p-i-1)*2 + (v-1)*p
    forwards (at most m*v), as Megatron does.
    """
    _validate(p, m, v, interleaved=True)

    def op(action: int, k: int) -> Op:  # the k-th forward or backward of a stage
        group, c = divmod(k, p * v)
        c //= p
        return action, group * p + k % p, c if action == FORWARD else v - 1 - c

    fwd = [op(FORWARD, k) for k in range(m * v)]
    bwd = [op(BACKWARD, k) for k in range(m * v)]
    orders = [_warmup_then_steady(fwd, bwd, min((p - i - 1) * 2 + (v - 1) * p, m * v)) for i in range(p)]
    return _simulate("interleaved", p, m, v, orders)


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `name` ('gpipe' | '1f1b' | 'interleaved'); ValueError for invalid sizes."""
    if name == "interleaved":
        return interleaved(p, m, v)
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    _validate(p, m, v, interleaved=False)
    return gpipe(p, m) if name == "gpipe" else one_f_one_b(p, m)


def render(s: Schedule) -> str:
    """Text timeline: a header, then one line per stage ('.' idle; F3, B3; F3b for chunk 1 when v > 1)."""
    def cell(t: int, i: int) -> str:
        a = int(s.action[t, i])
        if a == IDLE:
            return "."
        c = int(s.chunk[t, i])
        suffix = "" if s.chunks == 1 else chr(ord("a") + c) if s.chunks <= 26 else f".{c}"
        return f"{_LETTER[a]}{s.micro_batch[t, i]}{suffix}"

    cells = [[cell(t, i) for t in range(s.ticks)] for i in range(s.stages)]
    width = max(len(c) for row in cells for c in row)
    b = s.bubble_fraction
    head = (f"{s.name}: p={s.stages} stages, m={s.micro_batches} micro-batches, v={s.chunks} chunks | "
            f"{s.ticks} ticks | bubble {b} = {float(b):.3f} of compute | idle {float(s.idle_fraction):.1%} of slots")
    label = len(f"stage {s.stages - 1}")
    lines = [f"{f'stage {i}':<{label}} | " + " ".join(c.ljust(width) for c in row).rstrip()
             for i, row in enumerate(cells)]
    return "\n".join([head, *lines])

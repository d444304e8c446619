"""Pipeline schedules as data: a table tick x stage -> (forward slot, backward slot).

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
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

NONE = -1
SCHEDULES = ("gpipe", "1f1b", "interleaved")
FORWARD_COST, BACKWARD_COST = 1, 2          # one chunk's forward and backward, in forward units

Op = tuple[int, int]  # (micro_batch, chunk)


@dataclass(frozen=True, eq=False)
class Schedule:
    """A pipeline schedule: four int32 tables [ticks, p], NONE (-1) where a slot is empty.

    `forward_mb`/`forward_chunk` say which (micro-batch, local chunk 0..v-1) a stage's
    forward slot runs at each tick; `backward_mb`/`backward_chunk` the same for the
    backward slot. A forward-only schedule (evaluation) has no backwards.
    """
    name: str
    stages: int           # p
    micro_batches: int    # m
    chunks: int           # v: model chunks per stage, 1 unless interleaved
    forward_mb: np.ndarray
    forward_chunk: np.ndarray
    backward_mb: np.ndarray
    backward_chunk: np.ndarray

    @property
    def ticks(self) -> int:
        return self.forward_mb.shape[0]

    @property
    def has_backward(self) -> bool:
        return bool((self.backward_mb != NONE).any())

    def stage_cost(self, recompute: bool = False) -> np.ndarray:
        """[ticks, p] what each stage computes per tick: 1 per forward, 2 per backward (+1 recomputing)."""
        backward = BACKWARD_COST + (FORWARD_COST if recompute else 0)
        return FORWARD_COST * (self.forward_mb != NONE) + backward * (self.backward_mb != NONE)

    def time_over_ideal(self, recompute: bool = False) -> Fraction:
        """Lockstep time (sum over ticks of the slowest stage's cost) over one stage's busy time."""
        cost = self.stage_cost(recompute)
        return Fraction(int(cost.max(axis=1).sum()), int(cost.sum(axis=0).max()))

    @property
    def bubble_fraction(self) -> Fraction:
        """Waiting time over compute time in the cost model: time_over_ideal - 1, i.e. (p-1)/m,
        or (p-1)/(v m) interleaved, when the table meets Megatron's bubble."""
        return self.time_over_ideal() - 1

    def max_in_flight(self) -> np.ndarray:
        """[p] per stage, the most (micro-batch, chunk) pairs whose forward has run and whose
        backward has not yet finished, counted within a tick after its forward slot: the stashes
        a stage must hold at once: min(m, 2(p - i) - 1) for 1F1B on stage i, m for GPipe,
        min(v m, (v + 1) p - 2i - 1) interleaved."""
        if not self.has_backward:
            return np.ones(self.stages, np.int64)
        fwd = np.cumsum(self.forward_mb != NONE, axis=0)
        done = np.cumsum(self.backward_mb != NONE, axis=0) - (self.backward_mb != NONE)
        return (fwd - done).max(axis=0, initial=0)

    def timeline(self) -> list[dict]:
        """One row per (tick, stage), empty slots included, for plots and tables."""
        return [{"tick": t, "stage": i,
                 "forward": _op_or_none(self.forward_mb[t, i], self.forward_chunk[t, i]),
                 "backward": _op_or_none(self.backward_mb[t, i], self.backward_chunk[t, i])}
                for t in range(self.ticks) for i in range(self.stages)]

    def cost_model(self, recompute: bool = False) -> dict:
        """The figures `python -m mtjax.pipeline show` prints, computed from the table."""
        return {"schedule": self.name, "stages": self.stages, "micro_batches": self.micro_batches,
                "virtual_stages": self.chunks, "ticks": self.ticks,
                "bubble_fraction": float(self.time_over_ideal(recompute) - 1),
                "time_over_ideal": float(self.time_over_ideal(recompute)),
                "max_in_flight": [int(n) for n in self.max_in_flight()]}


def _op_or_none(mb, chunk) -> dict | None:
    return None if mb == NONE else {"micro_batch": int(mb), "chunk": int(chunk)}


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


def _simulate(name: str, p: int, m: int, v: int, forwards: list[Op], backwards: list[Op],
              backward_after_forwards: bool = False) -> Schedule:
    """Fill each stage's two slots tick by tick with its next forward and next backward, each as
    soon as its dependency (module doc) allows. Every stage runs the same orders."""
    last = v * p - 1
    done: dict[tuple[str, int, int], int] = {}  # ("F" | "B", mb, virtual stage) -> tick
    nf, nb = [0] * p, [0] * p
    rows = []
    while any(nf[i] < len(forwards) or nb[i] < len(backwards) for i in range(p)):
        t, row, finished = len(rows), [], {}
        for i in range(p):
            f = b = (NONE, NONE)
            if nf[i] < len(forwards):
                mb, c = forwards[nf[i]]
                j = c * p + i
                if j == 0 or done.get(("F", mb, j - 1), t) < t:
                    f, nf[i] = (mb, c), nf[i] + 1
                    finished[("F", mb, j)] = t
            if nb[i] < len(backwards) and not (backward_after_forwards and nf[i] < len(forwards)):
                mb, c = backwards[nb[i]]
                j = c * p + i
                ready = (done.get(("B", mb, j + 1), t) < t if j < last
                         else min(done.get(("F", mb, j), t + 1), finished.get(("F", mb, j), t + 1)) <= t)
                if ready:
                    b, nb[i] = (mb, c), nb[i] + 1
                    finished[("B", mb, j)] = t
            row.append((*f, *b))
        if all(r == (NONE,) * 4 for r in row):
            raise RuntimeError(f"{name}: operation orders deadlock at tick {t}")
        done.update(finished)
        rows.append(row)
    table = np.array(rows, dtype=np.int32).reshape(len(rows), p, 4)   # [ticks, p, (fmb, fc, bmb, bc)]
    table.flags.writeable = False  # the views below inherit it: a Schedule is immutable
    return Schedule(name, p, m, v, table[..., 0], table[..., 1], table[..., 2], table[..., 3])


def _in_order(m: int) -> list[Op]:
    return [(k, 0) for k in range(m)]


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every forward (pipelined), then every backward (pipelined in reverse stage order).
    A stage stashes all m micro-batches."""
    _validate(p, m, 1, interleaved=False)
    return _simulate("gpipe", p, m, 1, _in_order(m), _in_order(m), backward_after_forwards=True)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: forwards flow up from tick i on stage i; once the first gradient arrives (tick
    2(p-1) - i) every tick also holds a backward. Stage i stashes 2(p - i) - 1 micro-batches
    at most, whatever m: one forward and one backward per tick, where Megatron's asynchronous
    1F1B alternates them and stashes p - i."""
    _validate(p, m, 1, interleaved=False)
    return _simulate("1f1b", p, m, 1, _in_order(m), _in_order(m))


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B: v chunks per stage cut the bubble to (p-1)/(v*m) at the cost of v times the sends.

    Forwards run micro-batches in groups of p per chunk (chunk 0 for mbs 0..p-1, chunk 1 for
    mbs 0..p-1, ..., then chunk 0 for mbs p..2p-1, ...), as Megatron orders them; backwards in
    the same order with the chunks reversed. Stage i stashes min(v m, (v + 1) p - 2i - 1) pairs.
    """
    _validate(p, m, v, interleaved=True)

    def op(k: int, backward: bool) -> Op:  # the k-th forward or backward of a stage
        group, c = divmod(k, p * v)
        c //= p
        return group * p + k % p, v - 1 - c if backward else c

    return _simulate("interleaved", p, m, v, [op(k, False) for k in range(m * v)],
                     [op(k, True) for k in range(m * v)])


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Evaluation: the forwards of 1F1B (or interleaved when v > 1), no backward slots."""
    _validate(p, m, v, interleaved=v > 1)
    order = [(group * p + k % p, (k // p) % v) for group in range(m // p) for k in range(p * v)] if v > 1 \
        else _in_order(m)
    return _simulate("forward", p, m, v, order, [])


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `name` ('gpipe' | '1f1b' | 'interleaved'); ValueError for invalid sizes."""
    if name == "interleaved":
        return interleaved(p, m, v)
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    _validate(p, m, v, interleaved=False)
    return gpipe(p, m) if name == "gpipe" else one_f_one_b(p, m)


def render(s: Schedule) -> str:
    """Text timeline: a header, then one line per stage; a cell is the tick's forward and backward
    ('F3' / 'B1' / 'F3B1', '.' when idle; a chunk letter follows the micro-batch when v > 1)."""
    def op(letter: str, mb, c) -> str:
        if mb == NONE:
            return ""
        suffix = "" if s.chunks == 1 else chr(ord("a") + int(c)) if s.chunks <= 26 else f".{int(c)}"
        return f"{letter}{int(mb)}{suffix}"

    cells = [[op("F", s.forward_mb[t, i], s.forward_chunk[t, i]) + op("B", s.backward_mb[t, i], s.backward_chunk[t, i])
              or "." for t in range(s.ticks)] for i in range(s.stages)]
    width = max(len(c) for row in cells for c in row)
    head = (f"{s.name}: p={s.stages} stages, m={s.micro_batches} micro-batches, v={s.chunks} chunks | "
            f"{s.ticks} ticks | time over ideal {float(s.time_over_ideal()):.3f} | "
            f"most in flight {int(s.max_in_flight().max())}")
    label = len(f"stage {s.stages - 1}")
    lines = [f"{f'stage {i}':<{label}} | " + " ".join(c.ljust(width) for c in row).rstrip()
             for i, row in enumerate(cells)]
    return "\n".join([head, *lines])

"""Pipeline schedule tables: every property is recomputed here from the raw int32 tables.

Notation: p stages, m micro-batches, v chunks per stage; chunk c of stage i is virtual
stage j = c p + i, and j + 1 lives on stage (i + 1) mod p. F(mb, j) / B(mb, j) is the
forward / backward of micro-batch mb on virtual stage j, read off the forward / backward
slot tables. Expected values are closed forms (v = 1 for gpipe and 1f1b):
  lockstep time over one stage's busy time  1 + (p - 1)/(v m), with or without recompute;
  stashes held on stage i                   min(v m, (v + 1) p - 2i - 1) for 1f1b and
                                            interleaved (2(p - i) - 1 for 1f1b), m for gpipe.
"""
import json
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from mtjax.pipeline.buffers import plan_buffers
from mtjax.pipeline.schedules import forward_only, make_schedule, render
from mtjax.pipeline.table import stage_and_chunk

EMPTY = -1
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [(name, p, m, 1) for name in ("gpipe", "1f1b") for p in (1, 2, 3, 4, 8) for m in (p, 2 * p, 4 * p)]
CASES += [("interleaved", p, m, v) for p in (1, 2, 3, 4, 8) for m in (p, 4 * p) for v in (2, 3, 4)]
FORWARD_ONLY = [(p, m, v) for p in (1, 2, 4) for m in (p, 2 * p) for v in (1, 2, 3)]


@pytest.fixture(params=CASES, ids=lambda c: "{}-p{}-m{}-v{}".format(*c))
def case(request):
    name, p, m, v = request.param
    return request.param, make_schedule(name, p, m, v)


# reading the table --------------------------------------------------------------------------
def slot_tables(s, kind):
    """(micro-batch table, chunk table) of the forward ('F') or backward ('B') slot."""
    return (s.forward_mb, s.forward_chunk) if kind == "F" else (s.backward_mb, s.backward_chunk)


def op_ticks(s, kind):
    """{(mb, j): tick} of one slot kind; fails if a (mb, j) runs twice."""
    mbs, chunks = slot_tables(s, kind)
    at = {}
    for t, i in zip(*np.nonzero(mbs != EMPTY)):
        key = (int(mbs[t, i]), int(chunks[t, i]) * s.stages + int(i))
        assert key not in at, f"{kind}{key} runs at ticks {at[key]} and {t}"
        at[key] = int(t)
    return at


def stage_order(s, kind, i):
    """Stage i's (mb, chunk) of one slot kind, in tick order."""
    mbs, chunks = slot_tables(s, kind)
    return [(int(mbs[t, i]), int(chunks[t, i])) for t in range(s.ticks) if mbs[t, i] != EMPTY]


def megatron_order(p, m, v, backward):
    """Megatron's per-stage order: micro-batches in groups of p, chunk by chunk within a group
    (chunks reversed for the backwards); 0..m-1 on chunk 0 when v = 1."""
    chunks = range(v - 1, -1, -1) if backward else range(v)
    return [(g * p + k, c) for g in range(m // p) for c in chunks for k in range(p)] if v > 1 \
        else [(mb, 0) for mb in range(m)]


def lockstep_time_over_ideal(s, backward_cost):
    """sum_t max_i cost[t, i] / (v m (1 + backward_cost)), cost = [forward] + backward_cost [backward]:
    a tick lasts as long as its slowest stage; one stage's busy time is v m forwards and backwards."""
    time = sum(max(int(s.forward_mb[t, i] != EMPTY) + backward_cost * int(s.backward_mb[t, i] != EMPTY)
                   for i in range(s.stages)) for t in range(s.ticks))
    return Fraction(time, s.chunks * s.micro_batches * (1 + backward_cost))


def in_flight(s):
    """[p] per stage, the most (mb, j) held at once: F(mb, j) at a tick <= t, B(mb, j) at one >= t."""
    forwards, backwards = op_ticks(s, "F"), op_ticks(s, "B")
    held = np.zeros((s.ticks, s.stages), np.int64)
    for (mb, j), t in forwards.items():
        held[t:backwards[mb, j] + 1, j % s.stages] += 1
    return held.max(axis=0)


def expected_in_flight(name, p, m, v):
    return [m] * p if name == "gpipe" else [min(v * m, (v + 1) * p - 2 * i - 1) for i in range(p)]


# the tables ---------------------------------------------------------------------------------
def test_tables_are_read_only_int32_with_empty_markers(case):
    (name, p, m, v), s = case
    assert (s.name, s.stages, s.micro_batches, s.chunks) == (name, p, m, v)
    for kind in "FB":
        mbs, chunks = slot_tables(s, kind)
        for a in (mbs, chunks):
            assert a.dtype == np.int32 and a.shape == (s.ticks, p) and not a.flags.writeable
        full = mbs != EMPTY
        assert (chunks[~full] == EMPTY).all()
        assert ((mbs[full] >= 0) & (mbs[full] < m) & (chunks[full] >= 0) & (chunks[full] < v)).all()
    busy = (s.forward_mb != EMPTY) | (s.backward_mb != EMPTY)
    assert busy[0].any() and busy[-1].any()    # no idle tick at either end


def test_every_micro_batch_runs_one_forward_and_one_backward_per_virtual_stage(case):
    (_, p, m, v), s = case
    pairs = {(mb, j) for mb in range(m) for j in range(v * p)}
    assert set(op_ticks(s, "F")) == pairs and set(op_ticks(s, "B")) == pairs


def test_dependencies(case):
    """F(mb, j) strictly after F(mb, j - 1); B(mb, j) strictly after B(mb, j + 1); B(mb, last) at the
    tick of F(mb, last) or later; F(mb, j) no later than B(mb, j)."""
    (_, p, m, v), s = case
    f, b, last = op_ticks(s, "F"), op_ticks(s, "B"), v * p - 1
    for mb in range(m):
        assert f[mb, last] <= b[mb, last]
        for j in range(last):
            assert f[mb, j] < f[mb, j + 1]
            assert b[mb, j + 1] < b[mb, j]
            assert f[mb, j] < b[mb, j]


def test_each_stage_runs_megatrons_order(case):
    (_, p, m, v), s = case
    for i in range(p):
        assert stage_order(s, "F", i) == megatron_order(p, m, v, backward=False)
        assert stage_order(s, "B", i) == megatron_order(p, m, v, backward=True)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 9)])
def test_interleaved_with_one_chunk_is_1f1b(p, m):
    a, b = make_schedule("interleaved", p, m, 1), make_schedule("1f1b", p, m)
    assert all(getattr(a, k).shape == getattr(b, k).shape and (getattr(a, k) == getattr(b, k)).all()
               for k in ("forward_mb", "forward_chunk", "backward_mb", "backward_chunk"))


def test_a_slot_is_empty_only_while_its_next_operation_waits(case):
    """As early as the order allows: an empty forward slot means the next forward's input is not
    there yet; an empty backward slot that the next backward's gradient (or on the last virtual
    stage its forward) is not; GPipe's backwards also wait for the stage's last forward."""
    (name, p, m, v), s = case
    f, b, last = op_ticks(s, "F"), op_ticks(s, "B"), v * p - 1
    for i in range(p):
        fwd, bwd = stage_order(s, "F", i), stage_order(s, "B", i)
        last_forward = max(f[mb, c * p + i] for mb, c in fwd)
        for t in range(s.ticks):
            nf = sum(f[mb, c * p + i] < t for mb, c in fwd)
            if s.forward_mb[t, i] == EMPTY and nf < len(fwd):
                mb, c = fwd[nf]
                assert c * p + i > 0 and f[mb, c * p + i - 1] >= t, f"stage {i} forward idles at {t}"
            nb = sum(b[mb, c * p + i] < t for mb, c in bwd)
            if s.backward_mb[t, i] == EMPTY and nb < len(bwd):
                mb, c = bwd[nb]
                j = c * p + i
                waits = f[mb, j] > t if j == last else b[mb, j + 1] >= t
                assert waits or (name == "gpipe" and last_forward > t), f"stage {i} backward idles at {t}"


# the cost model -----------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", [False, True], ids=["backward2", "recompute3"])
def test_time_over_ideal_is_megatrons(case, recompute):
    """The lockstep time of the table over one stage's busy time equals 1 + (p - 1)/(v m) exactly,
    for all three schedules, whether a backward costs 2 forwards or 3 (recomputing)."""
    (_, p, m, v), s = case
    got = lockstep_time_over_ideal(s, 3 if recompute else 2)
    assert got == 1 + Fraction(p - 1, v * m)
    assert s.time_over_ideal(recompute) == got
    assert s.bubble_fraction == Fraction(p - 1, v * m)


def test_stashes_in_flight(case):
    (name, p, m, v), s = case
    got = in_flight(s)
    assert list(got) == expected_in_flight(name, p, m, v)
    assert list(s.max_in_flight()) == list(got)
    if name == "1f1b":
        assert all(got[i] <= 2 * (p - i) - 1 for i in range(p))


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("interleaved", 4)])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_stash_bound_does_not_grow_with_micro_batches(name, p, v):
    """(v + 1) p - 2i - 1 on stage i (2(p - i) - 1 for 1f1b) at m = 4p and m = 8p alike."""
    bound = [(v + 1) * p - 2 * i - 1 for i in range(p)]
    assert [list(in_flight(make_schedule(name, p, k * p, v))) for k in (4, 8)] == [bound, bound]


def test_gpipe_stashes_grow_with_micro_batches():
    assert [in_flight(make_schedule("gpipe", 4, m)).max() for m in (4, 16, 32)] == [4, 16, 32]


def test_cost_model_and_timeline_read_the_table(case):
    (name, p, m, v), s = case
    assert s.cost_model() == {"schedule": name, "stages": p, "micro_batches": m, "virtual_stages": v,
                              "ticks": s.ticks, "bubble_fraction": float(Fraction(p - 1, v * m)),
                              "time_over_ideal": float(1 + Fraction(p - 1, v * m)),
                              "max_in_flight": expected_in_flight(name, p, m, v)}
    rows = s.timeline()
    assert [(r["tick"], r["stage"]) for r in rows] == [(t, i) for t in range(s.ticks) for i in range(p)]
    for r in rows:
        for kind, key in (("F", "forward"), ("B", "backward")):
            mbs, chunks = slot_tables(s, kind)
            t, i = r["tick"], r["stage"]
            want = None if mbs[t, i] == EMPTY else {"micro_batch": mbs[t, i], "chunk": chunks[t, i]}
            assert r[key] == want


# evaluation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m,v", FORWARD_ONLY, ids=lambda x: str(x))
def test_forward_only(p, m, v):
    """No backward; each (mb, j) forward once, after F(mb, j - 1), in Megatron's order; a stage never
    waits after its first forward, so v m + p - 1 ticks."""
    s = forward_only(p, m, v)
    assert (s.backward_mb == EMPTY).all() and (s.backward_chunk == EMPTY).all() and not s.has_backward
    f = op_ticks(s, "F")
    assert set(f) == {(mb, j) for mb in range(m) for j in range(v * p)}
    assert all(f[mb, j - 1] < f[mb, j] for mb in range(m) for j in range(1, v * p))
    assert all(stage_order(s, "F", i) == megatron_order(p, m, v, backward=False) for i in range(p))
    assert s.ticks == v * m + p - 1


# buffers: the executor's slot tables ---------------------------------------------------------
KINDS = ("act", "grad", "stash", "head", "w_stash", "prefix")


class Rings:
    """Per (kind, stage), what each slot holds: {slot: value}. Values are (kind, mb, j)."""

    def __init__(self, plan, p):
        self.size = {k: getattr(plan, f"{k}_slots") for k in KINDS}   # the W stash's is 1 unsplit
        self.held = {(k, i): {} for k in KINDS for i in range(p)}
        self.peak = dict.fromkeys(KINDS, 0)
        self.ring = {"w_stash": "stash"} if plan.shared_stash else {}  # one ring for B's and W's stashes

    def write(self, kind, i, slot, value, where):
        """A value needs a slot in range that holds nothing still to be read; nothing, no slot."""
        kind = self.ring.get(kind, kind)
        if value is None:
            assert slot == EMPTY, f"{where}: {kind} slot {slot} written with nothing to write"
            return
        ring = self.held[kind, i]
        assert 0 <= slot < self.size[kind], f"{where}: {value} gets {kind} slot {slot} of {self.size[kind]}"
        assert slot not in ring, f"{where}: {value} overwrites {ring[slot]}, not read yet"
        ring[slot] = value
        self.peak[kind] = max(self.peak[kind], len(ring))

    def read(self, kind, i, slot, value, where):
        """Reading frees the slot; it must hold `value` (or, for value None, no slot is read)."""
        kind = self.ring.get(kind, kind)
        if value is None:
            assert slot == EMPTY, f"{where}: reads {kind} slot {slot} it does not need"
            return
        got = self.held[kind, i].pop(slot, None)
        assert got == value, f"{where}: {kind} slot {slot} holds {got}, wanted {value}"


def arrival(s, receiver, sender, step):
    """The channel the executor files a value on: the loop layout has one ring per direction
    (activations from stage i - 1, gradients from i + 1); a V sends both ways and keeps a copy."""
    if s.layout == "loop":
        return "prev" if step > 0 else "next"
    return "self" if receiver == sender else "prev" if receiver == sender + 1 else "next"


def run_plan(s, plan):
    """Run the plan's tables in the executor's order: each tick, each stage files what arrived from
    the previous tick's sends (on the channel its tables name: from stage i - 1, i + 1 or itself),
    runs its forward slot (reads the activation, writes stash, head input and, virtual stage 0, the
    prefix stash), then its backward slot (reads them; split: writes the W stash), then its weight slot
    (reads the W stash); forward outputs go to j + 1, input gradients to j - 1. Returns the Rings,
    which fail on any misuse of a slot."""
    p, last, tb = s.stages, s.stages * s.chunks - 1, plan.tables
    rings = Rings(plan, p)
    channels = ("prev", "next", "self")
    arrives = {(k, i, c): None for k in ("act", "grad") for i in range(p) for c in channels}
    for t in range(s.ticks):
        sent = dict.fromkeys(arrives)
        for i in range(p):
            where = f"tick {t} stage {i}"
            for (kind, r, c), value in arrives.items():
                if r == i:
                    rings.write(kind, i, getattr(tb, f"{kind}_in_{c}")[t, i], value, f"{where} ({c})")
            if s.forward_mb[t, i] != EMPTY:
                mb, j = int(s.forward_mb[t, i]), s.virtual_stage(i, int(s.forward_chunk[t, i]))
                rings.read("act", i, tb.fwd_act[t, i], ("act", mb, j) if j > 0 else None, where)
                rings.write("stash", i, tb.fwd_stash[t, i], ("stash", mb, j) if s.has_backward else None, where)
                rings.write("head", i, tb.fwd_head[t, i], ("head", mb, j) if s.has_backward and j == last else None,
                            where)
                rings.write("prefix", i, tb.fwd_prefix[t, i], ("prefix", mb) if s.has_backward and j == 0 else None,
                            where)
                if j < last:
                    to = stage_and_chunk(s.layout, p, j + 1)[0]
                    assert sent["act", to, arrival(s, to, i, +1)] is None, f"{where}: two sends on one channel"
                    sent["act", to, arrival(s, to, i, +1)] = ("act", mb, j + 1)
            if s.backward_mb[t, i] != EMPTY:
                mb, j = int(s.backward_mb[t, i]), s.virtual_stage(i, int(s.backward_chunk[t, i]))
                rings.read("grad", i, tb.bwd_grad[t, i], ("grad", mb, j) if j < last else None, where)
                rings.read("stash", i, tb.bwd_stash[t, i], ("stash", mb, j), where)
                rings.read("head", i, tb.bwd_head[t, i], ("head", mb, j) if j == last else None, where)
                rings.read("prefix", i, tb.bwd_prefix[t, i], ("prefix", mb) if j == 0 else None, where)
                rings.write("w_stash", i, tb.bwd_wstash[t, i], ("w", mb, j) if s.split else None, where)
                if j > 0:
                    to = stage_and_chunk(s.layout, p, j - 1)[0]
                    assert sent["grad", to, arrival(s, to, i, -1)] is None, f"{where}: two sends on one channel"
                    sent["grad", to, arrival(s, to, i, -1)] = ("grad", mb, j - 1)
            if s.weight_mb[t, i] != EMPTY:
                mb, j = int(s.weight_mb[t, i]), s.virtual_stage(i, int(s.weight_chunk[t, i]))
                rings.read("w_stash", i, tb.w_wstash[t, i], ("w", mb, j), where)
        arrives = sent
    assert not any(rings.held.values()), "values never read"
    return rings


def check_plan(s, shared_stash=False):
    """The plan's slot tables are consistent with the schedule, idle where the slot is, and use
    exactly as many slots of each kind as values are held at once (at least one); a shared stash
    ring is counted as the stash's."""
    plan = plan_buffers(s, shared_stash)
    tb = plan.tables
    assert all((getattr(tb, k) == getattr(s, n)).all() for k, n in
               (("fwd_mb", "forward_mb"), ("fwd_chunk", "forward_chunk"),
                ("bwd_mb", "backward_mb"), ("bwd_chunk", "backward_chunk")))
    for prefix, mbs in (("fwd", s.forward_mb), ("bwd", s.backward_mb)):
        for k in ("act", "stash", "head", "prefix") if prefix == "fwd" else ("grad", "stash", "head", "prefix"):
            assert (getattr(tb, f"{prefix}_{k}")[mbs == EMPTY] == EMPTY).all()
    rings = run_plan(s, plan)
    peak = {k: max(1, n) for k, n in rings.peak.items()}
    if plan.shared_stash:
        peak["w_stash"] = peak["stash"]
    assert {k: getattr(plan, f"{k}_slots") for k in KINDS} == peak
    return plan


def test_buffer_plan_never_overwrites_a_value_still_needed(case):
    _, s = case
    plan = check_plan(s)
    assert plan.stash_slots == in_flight(s).max()


@pytest.mark.parametrize("p,m,v", FORWARD_ONLY, ids=lambda x: str(x))
def test_buffer_plan_of_forward_only(p, m, v):
    plan = check_plan(forward_only(p, m, v))
    assert (plan.tables.fwd_stash == EMPTY).all() and (plan.tables.fwd_head == EMPTY).all()


def test_buffer_check_catches_a_shared_slot():
    """The simulation fails when two stashes held at once share a slot (the check can fail)."""
    s = make_schedule("1f1b", 2, 4)
    plan = plan_buffers(s)
    stash = np.where(plan.tables.fwd_stash == EMPTY, EMPTY, 0)
    broken = type(plan)(type(plan.tables)(**{**vars(plan.tables), "fwd_stash": stash}),
                        plan.act_slots, plan.grad_slots, plan.stash_slots, plan.head_slots, plan.w_stash_slots)
    with pytest.raises(AssertionError, match="overwrites"):
        run_plan(s, broken)


# rendering ----------------------------------------------------------------------------------
def test_render_small_1f1b_by_hand():
    """p = 2, m = 2: stage 1 turns each micro-batch around within a tick; stage 0 gets B0 one tick later."""
    assert render(make_schedule("1f1b", 2, 2)).splitlines() == [
        "1f1b: p=2 stages, m=2 micro-batches, v=1 chunks | 4 ticks | time over ideal 1.500 | most in flight 2",
        "stage 0 | F0   F1   B0   B1",
        "stage 1 | .    F0B0 F1B1 .",
    ]


def test_render_interleaved_shows_chunks():
    lines = render(make_schedule("interleaved", 2, 2, 2)).splitlines()
    assert lines[1].split("|")[1].split()[:4] == ["F0a", "F1a", "F0b", "F1b"]


# the CLI ------------------------------------------------------------------------------------
def pipeline_cli(*args):
    return subprocess.run([sys.executable, "-m", "mtjax.pipeline", "show", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_cli_prints_timeline_then_cost_model():
    r = pipeline_cli("--schedule", "interleaved", "--stages", "4", "--micro-batches", "8", "--virtual-stages", "2")
    assert r.returncode == 0 and r.stderr == ""
    s = make_schedule("interleaved", 4, 8, 2)
    timeline, figures = r.stdout.split("\n\n")
    assert timeline == render(s)
    got = dict(line.split(": ") for line in figures.splitlines())
    assert (got["ticks"], got["max_in_flight"]) == (str(s.ticks), " ".join(map(str, in_flight(s))))
    assert float(got["time_over_ideal"]) == float(got["megatron_time_over_ideal"]) == 1 + 3 / 16
    assert float(got["bubble_fraction"]) == 3 / 16


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 3, 6, 1), ("interleaved", 2, 4, 3)])
@pytest.mark.parametrize("recompute", [False, True])
def test_cli_json(name, p, m, v, recompute):
    """One JSON object; the times in forward units (backward 2, or 3 recomputing) from the table."""
    r = pipeline_cli("--schedule", name, "--stages", str(p), "--micro-batches", str(m), "--virtual-stages", str(v),
                     "--json", *(["--recompute"] if recompute else []))
    assert r.returncode == 0 and r.stderr == ""
    got = json.loads(r.stdout)
    s, backward = make_schedule(name, p, m, v), 3 if recompute else 2
    ratio = lockstep_time_over_ideal(s, backward)
    busy = v * m * (1 + backward)
    assert got == {"schedule": name, "stages": p, "micro_batches": m, "virtual_stages": v, "ticks": s.ticks,
                   "recompute": recompute, "lockstep_time": ratio * busy, "stage_busy_time": busy,
                   "time_over_ideal": float(ratio), "bubble_fraction": float(ratio - 1),
                   "megatron_time_over_ideal": 1 + (p - 1) / (v * m),
                   "max_in_flight": [int(n) for n in in_flight(s)],
                   "costs": [1, 2, 0], "max_in_flight_cap": 0, "w_pending": [0] * p,
                   "slots_held": [int(n) for n in in_flight(s)]}


@pytest.mark.parametrize("args,message", [
    (["--stages", "0", "--micro-batches", "4"], "--stages: stages must be >= 1"),
    (["--stages", "4", "--micro-batches", "2"], "--micro-batches: micro-batches (2) must be >= stages (4)"),
    (["--stages", "2", "--micro-batches", "4", "--virtual-stages", "2"], "--virtual-stages: "),
    (["--schedule", "interleaved", "--stages", "2", "--micro-batches", "4", "--virtual-stages", "0"],
     "--virtual-stages: virtual stages must be >= 1"),
    (["--schedule", "interleaved", "--stages", "4", "--micro-batches", "6", "--virtual-stages", "2"],
     "--micro-batches: interleaving"),
    (["--schedule", "gpipe", "--stages", "4", "--micro-batches", "8", "--max-in-flight", "2"], "--max-in-flight: "),
    (["--schedule", "interleaved", "--stages", "2", "--micro-batches", "4"],
     "--virtual-stages: interleaved needs at least 2 chunks a stage"),
    (["--stages", "two", "--micro-batches", "4"], "invalid int value"),
    (["--stages", "2.5", "--micro-batches", "4"], "invalid int value"),
    (["--schedule", "zigzag", "--stages", "2", "--micro-batches", "4"], "invalid choice"),
    (["--micro-batches", "4"], "required"),
])
def test_cli_bad_arguments_exit_2_with_one_line(args, message):
    r = pipeline_cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: ") and message in r.stderr

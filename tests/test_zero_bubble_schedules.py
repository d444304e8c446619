"""Split (zb, zbv) and capped schedule tables: every property recomputed here from the raw int32 tables.

Notation: p stages, m micro-batches, v chunks per stage, N the cap (`max_in_flight`, 0 = none).
Chunk c of stage i is virtual stage j = c p + i ("loop" layout), or i / 2p - 1 - i for c = 0 / 1
("v" layout, zbv). F, B, W of (mb, j) are read off the forward, backward and weight slot tables.
Expected values are closed forms:
  ZB-H1's lower bound, time over one stage's busy time:
      (m(F + B + W) + (p - 1)(F + B - W)) / (m(F + B + W));
  Megatron's 1F1B memory: p - i micro-batches held on stage i (min(m, p - i)).
"""
import functools
import json
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from mtjax.pipeline.schedules import forward_only, make_schedule, render
from test_schedules import check_plan

EMPTY = -1
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COSTS = [(1, 1, 1), (1, 1, Fraction(1, 2)), (1, 2, 1), (2, 1, 1), (3, 4, 2)]   # all with W <= min(F, B)
SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in sorted({p, max(p, 2 * p - 2), 2 * p + 1, 4 * p})]
CASES = [(name, v, p, m, cap) for name, v in (("zb", 1), ("zbv", 1), ("1f1b", 1), ("interleaved", 2), ("gpipe", 1))
         for p, m in SIZES for cap in sorted({0, 1, max(1, p - 1), p, 2 * p})
         if not (name == "interleaved" and m % p)]


@functools.lru_cache(maxsize=None)
def build(name, v, p, m, cap, costs=None):
    """The table, or None where the schedule's order cannot meet the cap (ValueError, as documented)."""
    try:
        return make_schedule(name, p, m, v, cap, costs)
    except ValueError as e:
        assert cap > 0 and "too small" in str(e)
        return None


@pytest.fixture(params=CASES, ids=lambda c: "{}-v{}-p{}-m{}-cap{}".format(*c))
def case(request):
    name, v, p, m, cap = request.param
    return request.param, build(name, v, p, m, cap)


# reading the table --------------------------------------------------------------------------
def chunks_of(s):
    return 2 if s.layout == "v" else s.chunks


def virtual(s, i, c):
    p = s.stages
    return (i if c == 0 else 2 * p - 1 - i) if s.layout == "v" else c * p + i


def stage_of(s, j):
    p = s.stages
    return (j if j < p else 2 * p - 1 - j) if s.layout == "v" else j % p


def slot(s, kind):
    return {"F": (s.forward_mb, s.forward_chunk), "B": (s.backward_mb, s.backward_chunk),
            "W": (s.weight_mb, s.weight_chunk)}[kind]


def op_ticks(s, kind):
    """{(mb, j): tick} of one slot kind; fails if a (mb, j) runs twice."""
    mbs, chunks = slot(s, kind)
    at = {}
    for t, i in zip(*np.nonzero(mbs != EMPTY)):
        key = (int(mbs[t, i]), virtual(s, int(i), int(chunks[t, i])))
        assert key not in at, f"{kind}{key} runs at ticks {at[key]} and {t}"
        at[key] = int(t)
    return at


def held(s, start, end):
    """[ticks, p] items on each stage with start tick <= t <= end tick."""
    out = np.zeros((s.ticks, s.stages), np.int64)
    for key, t in start.items():
        out[t:end[key] + 1, stage_of(s, key[1])] += 1
    return out


def lockstep(s, costs):
    """sum_t max_i (F [forward] + B' [backward] + W [weight]) / one stage's busy time, where B' = B for
    split schedules and B + W (the whole backward) otherwise; exact (costs scaled to integers)."""
    f, b, w = (Fraction(x) for x in costs)
    backward = b if (s.weight_mb != EMPTY).any() else b + w
    scale = f.denominator * backward.denominator * w.denominator
    cost = sum(int(c * scale) * (table != EMPTY).astype(np.int64)
               for c, table in ((f, s.forward_mb), (backward, s.backward_mb), (w, s.weight_mb)))
    return Fraction(int(cost.max(axis=1).sum()), int(cost.sum(axis=0).max()))


def bound(p, m, costs):
    f, b, w = (Fraction(x) for x in costs)
    return (m * (f + b + w) + (p - 1) * (f + b - w)) / (m * (f + b + w))


# every table --------------------------------------------------------------------------------
def test_caps_that_can_be_met_are(case):
    """1f1b and zb run under any cap >= 1; zbv and interleaved at N >= p; gpipe only at N >= m."""
    (name, v, p, m, cap), s = case
    must = {"1f1b": 1, "zb": 1, "zbv": p, "interleaved": p, "gpipe": m}[name]
    assert s is not None or (0 < cap < must)


def test_every_f_b_and_w_runs_once(case):
    (name, v, p, m, cap), s = case
    if s is None:
        return
    pairs = {(mb, j) for mb in range(m) for j in range(chunks_of(s) * p)}
    assert set(op_ticks(s, "F")) == pairs and set(op_ticks(s, "B")) == pairs
    assert set(op_ticks(s, "W")) == (pairs if name in ("zb", "zbv") else set())
    for kind in "FBW":
        mbs, chunks = slot(s, kind)
        assert mbs.dtype == np.int32 and mbs.shape == (s.ticks, p) and not mbs.flags.writeable
        assert ((mbs == EMPTY) == (chunks == EMPTY)).all()


def test_dependency_order(case):
    """F(mb, j) < F(mb, j + 1); F(mb, last) <= B(mb, last); B(mb, j + 1) < B(mb, j); B(mb, j) <= W(mb, j)."""
    (name, v, p, m, cap), s = case
    if s is None:
        return
    f, b, w, last = op_ticks(s, "F"), op_ticks(s, "B"), op_ticks(s, "W"), chunks_of(s) * p - 1
    for mb in range(m):
        assert f[mb, last] <= b[mb, last]
        for j in range(last):
            assert f[mb, j] < f[mb, j + 1] and b[mb, j + 1] < b[mb, j]
        for j in range(last + 1):
            assert (mb, j) not in w or b[mb, j] <= w[mb, j]


def test_sends_match_receives(case):
    """Each activation (gradient) a stage sends goes to the stage of the next (previous) virtual
    stage, which reads it exactly once, at a later tick; nothing is read that was not sent."""
    (name, v, p, m, cap), s = case
    if s is None:
        return
    last = chunks_of(s) * p - 1
    for kind, step in (("F", 1), ("B", -1)):
        ticks = op_ticks(s, kind)
        sent = {(stage_of(s, j), stage_of(s, j + step), mb, j + step): t for (mb, j), t in ticks.items()
                if 0 <= j + step <= last}
        read = {(stage_of(s, j - step), stage_of(s, j), mb, j): t for (mb, j), t in ticks.items()
                if 0 <= j - step <= last}
        assert sent.keys() == read.keys()
        assert all(sent[k] < read[k] for k in sent)


def test_in_flight_respects_the_cap_and_is_reported(case):
    """Stashes held (F run, backward not finished: B unsplit, W split) per stage stay within N v;
    `max_in_flight` (F run, B not finished), `w_pending` (B run, W not finished) and `slots_held`
    are what the table holds."""
    (name, v, p, m, cap), s = case
    if s is None:
        return
    stash = held(s, op_ticks(s, "F"), op_ticks(s, "B")).max(axis=0)
    assert list(s.max_in_flight()) == list(stash)
    if cap:
        assert (stash <= cap * chunks_of(s)).all() and s.max_in_flight_cap == cap
    w = op_ticks(s, "W")
    pending = held(s, op_ticks(s, "B"), w).max(axis=0) if w else np.zeros(p, np.int64)
    assert list(s.w_pending()) == list(pending)
    until_w = held(s, op_ticks(s, "F"), w).max(axis=0) if w else stash
    assert list(s.slots_held()) == list(until_w)
    if cap:
        assert (until_w <= cap * chunks_of(s)).all()


def test_buffer_plan_never_overwrites_a_value_still_needed(case):
    """The executor's slot tables (`buffers.plan_buffers`) run in the executor's order, channels
    and the V's turn included, with as many slots as values held at once: a stash slot per
    micro-batch waiting for B, a W-stash slot per micro-batch waiting for W."""
    _, s = case
    if s is None:
        return
    plan = check_plan(s)
    assert plan.stash_slots == s.max_in_flight().max() and plan.w_stash_slots == max(1, s.w_pending().max())
    if s.split:   # one ring, each slot held from F to W: as many as `slots_held` counts, within the cap
        shared = check_plan(s, shared_stash=True)
        assert shared.shared_stash and shared.stash_slots == s.slots_held().max()


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 8)])
def test_zbv_evaluation_runs_the_v(p, m):
    """Evaluation on a zbv layout: zbv's forward order in its V, every slot table consistent."""
    s = forward_only(p, m, 2, "v")
    assert s.layout == "v" and not s.has_backward
    assert set(op_ticks(s, "F")) == {(mb, j) for mb in range(m) for j in range(2 * p)}
    check_plan(s)


def test_time_over_ideal_is_the_lockstep_time_of_the_table(case):
    (name, v, p, m, cap), s = case
    if s is None:
        return
    for costs in COSTS:
        assert s.time_over_ideal(costs=costs) == lockstep(s, costs)


# ZB-H1 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("costs", COSTS, ids=str)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_zb_meets_the_bound_when_m_is_at_least_2p_minus_2(p, costs):
    """Within 2% of (m(F + B + W) + (p - 1)(F + B - W)) / m(F + B + W) (it is exactly that) for
    m >= 2p - 2, with no cap, a cap >= 2p - 1 (1F1B's own memory), and at Megatron's memory N = p
    when F = B."""
    caps = [0, 2 * p - 1, 3 * p] + ([p] if costs[0] == costs[1] else [])
    for m in range(max(p, 2 * p - 2), 4 * p + 3):
        for cap in caps:
            s = make_schedule("zb", p, m, 1, cap, costs)
            got = lockstep(s, costs)
            assert got <= Fraction(102, 100) * bound(p, m, costs), (m, cap, float(got), float(bound(p, m, costs)))


@pytest.mark.parametrize("costs", [(1, 1, 1), (1, 1, Fraction(1, 2))], ids=str)
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_keeps_megatrons_memory_when_f_equals_b(p, costs):
    """Uncapped or at N = p: stage i holds min(m, p - i) micro-batches waiting for B, as Megatron's
    asynchronous 1F1B; at N = p no stage holds more than p until W (one ring of p slots)."""
    for m in (p, 2 * p - 1, 2 * p, 4 * p):
        for cap in (0, p):
            s = make_schedule("zb", p, m, 1, cap, costs)
            assert list(held(s, op_ticks(s, "F"), op_ticks(s, "B")).max(axis=0)) == [min(m, p - i) for i in range(p)]
            if cap:
                assert held(s, op_ticks(s, "F"), op_ticks(s, "W")).max() <= p


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_1f1b_at_cap_p_keeps_megatrons_memory_from_m_2p(p):
    """Megatron's order, one F or B per tick, holds p - i; at m = p a capped lockstep table is faster."""
    for m in (2 * p, 4 * p):
        s = make_schedule("1f1b", p, m, 1, p)
        assert list(s.max_in_flight()) == [p - i for i in range(p)]


def test_zb_below_2p_minus_2_is_still_no_worse_than_1f1b():
    """Where the bound is not promised (m < 2p - 2), zb is never slower than 1F1B at the same costs."""
    for p in range(3, 9):
        for m in range(p, 2 * p - 2):
            for costs in COSTS:
                assert lockstep(make_schedule("zb", p, m, 1, 0, costs), costs) <= \
                    lockstep(make_schedule("1f1b", p, m, 1, 0, costs), costs)


def test_unsplit_backward_costs_b_plus_w():
    s = make_schedule("1f1b", 4, 8)
    assert s.time_over_ideal(costs=(1, 1, 1)) == s.time_over_ideal(costs=(1, 2)) == s.time_over_ideal()


# ZB-V --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 8), (8, 8), (8, 32)])
def test_zbv_layout_and_memory(p, m):
    """Stage i holds virtual stages i and 2p - 1 - i, stage 0 computes the loss, and no stage holds
    more than 2p chunk stashes: p micro-batches' worth of a whole stage, Megatron's stage-0 memory."""
    s = make_schedule("zbv", p, m)
    assert (s.layout, s.chunks) == ("v", 2)
    b = op_ticks(s, "B")
    assert all(s.backward_mb[t, 0] == mb and s.backward_chunk[t, 0] == 1 for (mb, j), t in b.items() if j == 2 * p - 1)
    assert s.max_in_flight().max() <= 2 * p


# rendering and the CLI ---------------------------------------------------------------------
def test_render_small_zb_by_hand():
    """p = 2, m = 2: stage 1 turns micro-batches around; W0 fits beside B0 on stage 0 (stage 1's F1 B1
    sets the tick), W1 waits for a W-only tick, as do stage 1's."""
    assert render(make_schedule("zb", 2, 2)).splitlines() == [
        "zb: p=2 stages, m=2 micro-batches, v=1 chunks | 5 ticks | time over ideal 1.167 | most in flight 2 "
        "| most W-pending 2",
        "stage 0 | F0   F1   B0W0 B1   W1",
        "stage 1 | .    F0B0 F1B1 W0   W1",
    ]


def pipeline_cli(*args):
    return subprocess.run([sys.executable, "-m", "mtjax.pipeline", "show", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_cli_split_schedule_json():
    r = pipeline_cli("--schedule", "zb", "--stages", "4", "--micro-batches", "8", "--costs", "1,1,0.5",
                     "--max-in-flight", "4", "--json")
    assert r.returncode == 0 and r.stderr == ""
    got, costs = json.loads(r.stdout), (1, 1, Fraction(1, 2))
    s = make_schedule("zb", 4, 8, 1, 4, costs)
    assert got["time_over_ideal"] == float(lockstep(s, costs)) == float(bound(4, 8, costs)) == got["zb_lower_bound"]
    assert (got["costs"], got["max_in_flight_cap"], got["max_in_flight"]) == ([1, 1, 0.5], 4, [4, 3, 2, 1])
    assert got["w_pending"] == [int(n) for n in held(s, op_ticks(s, "B"), op_ticks(s, "W")).max(axis=0)]
    assert got["slots_held"] == [int(n) for n in held(s, op_ticks(s, "F"), op_ticks(s, "W")).max(axis=0)]
    assert got["lockstep_time"] == float(lockstep(s, costs) * 8 * Fraction(5, 2))


def test_cli_prints_the_timeline_with_ws():
    r = pipeline_cli("--schedule", "zbv", "--stages", "2", "--micro-batches", "2")
    assert r.returncode == 0 and r.stderr == ""
    timeline, figures = r.stdout.split("\n\n")
    assert timeline == render(make_schedule("zbv", 2, 2)) and "W0a" in timeline
    assert "time_over_ideal: " in figures and "w_pending: " in figures


@pytest.mark.parametrize("args,message", [
    (["--schedule", "zb", "--costs", "1,2"], "give F,B,W"),
    (["--costs", "1,x,1"], "--costs: costs must be numbers"),
    (["--costs", "1,0,1"], "F > 0, B > 0"),
    (["--costs", "1,1,1,1"], "F,B or F,B,W"),
    (["--costs", "4e18,1,1"], "--costs: costs are too large or too finely divided"),     # int64 sums wrapped
    (["--costs", "1e400,1,1"], "--costs: costs are too large or too finely divided"),    # was a traceback
    (["--max-in-flight", "-1"], "--max-in-flight: must be >= 0"),
    (["--schedule", "gpipe", "--max-in-flight", "2"], "too small"),
    (["--schedule", "zbv", "--virtual-stages", "2"], "zbv always has 2 chunks"),
    (["--schedule", "zb", "--stages", "65", "--micro-batches", "65"], "--stages: at most 64"),
    (["--costs", "-1,2"], "--costs: costs need F > 0"),             # was: --costs expected one argument
    # tables of minutes (millions of cells: 1F1B at p = 1024, m = 16384; zb under a cap of 1, each
    # micro-batch alone on the pipe) were built, within each flag's own limit
    (["--stages", "1024", "--micro-batches", "16384"], "--micro-batches: a table of about"),
    (["--schedule", "zb", "--stages", "64", "--micro-batches", "512", "--max-in-flight", "1"], "or a larger cap"),
])
def test_cli_bad_arguments_exit_2_with_one_line(args, message):
    base = [] if "--stages" in args else ["--stages", "2", "--micro-batches", "4"]
    r = pipeline_cli(*base, *args)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: ") and message in r.stderr


def test_final_backlogs_follow_the_recurrence():
    """`place_weights`'s W's left at the end after tick t, read off prefix sums once, equal the
    recurrence b_n = max(b_{n-1} + step_n, 0) run over the later ticks (as each tick once did)."""
    from mtjax.pipeline.zero_bubble import _Backlogs
    rng = np.random.default_rng(0)
    step = rng.integers(-1, 2, (40, 3))
    backlogs = _Backlogs(step)
    for t in range(40):
        start = rng.integers(0, 4, 3)
        b = start.copy()
        for row in step[t + 1:]:
            b = np.maximum(b + row, 0)
        assert (backlogs.final(start, t) == b).all(), t

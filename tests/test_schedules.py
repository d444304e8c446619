"""Pipeline schedule tables: each property is recomputed here from the table, not taken from the builder.

Expected values come from the closed forms: ticks 2(m·v + p − 1), a bubble of
(p − 1)/m for GPipe and 1F1B and (p − 1)/(v·m) interleaved, at most p micro-batches
in flight for 1F1B and m for GPipe.
"""
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from mtjax.pipeline.__main__ import main as cli_main
from mtjax.pipeline.schedules import BACKWARD, FORWARD, IDLE, make_schedule, render

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [("gpipe", p, m, 1) for p in (1, 2, 3, 4) for m in (p, 2 * p, 3 * p)]
CASES += [("1f1b", p, m, 1) for p in (1, 2, 3, 4) for m in (p, 2 * p, 3 * p)]
CASES += [("interleaved", p, m, v) for p in (1, 2, 3, 4) for m in (p, 2 * p, 3 * p) for v in (2, 3)]


def op_ticks(s):
    """{(action, mb, virtual stage j): [ticks]} read off the table; j = chunk·p + stage."""
    found = {}
    for t, i in zip(*np.nonzero(s.action != IDLE)):
        key = (int(s.action[t, i]), int(s.micro_batch[t, i]), int(s.chunk[t, i]) * s.stages + int(i))
        found.setdefault(key, []).append(int(t))
    return found


def stage_ops(s, i):
    """Stage i's non-idle operations in time order, as (letter, mb, chunk)."""
    return [("F" if s.action[t, i] == FORWARD else "B", int(s.micro_batch[t, i]), int(s.chunk[t, i]))
            for t in range(s.ticks) if s.action[t, i] != IDLE]


def warmup(name, p, m, v, i):
    """Megatron's warm-up forward count for stage i."""
    return {"gpipe": m, "1f1b": min(p - i - 1, m), "interleaved": min((p - i - 1) * 2 + (v - 1) * p, m * v)}[name]


@pytest.fixture(params=CASES, ids=lambda c: "{}-p{}-m{}-v{}".format(*c))
def case(request):
    name, p, m, v = request.param
    return request.param, make_schedule(name, p, m, v)


def test_table_shapes_and_idle_markers(case):
    (name, p, m, v), s = case
    assert (s.name, s.stages, s.micro_batches, s.chunks) == (name, p, m, v)
    for a in (s.action, s.micro_batch, s.chunk):
        assert a.dtype == np.int32 and a.shape == (s.ticks, p) and not a.flags.writeable
    idle = s.action == IDLE
    assert (s.micro_batch[idle] == -1).all() and (s.chunk[idle] == -1).all()
    assert ((s.chunk[~idle] >= 0) & (s.chunk[~idle] < v)).all()


def test_each_micro_batch_chunk_runs_forward_and_backward_once_per_stage(case):
    (_, p, m, v), s = case
    assert sorted(op_ticks(s)) == sorted((a, mb, j) for a in (FORWARD, BACKWARD)
                                         for mb in range(m) for j in range(v * p))
    assert all(len(ticks) == 1 for ticks in op_ticks(s).values())


def test_dependencies_hold(case):
    """Forward flows up the virtual stages, backward down them, each hop at least one tick later."""
    (_, p, m, v), s = case
    at = {k: ticks[0] for k, ticks in op_ticks(s).items()}
    last = v * p - 1
    for mb in range(m):
        for j in range(v * p):
            assert at[(FORWARD, mb, j)] < at[(BACKWARD, mb, j)]  # on the stage that holds j
        for j in range(last):
            assert at[(FORWARD, mb, j)] < at[(FORWARD, mb, j + 1)]
            assert at[(BACKWARD, mb, j + 1)] < at[(BACKWARD, mb, j)]


def test_megatron_operation_order(case):
    """Warm-up forwards, then one forward one backward, then the remaining backwards; micro-batches in groups of p."""
    (name, p, m, v), s = case
    n = m * v
    forwards = [(mb, c) for g in range(m // p) for c in range(v) for mb in range(g * p, g * p + p)]
    backwards = [(mb, v - 1 - c) for mb, c in forwards]  # with v = 1: micro-batches 0..m-1 in order
    for i in range(p):
        ops = stage_ops(s, i)
        w = warmup(name, p, m, v, i)
        assert "".join(a for a, _, _ in ops) == "F" * w + "FB" * (n - w) + "B" * w
        assert [(mb, c) for a, mb, c in ops if a == "F"] == forwards
        assert [(mb, c) for a, mb, c in ops if a == "B"] == backwards


def test_no_avoidable_idle(case):
    """A stage idles only while its next operation's input has not arrived (the table is as early as possible)."""
    (_, p, m, v), s = case
    at = {k: ticks[0] for k, ticks in op_ticks(s).items()}
    last = v * p - 1
    for i in range(p):
        busy = [t for t in range(s.ticks) if s.action[t, i] != IDLE]
        for t in range(busy[-1]):
            if s.action[t, i] != IDLE:
                continue
            nxt = next(u for u in busy if u > t)
            a, mb, j = int(s.action[nxt, i]), int(s.micro_batch[nxt, i]), int(s.chunk[nxt, i]) * p + i
            dep = ((FORWARD, mb, j - 1) if a == FORWARD else
                   (BACKWARD, mb, j + 1) if j < last else (FORWARD, mb, j))
            assert a == FORWARD and j == 0 or at[dep] >= t, f"stage {i} idles at tick {t} with {dep} done"


def test_ticks_and_bubble(case):
    (name, p, m, v), s = case
    assert s.ticks == 2 * (m * v + p - 1)
    assert ((s.action != IDLE).sum(axis=0) == 2 * m * v).all()
    assert ((s.action == IDLE).sum(axis=0) == 2 * (p - 1)).all()  # every stage idles the same
    assert s.bubble_fraction == Fraction(p - 1, v * m)
    assert s.idle_fraction == Fraction(p - 1, m * v + p - 1)


def test_in_flight(case):
    """Activations stashed per stage: m for GPipe, p - i for 1F1B (at most p), warm-up + 1 interleaved."""
    (name, p, m, v), s = case
    got = s.max_in_flight()
    assert got.shape == (p,)
    if name == "gpipe":
        assert (got == m).all()
    elif name == "1f1b":
        assert list(got) == [p - i for i in range(p)] and got.max() <= p
    else:
        assert list(got) == [min(warmup(name, p, m, v, i) + 1, m * v) for i in range(p)]


def test_timeline_rows_match_table(case):
    _, s = case
    rows = s.timeline()
    assert len(rows) == s.ticks * s.stages
    for r in rows:
        t, i = r["tick"], r["stage"]
        assert r["action"] == {IDLE: "-", FORWARD: "F", BACKWARD: "B"}[int(s.action[t, i])]
        assert (r["micro_batch"], r["chunk"]) == (s.micro_batch[t, i], s.chunk[t, i])


def test_render_small_1f1b_by_hand():
    """p=2, m=2: stage 1 runs F0 B0 F1 B1 from tick 1; stage 0 waits one tick for each gradient."""
    assert render(make_schedule("1f1b", 2, 2)).splitlines()[1:] == [
        "stage 0 | F0 F1 .  B0 .  B1",
        "stage 1 | .  F0 B0 F1 B1 .",
    ]


def test_render_interleaved_shows_chunks():
    s = make_schedule("interleaved", 2, 2, 2)
    lines = render(s).splitlines()
    assert "10 ticks" in lines[0] and "bubble 1/4" in lines[0]
    assert lines[1].split("|")[1].split()[:4] == ["F0a", "F1a", "F0b", "F1b"]


@pytest.mark.parametrize("args", [
    ("gpipe", 4, 3, 1),          # m < p
    ("1f1b", 0, 1, 1),           # p < 1
    ("interleaved", 4, 6, 2),    # m not a multiple of p
    ("interleaved", 2, 4, 0),    # v < 1
    ("1f1b", 2, 4, 2),           # v > 1 without interleaving
    ("zigzag", 2, 4, 1),
])
def test_invalid_sizes_raise_one_line(args):
    with pytest.raises(ValueError) as e:
        make_schedule(*args)
    assert "\n" not in str(e.value) and str(e.value)


def pipeline_cli(*args):
    return subprocess.run([sys.executable, "-m", "mtjax.pipeline", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_cli_prints_timeline():
    r = pipeline_cli("show", "--schedule", "interleaved", "--stages", "4", "--micro-batches", "8",
                     "--virtual-stages", "2")
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.rstrip("\n") == render(make_schedule("interleaved", 4, 8, 2))
    assert [line.split("|")[0].strip() for line in r.stdout.splitlines()[1:]] == [f"stage {i}" for i in range(4)]


@pytest.mark.parametrize("args", [
    ["show", "--schedule", "zigzag", "--stages", "2", "--micro-batches", "4"],
    ["show", "--stages", "two", "--micro-batches", "4"],
    ["show", "--stages", "4", "--micro-batches", "2"],
    ["show", "--schedule", "interleaved", "--stages", "4", "--micro-batches", "6", "--virtual-stages", "2"],
    ["show", "--schedule", "1f1b", "--stages", "2", "--micro-batches", "4", "--virtual-stages", "2"],
    [],
])
def test_cli_bad_arguments_exit_2_with_one_line(args, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(args)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ")


def test_cli_bad_arguments_in_a_subprocess():
    r = pipeline_cli("show", "--stages", "4", "--micro-batches", "2")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["error: micro-batches (2) must be >= stages (4)"]

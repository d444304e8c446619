"""Tests for mtjax.hlo_report: exact collective counts, bytes and mesh axes.

Programs are jitted shard_maps on a (data=2, pipe=2, tensor=2) mesh of 8 CPU
devices. Device position i on that mesh sits at coordinates (d, p, t) with
i = 4d + 2p + t, which is how the hand-derived replica groups below are obtained.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from mtjax.hlo_report import (collective_report, compiled_report, flops_report, group_axes,
                              memory_report, parse_replica_groups, select)

B, H = 8, 4  # global input [b, h]; sharded over 'data' -> local [b/2, h]
LOCAL_ELEMS = (B // 2) * H


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("data", "pipe", "tensor"), axis_types=(AxisType.Auto,) * 3)


def _hlo_text(mesh, body, dtype=jnp.float32):
    """Compiled HLO of jit(shard_map(body)) on a [B, H] input split over 'data'."""
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                              check_vma=False))
    return f.lower(jnp.ones((B, H), dtype)).compile().as_text()


def _report(mesh, body, dtype=jnp.float32):
    return collective_report(_hlo_text(mesh, body, dtype), mesh)


def test_psum_in_scan_counts_every_iteration(mesh):
    steps = 3

    def body(x):
        return lax.scan(lambda c, _: (lax.psum(c, "tensor") * 0.5, None), x, None, length=steps)[0]

    r = _report(mesh, body)
    [op] = select(r, kind="all-reduce")
    assert op["axes"] == ("tensor",) and op["multiplicity"] == steps
    assert op["elements"] == LOCAL_ELEMS and op["bytes"] == LOCAL_ELEMS * 4
    assert r["by_kind"] == {"all-reduce": {"count": steps, "bytes": steps * LOCAL_ELEMS * 4}}
    assert r["by_axes"] == {"tensor": r["by_kind"]}
    assert r["unknown_trip_counts"] == []


def test_nested_scans_multiply(mesh):
    outer, inner = 2, 3

    def body(x):
        def outer_step(c, _):
            step = lambda d, _: (lax.psum(d, "tensor") * 0.5, None)
            return lax.scan(step, c, None, length=inner)[0], None
        return lax.scan(outer_step, x, None, length=outer)[0]

    r = _report(mesh, body)
    [op] = select(r, kind="all-reduce", axes=("tensor",))
    assert op["multiplicity"] == outer * inner
    assert r["by_kind"]["all-reduce"] == {"count": outer * inner,
                                          "bytes": outer * inner * LOCAL_ELEMS * 4}


# (collective, kind, axes, full-tensor elements per execution)
CASES = [
    (lambda x: lax.all_gather(x, "data", tiled=True), "all-gather", ("data",), 2 * LOCAL_ELEMS),
    (lambda x: lax.psum_scatter(x, "data", tiled=True), "reduce-scatter", ("data",), LOCAL_ELEMS),
    (lambda x: lax.ppermute(x, "pipe", [(0, 1), (1, 0)]), "collective-permute", ("pipe",),
     LOCAL_ELEMS),
    (lambda x: lax.all_to_all(x, "tensor", 0, 0, tiled=True), "all-to-all", ("tensor",),
     LOCAL_ELEMS),
    (lambda x: lax.psum(x, ("data", "tensor")), "all-reduce", ("data", "tensor"), LOCAL_ELEMS),
]


@pytest.mark.parametrize("collective,kind,axes,elements", CASES, ids=[c[1] for c in CASES])
def test_single_collective(mesh, collective, kind, axes, elements):
    r = _report(mesh, collective)
    [op] = select(r, kind=kind)
    assert op["axes"] == axes and op["dtype"] == "f32"
    assert op["elements"] == elements and op["bytes"] == 4 * elements
    assert r["by_kind"] == {kind: {"count": 1, "bytes": 4 * elements}}
    assert r["by_axes"] == {",".join(axes): r["by_kind"]}


@pytest.mark.parametrize("dtype,hlo_dtype", [(jnp.float16, "f16"), (jnp.int8, "s8"),
                                             (jnp.int32, "s32"), (jnp.bool_, "pred")])
def test_all_gather_bytes_follow_dtype(mesh, dtype, hlo_dtype):
    [op] = select(_report(mesh, lambda x: lax.all_gather(x, "data", tiled=True), dtype),
                  kind="all-gather")
    assert op["shapes"] == [f"{hlo_dtype}[{B},{H}]"]  # gathered back to the global batch
    assert op["dtype"] == hlo_dtype and op["elements"] == 2 * LOCAL_ELEMS
    assert op["bytes"] == 2 * LOCAL_ELEMS * jnp.dtype(dtype).itemsize


def test_bf16_halves_bytes(mesh):
    # XLA:CPU promotes bf16 collectives to f32 before sending them, so a bf16
    # program cannot show bf16 traffic here; retype a real f32 program instead.
    f32_text = _hlo_text(mesh, lambda x: lax.psum(x, "tensor"))
    [f32] = select(collective_report(f32_text, mesh), kind="all-reduce")
    [bf16] = select(collective_report(f32_text.replace("f32[", "bf16["), mesh), kind="all-reduce")
    assert (f32["dtype"], bf16["dtype"]) == ("f32", "bf16")
    assert bf16["elements"] == f32["elements"] == LOCAL_ELEMS
    assert 2 * bf16["bytes"] == f32["bytes"] == 4 * LOCAL_ELEMS


def test_select_filters(mesh):
    r = _report(mesh, lambda x: lax.psum(lax.all_gather(x, "data", tiled=True), "tensor"))
    assert len(select(r)) == 2
    assert [o["kind"] for o in select(r, axes=("tensor",))] == ["all-reduce"]
    assert [o["kind"] for o in select(r, min_elements=2 * LOCAL_ELEMS)] == ["all-gather",
                                                                             "all-reduce"]
    assert select(r, min_elements=2 * LOCAL_ELEMS + 1) == []


def test_iota_and_explicit_replica_groups(mesh):
    tensor_groups = [[0, 1], [2, 3], [4, 5], [6, 7]]  # t varies, 4d + 2p fixed
    data_groups = [[0, 4], [1, 5], [2, 6], [3, 7]]  # d varies
    assert parse_replica_groups("[4,2]<=[8]") == tensor_groups
    # arange(8).reshape(4,2).T = [[0,2,4,6],[1,3,5,7]]: d and p vary, t fixed.
    assert parse_replica_groups("[2,4]<=[4,2]T(1,0)") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # [d,p,t] transposed to [p,t,d]: rows indexed by (p, t), columns by d.
    assert parse_replica_groups("[4,2]<=[2,2,2]T(1,2,0)") == data_groups
    assert parse_replica_groups("{{0,1},{2,3},{4,5},{6,7}}") == tensor_groups
    assert parse_replica_groups("{}") == []
    assert group_axes(tensor_groups, mesh) == ("tensor",)
    assert group_axes(data_groups, mesh) == ("data",)
    assert group_axes([[0, 2, 4, 6], [1, 3, 5, 7]], mesh) == ("data", "pipe")
    assert group_axes([[i] for i in range(8)], mesh) == ()
    with pytest.raises(ValueError):
        group_axes([[0, 8]], mesh)


def test_memory_and_flops_of_matmul():
    m, k, n = 8, 16, 32
    compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((m, k)), jnp.ones((k, n))).compile()
    flops = flops_report(compiled)
    assert flops["flops"] == pytest.approx(2 * m * n * k, rel=0.05)
    assert flops["bytes_accessed"] >= 4 * (m * k + k * n + m * n)
    mem = memory_report(compiled)
    assert mem["argument_bytes"] == 4 * (m * k + k * n)
    assert mem["output_bytes"] == 4 * m * n
    assert min(mem.values()) >= 0
    assert mem["peak_estimate_bytes"] == (mem["argument_bytes"] + mem["output_bytes"]
                                          + mem["temp_bytes"] - mem["alias_bytes"])


def test_compiled_report_combines(mesh):
    f = jax.jit(jax.shard_map(lambda x: lax.psum(x, "pipe"), mesh=mesh, in_specs=P("data"),
                              out_specs=P("data"), check_vma=False))
    r = compiled_report(f.lower(jnp.ones((B, H))).compile(), mesh)
    assert set(r) == {"flops", "memory", "collectives", "fusion", "copies"}
    assert r["collectives"]["by_axes"] == {"pipe": {"all-reduce": {"count": 1,
                                                                  "bytes": 4 * LOCAL_ELEMS}}}
    np.testing.assert_equal(r["memory"]["argument_bytes"], 4 * LOCAL_ELEMS)


# Hand-written HLO with what XLA:CPU does not emit: async start/done pairs, an
# async-start wrapper, a combined (tuple) all-reduce, a conditional, a while
# without a trip count, a shared callee, and "body=" inside a quoted string.
SYNTHETIC_HLO = """\
HloModule synthetic, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%helper (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add, metadata={op_name="x/body=%fake"}
}

%branch_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %cp-start = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%p), channel_id=2, source_target_pairs={{0,2},{2,0},{1,3},{3,1},{4,6},{6,4},{5,7},{7,5}}
  ROOT %cp-done = f32[4]{0} collective-permute-done(%cp-start)
}

%branch_b (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} call(%p), to_apply=%helper
}

%rs_wrapped (p: f32[8]) -> f32[4] {
  %p = f32[8]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%p), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %y = f32[4]{0} call(%x), to_apply=%helper
  %v = bf16[2,4]{1,0} parameter(1)
  %ag-start = (bf16[2,4]{1,0}, bf16[4,4]{1,0}) all-gather-start(%v), channel_id=4, replica_groups=[4,2]<=[2,2,2]T(1,2,0), dimensions={0}, use_global_device_ids=true
  %ag-done = bf16[4,4]{1,0} all-gather-done(%ag-start)
  %w = f32[8]{0} parameter(2)
  %rs-start = ((f32[8]{0}), f32[4]{0}) async-start(%w), calls=%rs_wrapped
  %rs-done = f32[4]{0} async-done(%rs-start), calls=%rs_wrapped
  ROOT %out = (s32[], f32[4]{0}) tuple(%i, %y)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %i_sum = s32[] all-reduce(%i), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%i_sum, %five), direction=LT
}

%body2 (t: (s32[], u8[16])) -> (s32[], u8[16]) {
  %t = (s32[], u8[16]{0}) parameter(0)
  %u = u8[16]{0} get-tuple-element(%t), index=1
  %ar-start = u8[16]{0} all-reduce-start(%u), channel_id=6, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
  %ar-done = u8[16]{0} all-reduce-done(%ar-start)
  ROOT %out = (s32[], u8[16]{0}) tuple(%i, %ar-done)
}

%cond2 (t: (s32[], u8[16])) -> pred[] {
  %t = (s32[], u8[16]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[4], y: f32[8], q: s32[]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %y = f32[8]{0} parameter(1)
  %q = s32[] parameter(2)
  %t0 = (s32[], f32[4]{0}) tuple(%q, %x)
  %loop = (s32[], f32[4]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %t1 = (s32[], u8[16]{0}) tuple(%q, %q)
  %loop2 = (s32[], u8[16]{0}) while(%t1), condition=%cond2, body=%body2
  %c = f32[4]{0} call(%x), to_apply=%helper
  %br = f32[4]{0} conditional(%q, %x, %x), branch_computations={%branch_a, %branch_b}
  ROOT %ar2 = (f32[4]{0}, f32[8]{0}) all-reduce(%x, %y), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
}
"""


def test_synthetic_hlo_multiplicities_async_and_tuples(mesh):
    trips = 5
    r = collective_report(SYNTHETIC_HLO, mesh)
    ops = {op["name"]: op for op in r["ops"]}
    assert set(ops) == {"ar", "cp-start", "rs", "ag-start", "i_sum", "ar-start", "ar2"}
    # helper is called from the loop body (trips), from ENTRY (1) and from branch_b (1).
    assert ops["ar"]["multiplicity"] == trips + 2 and ops["ar"]["in_conditional"]
    assert ops["ar"]["axes"] == ("tensor",) and ops["ar"]["bytes"] == 4 * 4
    assert ops["cp-start"]["axes"] == ("pipe",) and ops["cp-start"]["in_conditional"]
    assert (ops["cp-start"]["shapes"], ops["cp-start"]["multiplicity"]) == (["f32[4]"], 1)
    # all-gather: result of the -done, bf16[4,4]; data groups from the iota form.
    ag = ops["ag-start"]
    assert (ag["axes"], ag["dtype"], ag["elements"], ag["bytes"]) == (("data",), "bf16", 16, 32)
    assert ag["multiplicity"] == trips and not ag["in_conditional"]
    # reduce-scatter in an async wrapper: operand f32[8] = result f32[4] x group of 2.
    assert (ops["rs"]["elements"], ops["rs"]["bytes"], ops["rs"]["multiplicity"]) == (8, 32, trips)
    # The loop condition runs once more than the body.
    assert ops["i_sum"]["multiplicity"] == trips + 1
    assert ops["i_sum"]["axes"] == ("data", "pipe", "tensor")
    # Unknown trip count: counted once and listed.
    assert ops["ar-start"]["multiplicity"] == 1 and ops["ar-start"]["axes"] == ()
    assert ops["ar-start"]["bytes"] == 16
    assert r["unknown_trip_counts"] == [{"computation": "main", "while": "loop2"}]
    # Combined all-reduce: one collective, members summed and listed.
    assert ops["ar2"]["shapes"] == ["f32[4]", "f32[8]"] and ops["ar2"]["bytes"] == 4 * (4 + 8)
    all_reduce = r["by_kind"]["all-reduce"]
    assert all_reduce["count"] == (trips + 2) + (trips + 1) + 1 + 1
    assert all_reduce["bytes"] == (trips + 2) * 16 + (trips + 1) * 4 + 16 + 48
    assert r["by_axes"][""] == {"all-reduce": {"count": 1, "bytes": 16}}


# Fusion ----------------------------------------------------------------------------------------
# A loop of 3 iterations whose body has one kLoop fusion (exp and multiply inside it: fused) and
# three elementwise ops XLA left outside (the counter's add, tanh, add); the condition's compare
# runs 4 times, and the ENTRY negates once.
UNFUSED_HLO = """HloModule m

%fused_exp (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%p0)
  ROOT %m = f32[4]{0} multiply(%e, %p0)
}

%body (arg: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[4]{0} get-tuple-element(%arg), index=1
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_exp
  %y = f32[4]{0} tanh(%f)
  %z = f32[4]{0} add(%y, %x)
  ROOT %t = (s32[], f32[4]{0}) tuple(%i1, %z)
}

%cond (arg: (s32[], f32[4])) -> pred[] {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %x)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[4]{0} get-tuple-element(%w), index=1
  ROOT %neg = f32[4]{0} negate(%out)
}
"""


def test_fusion_report_counts_a_hand_written_program():
    from mtjax.hlo_report import fusion_report
    r = fusion_report(UNFUSED_HLO)
    (loop,) = r["loops"]
    assert (loop["body"], loop["trip_count"], loop["executions"], loop["nested_loops"]) == ("body", 3, 3, 0)
    assert loop["fusions"] == {"kLoop": 1} and loop["unfused_elementwise"] == {"add": 2, "tanh": 1}
    assert r["program"]["fusions"] == {"kLoop": 3}
    assert r["program"]["unfused_elementwise"] == {"add": 6, "compare": 4, "negate": 1, "tanh": 3}
    assert r["program"]["unfused_elementwise_count"] == 14


@pytest.fixture(scope="module")
def inspected():
    """(trainer, its inspect report): the tiny GPT on tensor = 2 with SP, compiled once."""
    from layouts import build, tiny_config
    from mtjax.inspect import report
    trainer = build(tiny_config(tensor=2, sp=True), 1, 1, 2)
    return trainer, report(trainer)


def test_inspect_reports_the_fusions_of_one_layer(inspected):
    """The tiny GPT's train step (2 layers, 2 micro-batches): the layer scan's forward and
    backward bodies are found, each with fusions; the program total holds each loop body's
    counts times its executions."""
    fusion = inspected[1]["fusion"]
    loops = {loop["body"]: loop for loop in fusion["loops"]}
    layer = fusion["per_layer"]
    assert len(layer["bodies"]) == 2, fusion["loops"]           # forward and backward scan
    for body in layer["bodies"]:
        assert loops[body]["trip_count"] == 2 and loops[body]["fusion_count"] > 0
    assert layer["fusion_count"] == sum(loops[b]["fusion_count"] for b in layer["bodies"])
    program = fusion["program"]
    for key in ("fusion_count", "unfused_elementwise_count"):
        assert program[key] >= sum(loop[key] * loop["executions"] for loop in fusion["loops"])
    assert program["fusion_count"] > layer["fusion_count"]


def test_inspect_keys_say_what_they_count(inspected):
    """XLA's cost analysis, which counts each loop body once, is named so and is below the
    FLOPs the step executes (the layer scan runs twice); collectives over groups of one device
    are apart under `no_op`, not under an empty axis, and the two tables hold every op."""
    trainer, rep = inspected
    assert "flops" not in rep
    assert rep["xla_cost_analysis"]["flops_loop_bodies_once"] < rep["executed_flops_per_device"]
    coll = rep["collectives"]
    assert "" not in coll["by_axes"] and coll["by_axes"]
    total = {}
    for op in coll["ops"]:
        total[op["kind"]] = total.get(op["kind"], 0) + op["multiplicity"]
    counted = {k: coll["by_kind"].get(k, {}).get("count", 0) + coll["no_op"].get(k, {}).get("count", 0) for k in total}
    assert counted == total
    for kind, v in coll["no_op"].items():
        assert v["count"] == sum(op["multiplicity"] for op in coll["ops"] if op["kind"] == kind and not op["axes"])


def inspect_main(argv, rep, monkeypatch, capsys):
    """`python -m mtjax.inspect ARGV`'s stdout, in-process, with `rep` as the compiled report."""
    from mtjax import cli, inspect
    monkeypatch.setattr(inspect, "report", lambda trainer, target=None: rep)
    assert cli.report(inspect.main, argv) == 0
    return capsys.readouterr().out


def test_inspect_prints_a_summary_and_json_on_request(inspected, monkeypatch, capsys):
    import json
    import os
    trainer, rep = inspected
    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
    argv = ["--config", tiny, "parallel.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch=2"]
    assert json.loads(inspect_main(argv + ["--json"], rep, monkeypatch, capsys)) == json.loads(json.dumps(rep, default=str))
    text = inspect_main(argv, rep, monkeypatch, capsys)
    lines = text.splitlines()
    assert lines[0].startswith("layout: mesh (data, pipe, tensor) = (4, 1, 2) on 8 cpu devices; sequence parallel on")
    assert lines[1].startswith("memory per device: peak ") and "bytes per parameter" in lines[1]
    from mtjax.inspect_summary import si
    assert lines[2].startswith(f"FLOPs per device per step: {si(rep['executed_flops_per_device'])}FLOP of matmuls")
    assert lines[3] == ("collectives per step, by mesh axis (count, bytes per device: each collective's whole "
                        "tensor, an all-gather's result, a reduce-scatter's operand):")
    assert any(line.startswith("  tensor: all-gather ") for line in lines)
    assert not any(line.startswith("  : ") for line in lines)
    assert lines[-1].endswith("--json prints the full report") and len(lines) < 15


COPY_HLO = """HloModule copies

%then (a: f32[16]) -> f32[16] {
  %a = f32[16]{0} parameter(0)
  ROOT %c_branch = f32[16]{0} copy(%a)
}

%else (a: f32[16]) -> f32[16] {
  ROOT %a = f32[16]{0} parameter(0)
}

%body (arg: (s32[], f32[8], f32[16])) -> (s32[], f32[8], f32[16]) {
  %arg = (s32[], f32[8]{0}, f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[8]{0} get-tuple-element(%arg), index=1
  %y = f32[16]{0} get-tuple-element(%arg), index=2
  %c_loop = f32[8]{0} copy(%x)
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  %p = pred[] compare(%i, %one), direction=LT
  %y1 = f32[16]{0} conditional(%p, %y, %y), true_computation=%then, false_computation=%else
  ROOT %t = (s32[], f32[8]{0}, f32[16]{0}) tuple(%i1, %c_loop, %y1)
}

%cond (arg: (s32[], f32[8], f32[16])) -> pred[] {
  %arg = (s32[], f32[8]{0}, f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8], y: f32[16], z: bf16[2]) -> (s32[], f32[8], f32[16]) {
  %x = f32[8]{0} parameter(0)
  %y = f32[16]{0} parameter(1)
  %z = bf16[2]{0} parameter(2)
  %c_top = bf16[2]{0} copy(%z)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}, f32[16]{0}) tuple(%zero, %x, %y)
  ROOT %w = (s32[], f32[8]{0}, f32[16]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_copy_report_weights_copies_by_their_executions():
    """A copy in a loop body counts trip-count times; one in a branch goes to the upper bound."""
    from mtjax.hlo_report import copy_report
    r = copy_report(COPY_HLO)
    assert r["bytes_per_step"] == 4 * 8 * 4 + 2 * 2           # c_loop 4 times, c_top once
    assert r["conditional_bytes_per_step"] == 4 * 16 * 4      # c_branch as if taken every trip
    assert [c[2] for c in r["largest"]] == ["c_branch", "c_loop", "c_top"]

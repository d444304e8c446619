"""The H100 performance model (`mtjax.hlo_report.gpu_model`, `gpu_report`): unit tests on small
hand-written HLO, and its calibration against the step times measured on an H100
(`tests/fixtures/h100`: commit 4dcf60d's steps, compiled by XLA:GPU by
`scripts/make_gpu_fixtures.py`; the times are docs/benchmarks.md's "GPU: H100" rows). Needs no
GPU and no CUDA plugin: the model reads HLO text only.
"""
import gzip
import json
import math
import os

import pytest

from mtjax.hlo_report.gpu_model import kernel_times
from mtjax.hlo_report.gpu_report import gpu_report
from mtjax.hlo_report.hardware import H100, MEASURED_GPUS

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "h100")
TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
MiB = 2 ** 20


def _module(entry_body: str, *computations: str, entry_params: str = "") -> str:
    return "HloModule m\n\n" + "\n\n".join(computations) + f"\n\nENTRY %main ({entry_params}) -> f32[] {{\n{entry_body}\n}}\n"


def _kernels(text: str) -> dict:
    return {k["name"]: k for k in kernel_times(text, H100)["kernels"]}


ADD_BODY = """%fused_add (p0: f32[1024,1024], p1: f32[1024,1024]) -> f32[1024,1024] {
  %p0 = f32[1024,1024]{1,0} parameter(0)
  %p1 = f32[1024,1024]{1,0} parameter(1)
  ROOT %a = f32[1024,1024]{1,0} add(%p0, %p1)
}"""


def test_elementwise_fusion_is_memory_bound_with_a_launch():
    text = _module("""  %x = f32[1024,1024]{1,0} parameter(0)
  %y = f32[1024,1024]{1,0} parameter(1)
  %f = f32[1024,1024]{1,0} fusion(%x, %y), kind=kLoop, calls=%fused_add
  ROOT %r = f32[] constant(0)""", ADD_BODY, entry_params="x: f32[1024,1024], y: f32[1024,1024]")
    k = _kernels(text)["f"]
    assert k["bytes"] == 3 * 4 * MiB and k["flops"] == 0 and k["alu"] == 1024 * 1024
    assert k["bound"] == "memory"
    assert k["time_s"] == pytest.approx(3 * 4 * MiB / H100.memory_bandwidth + H100.launch_s)


def test_in_place_update_writes_the_update_and_a_slice_reads_the_slice():
    dus = """%fused_dus (buf: bf16[24,4096,1024], upd: bf16[1,4096,1024], i: s32[]) -> bf16[24,4096,1024] {
  %buf = bf16[24,4096,1024]{2,1,0} parameter(0)
  %upd = bf16[1,4096,1024]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = bf16[24,4096,1024]{2,1,0} dynamic-update-slice(%buf, %upd, %i, %z, %z)
}"""
    ds = """%fused_ds (buf: bf16[24,4096,1024], i: s32[]) -> bf16[1,4096,1024] {
  %buf = bf16[24,4096,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %d = bf16[1,4096,1024]{2,1,0} dynamic-slice(%buf, %i, %z, %z), dynamic_slice_sizes={1,4096,1024}
}"""
    text = _module("""  %buf = bf16[24,4096,1024]{2,1,0} parameter(0)
  %upd = bf16[1,4096,1024]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %w = bf16[24,4096,1024]{2,1,0} fusion(%buf, %upd, %i), kind=kLoop, calls=%fused_dus
  %r = bf16[1,4096,1024]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_ds
  ROOT %c = f32[] constant(0)""", dus, ds, entry_params="buf: bf16[24,4096,1024], upd: bf16[1,4096,1024], i: s32[]")
    k = _kernels(text)
    layer = 4096 * 1024 * 2
    assert k["w"]["bytes"] == layer + 4 + layer        # reads the update (and the index), writes it
    assert k["r"]["bytes"] == layer + 4 + layer        # reads one layer's slice, writes it


def test_an_async_fusion_is_one_kernel_and_its_done_is_free():
    """XLA:GPU in jax 0.11 runs a scan's in-place stacking as fusion-start / fusion-done: the start
    is the fusion's kernel (the update's bytes, not the whole stacked buffer's), and its fused
    computation is not walked again as unfused ops."""
    dus = """%fused_dus (buf: bf16[24,4096,1024], i: s32[], upd: bf16[4096,1024]) -> bf16[24,4096,1024] {
  %buf = bf16[24,4096,1024]{2,1,0} parameter(0)
  %upd = bf16[4096,1024]{1,0} parameter(2)
  %u = bf16[1,4096,1024]{2,1,0} bitcast(%upd)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %d = bf16[24,4096,1024]{2,1,0} dynamic-update-slice(%buf, %u, %i, %z, %z)
}"""
    text = _module("""  %buf = bf16[24,4096,1024]{2,1,0} parameter(0)
  %upd = bf16[4096,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %s = ((bf16[24,4096,1024]{2,1,0}, s32[], bf16[4096,1024]{1,0}), bf16[24,4096,1024]{2,1,0}, u32[]) fusion-start(%buf, %i, %upd), kind=kLoop, calls=%fused_dus
  %w = bf16[24,4096,1024]{2,1,0} fusion-done(%s)
  ROOT %c = f32[] constant(0)""", dus, entry_params="buf: bf16[24,4096,1024], upd: bf16[4096,1024], i: s32[]")
    k = _kernels(text)
    layer = 4096 * 1024 * 2
    assert set(k) == {"s"}
    assert k["s"]["bytes"] == layer + 4 + layer


def test_gemm_fusion_is_bound_by_the_matmul_rate():
    gemm = """%gemm (a: bf16[8192,2048], b: bf16[2048,8192]) -> bf16[8192,8192] {
  %a = bf16[8192,2048]{1,0} parameter(0)
  %b = bf16[2048,8192]{1,0} parameter(1)
  ROOT %d = bf16[8192,8192]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}"""
    text = _module("""  %a = bf16[8192,2048]{1,0} parameter(0)
  %b = bf16[2048,8192]{1,0} parameter(1)
  %g = bf16[8192,8192]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %c = f32[] constant(0)""", gemm, entry_params="a: bf16[8192,2048], b: bf16[2048,8192]")
    k = _kernels(text)["g"]
    flops = 2 * 8192 * 8192 * 2048
    assert (k["kind"], k["flops"], k["bound"]) == ("gemm", flops, "flops")
    assert k["time_s"] == pytest.approx(flops / H100.matmul_flops + H100.launch_s)


def test_alu_work_counts_integer_and_transcendental_ops_at_their_issue_cost():
    body = """%rng (x: u32[4096,1024], y: f32[4096,1024]) -> (u32[4096,1024], f32[4096,1024]) {
  %x = u32[4096,1024]{1,0} parameter(0)
  %y = f32[4096,1024]{1,0} parameter(1)
  %s = u32[4096,1024]{1,0} shift-left(%x, %x)
  %o = u32[4096,1024]{1,0} xor(%s, %x)
  %a = u32[4096,1024]{1,0} add(%o, %s)
  %e = f32[4096,1024]{1,0} exponential(%y)
  %t = f32[4096,1024]{1,0} tanh(%e)
  ROOT %r = (u32[4096,1024]{1,0}, f32[4096,1024]{1,0}) tuple(%a, %t)
}"""
    text = _module("""  %x = u32[4096,1024]{1,0} parameter(0)
  %y = f32[4096,1024]{1,0} parameter(1)
  %f = (u32[4096,1024]{1,0}, f32[4096,1024]{1,0}) fusion(%x, %y), kind=kLoop, calls=%rng
  ROOT %c = f32[] constant(0)""", body, entry_params="x: u32[4096,1024], y: f32[4096,1024]")
    k = _kernels(text)["f"]
    n = 4096 * 1024
    assert k["alu"] == n * (3 * H100.int_op_cost + 2 * H100.special_op_cost)
    assert k["bytes"] == 4 * 4 * n                      # two inputs read, two outputs written


LOOP = """%body (t: (s32[], f32[1024,1024], f32[1024,1024])) -> (s32[], f32[1024,1024], f32[1024,1024]) {
  %t = (s32[], f32[1024,1024]{1,0}, f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[1024,1024]{1,0} get-tuple-element(%t), index=1
  %y = f32[1024,1024]{1,0} get-tuple-element(%t), index=2
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %f = f32[1024,1024]{1,0} fusion(%x, %y), kind=kLoop, calls=%fused_add
  ROOT %out = (s32[], f32[1024,1024]{1,0}, f32[1024,1024]{1,0}) tuple(%j, %f, %y)
}

%cond (t: (s32[], f32[1024,1024], f32[1024,1024])) -> pred[] {
  %t = (s32[], f32[1024,1024]{1,0}, f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}"""


def test_loops_count_through_their_trip_count():
    text = _module("""  %x = f32[1024,1024]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[1024,1024]{1,0}, f32[1024,1024]{1,0}) tuple(%z, %x, %x)
  %w = (s32[], f32[1024,1024]{1,0}, f32[1024,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
  ROOT %c = f32[] constant(0)""", ADD_BODY, LOOP, entry_params="x: f32[1024,1024]")
    r = kernel_times(text, H100)
    k = {x["name"]: x for x in r["kernels"]}
    assert k["f"]["executions"] == 10 and k["j"]["executions"] == 10 and k["lt"]["executions"] == 11
    assert r["loop_iterations"] == 10
    report = gpu_report(text, model_flops=1e9, layers=10)
    expected = (10 * k["f"]["time_s"] + 10 * k["j"]["time_s"] + 11 * k["lt"]["time_s"] + 10 * H100.loop_iteration_s)
    assert report["predicted_step_s"] == pytest.approx(expected)
    assert report["predicted_mfu"] == pytest.approx(1e9 / expected / H100.peak_flops)
    assert report["per_layer"]["kernels"] == 2 and report["per_layer"]["bodies"] == ["body"]
    assert report["per_layer"]["top"][0]["name"] == "f"
    halved = gpu_report(text, model_flops=1e9, layers=10, unit=2)["per_layer"]   # 2 layers per iteration
    assert halved["kernels"] == 1 and halved["layers_per_iteration"] == 2
    assert halved["time_s"] == pytest.approx(report["per_layer"]["time_s"] / 2)


def test_async_collective_is_hidden_by_the_kernels_between_start_and_done():
    def module(between: int) -> str:
        kernels = "\n".join(f"  %f{i} = f32[1024,1024]{{1,0}} fusion(%x, %x), kind=kLoop, calls=%fused_add"
                            for i in range(between))
        return """HloModule m, num_partitions=8

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

""" + ADD_BODY + """

ENTRY %main (x: f32[1024,1024], g: f32[16777216]) -> f32[] {
  %x = f32[1024,1024]{1,0} parameter(0)
  %g = f32[16777216]{0} parameter(1)
  %ar = f32[16777216]{0} all-reduce-start(%g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
""" + kernels + """
  %done = f32[16777216]{0} all-reduce-done(%ar)
  ROOT %c = f32[] constant(0)
}
"""
    sent = 2 * 7 / 8 * 64 * MiB
    t = H100.collective_latency_s + sent / H100.nvlink_bandwidth
    alone = kernel_times(module(0), H100, num_devices=8)["collectives"][0]
    assert alone["sent_bytes"] == int(sent) and alone["time_s"] == pytest.approx(t) and alone["exposed_s"] == alone["time_s"]
    hidden = kernel_times(module(3), H100, num_devices=8)
    kernel = hidden["kernels"][0]["time_s"]
    assert hidden["collectives"][0]["exposed_s"] == pytest.approx(max(0.0, t - 3 * kernel))
    covered = kernel_times(module(200), H100, num_devices=8)
    assert covered["collectives"][0]["exposed_s"] == 0.0


@pytest.mark.parametrize("groups,link", [("{0,1},{2,3},{4,5},{6,7},{8,9},{10,11},{12,13},{14,15}", "nvlink"),
                                         ("{0,8},{1,9},{2,10},{3,11},{4,12},{5,13},{6,14},{7,15}", "network")])
def test_a_collective_crosses_nodes_only_where_one_of_its_groups_does(groups, link):
    """16 GPUs, 8 a node: pairs within a node (tensor parallelism's) use NVLink although the groups
    together cover both nodes; pairs across them use the network."""
    text = """HloModule m, num_partitions=16

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (g: f32[1048576]) -> f32[1048576] {
  %g = f32[1048576]{0} parameter(0)
  ROOT %ar = f32[1048576]{0} all-reduce(%g), replica_groups={GROUPS}, to_apply=%sum
}
""".replace("GROUPS", "{" + groups + "}")
    [c] = kernel_times(text, H100, num_devices=16)["collectives"]
    bandwidth = H100.nvlink_bandwidth if link == "nvlink" else H100.network_bandwidth
    assert c["time_s"] == pytest.approx(H100.collective_latency_s + 4 * MiB / bandwidth)     # 2 (n - 1)/n = 1


def test_cudnn_attention_flops_come_from_its_score_shape():
    def module(target: str, mask: str) -> str:
        config = ('{"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", '
                  '"dimensions": ["8", "12", "1024", "1024"]}, "mask_type": "%s"}}' % mask)
        return _module(f"""  %q = bf16[8,1024,12,64]{{3,2,1,0}} parameter(0)
  %k = bf16[8,1024,12,64]{{3,2,1,0}} parameter(1)
  %a = (bf16[8,12,1024,64]{{3,1,2,0}}, f32[8,12,1024]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %k), custom_call_target="{target}", backend_config={config}
  ROOT %c = f32[] constant(0)""", entry_params="q: bf16[8,1024,12,64], k: bf16[8,1024,12,64]")
    scores = 8 * 12 * 1024 * 1024
    forward = _kernels(module("__cudnn$fmhaSoftmax", "NO_MASK"))["a"]
    assert (forward["kind"], forward["flops"]) == ("attention", 2 * 2 * scores * 64)
    assert forward["time_s"] == pytest.approx(forward["flops"] / H100.attention_flops + H100.launch_s)
    assert _kernels(module("__cudnn$fmhaSoftmax", "CAUSAL"))["a"]["flops"] == 2 * scores * 64
    assert _kernels(module("__cudnn$fmhaSoftmaxBackward", "CAUSAL"))["a"]["flops"] == 5 * scores * 64


# ---------------------------------------------------------------------------------- calibration
def _cases():
    with open(os.path.join(FIXTURES, "cases.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def predictions():
    out = {}
    for name, case in _cases().items():
        with gzip.open(os.path.join(FIXTURES, f"{name}.hlo.gz"), "rt") as f:
            report = gpu_report(f.read(), case["model_flops_per_step"], MEASURED_GPUS[case.get("gpu", "h100")])
        out[name] = (report["predicted_step_s"], case["measured_step_s"], case.get("gpu", "h100"))
    return out


def test_every_measured_h100_step_is_predicted_within_25_percent(predictions):
    assert len(predictions) >= 6
    assert {gpu for _, _, gpu in predictions.values()} == {"h100", "h200"}
    for name, (predicted, measured, _) in predictions.items():
        assert abs(math.log(predicted / measured)) < math.log(1.25), (name, predicted, measured)


def test_the_predictions_keep_the_measured_order(predictions):
    for gpu in ("h100", "h200"):                    # within one card's cases
        on = [n for n in predictions if predictions[n][2] == gpu]
        by_measured = sorted(on, key=lambda n: predictions[n][1])
        by_predicted = sorted(on, key=lambda n: predictions[n][0])
        assert by_predicted == by_measured, {n: predictions[n] for n in by_measured}


# ------------------------------------------------------------------------------ the command line
@pytest.mark.skipif(__import__("mtjax.compile_only").compile_only.why_unavailable() is None,
                    reason="the CUDA plugin is installed here: --target works (tests/test_gpu_compile.py)")
def test_target_without_the_cuda_plugin_is_one_line(capsys):
    from mtjax import cli, inspect
    with pytest.raises(SystemExit) as done:
        cli.run(inspect.main, ["--config", TINY, "--target", "h100"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --target:") and "CUDA plugin" in err[0]


@pytest.mark.parametrize("argv,flag", [(["--gpus", "8"], "--gpus"), (["--target", "h100", "--gpus", "0"], "--gpus"),
                                       (["--target", "a100"], "--target")])
def test_bad_target_flags_are_one_line(capsys, argv, flag):
    from mtjax import cli, inspect
    with pytest.raises(SystemExit) as done:
        cli.run(inspect.main, ["--config", TINY, *argv])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}"), err


def _one_branch(branch: str, *computations: str) -> str:
    """A program whose entry runs `%branch` (given) or an empty `%skip` in one conditional."""
    skip = """%skip (p: f32[1024,1024]) -> f32[1024,1024] {
  ROOT %p = f32[1024,1024]{1,0} parameter(0)
}"""
    return _module("""  %x = f32[1024,1024]{1,0} parameter(0)
  %b = s32[] parameter(1)
  %c = f32[1024,1024]{1,0} conditional(%b, %x, %x), branch_computations={%skip, %branch}
  ROOT %r = f32[] constant(0)""", *computations, branch, skip, entry_params="x: f32[1024,1024], b: s32[]")


def test_scope_weights_count_a_branch_collective_in_the_ticks_that_take_it():
    """A collective in a tick branch (tensor parallelism's, inside a pipeline stage's forward) runs
    in the branch's share of the ticks, as its kernels do: its executions, and the step's time."""
    branch = """%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%branch (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  ROOT %g = f32[1024,1024]{1,0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%sum, metadata={op_name="jit(step)/pipeline_forward/psum"}
}"""
    text = _one_branch(branch)
    plain = kernel_times(text, H100, num_devices=2)
    assert plain["conditionals_upper_bound"] and plain["collectives"][0]["executions"] == 1
    weighted = kernel_times(text, H100, num_devices=2, scope_weights={"pipeline_forward": 0.25})
    assert not weighted["conditionals_upper_bound"] and weighted["collectives"][0]["executions"] == 0.25
    t = plain["collectives"][0]["time_s"]
    r = gpu_report(text, 1e9, num_devices=2, rank_scope_weights=[{"pipeline_forward": 0.25}])
    assert r["exposed_collective_s"] == pytest.approx(0.25 * t) and r["collective_s"] == pytest.approx(0.25 * t)


def test_scope_weights_count_a_branch_in_the_ticks_that_take_it():
    """A pipeline rank's branch runs in the fraction of ticks its schedule gives it: with that
    fraction as the weight of the branch's named scope its kernels count that often, and the
    report is no longer an upper bound; the step is the slowest rank's."""
    branch = """%branch (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  ROOT %f = f32[1024,1024]{1,0} fusion(%p, %p), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/pipeline_forward/add"}
}"""
    text = _one_branch(branch, ADD_BODY)
    plain = kernel_times(text, H100)
    assert plain["conditionals_upper_bound"] and plain["kernels"][0]["executions"] == 1
    weighted = kernel_times(text, H100, scope_weights={"pipeline_forward": 0.25})
    assert not weighted["conditionals_upper_bound"] and weighted["kernels"][0]["executions"] == 0.25
    r = gpu_report(text, 1e9, rank_scope_weights=[{"pipeline_forward": 0.25}, {"pipeline_forward": 0.5}])
    t = plain["kernels"][0]["time_s"]
    assert r["per_pipe_rank_step_s"] == pytest.approx([0.25 * t, 0.5 * t])
    assert r["predicted_step_s"] == pytest.approx(0.5 * t)


def test_lockstep_ticks_last_as_long_as_their_slowest_rank():
    """A pipelined step is as long as its ticks, each its slowest rank's work: two ranks of a
    4-tick loop whose forward branch costs f (one kernel) and backward 2f (two), in the ticks
    each rank's table gives, take [1, 3, 3, 2] f in lockstep where each rank's own work is 6 f;
    the ticks' unconditional work (the counter) counts once, as in each rank's own time."""
    branches = """%fwd (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  ROOT %f = f32[1024,1024]{1,0} fusion(%p, %p), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/while/body/pipeline_forward/add"}
}

%bwd (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  %g = f32[1024,1024]{1,0} fusion(%p, %p), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/while/body/pipeline_backward/add"}
  ROOT %h = f32[1024,1024]{1,0} fusion(%g, %p), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/while/body/pipeline_backward/add"}
}

%skip (p: f32[1024,1024]) -> f32[1024,1024] {
  ROOT %p = f32[1024,1024]{1,0} parameter(0)
}

%body (t: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %t = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[1024,1024]{1,0} get-tuple-element(%t), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %y = f32[1024,1024]{1,0} conditional(%i, %x, %x), branch_computations={%skip, %fwd}
  %z = f32[1024,1024]{1,0} conditional(%i, %y, %y), branch_computations={%skip, %bwd}
  ROOT %out = (s32[], f32[1024,1024]{1,0}) tuple(%j, %z)
}

%cond (t: (s32[], f32[1024,1024])) -> pred[] {
  %t = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}"""
    text = _module("""  %x = f32[1024,1024]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[1024,1024]{1,0}) tuple(%z, %x)
  %w = (s32[], f32[1024,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %c = f32[] constant(0)""", ADD_BODY, branches, entry_params="x: f32[1024,1024]")
    import numpy as np
    tables = [{"pipeline_forward": np.array([1, 1, 0, 0], bool), "pipeline_backward": np.array([0, 1, 0, 1], bool)},
              {"pipeline_forward": np.array([0, 1, 1, 0], bool), "pipeline_backward": np.array([0, 0, 1, 1], bool)}]
    weights = [{s: float(a.mean()) for s, a in table.items()} for table in tables]
    own = gpu_report(text, 1e9, rank_scope_weights=weights)
    f = _kernels(text)["f"]["time_s"]
    assert own["per_pipe_rank_step_s"][0] == pytest.approx(own["per_pipe_rank_step_s"][1])
    rest = own["predicted_step_s"] - 6 * f
    assert rest > 0 and own["time_by_scope"] == pytest.approx({"pipeline_forward": 2 * f, "pipeline_backward": 4 * f})
    r = gpu_report(text, 1e9, rank_scope_weights=weights, rank_scope_ticks=tables)
    assert r["pipeline_lockstep"]["tick_s"] == pytest.approx([f, 3 * f, 3 * f, 2 * f])
    assert r["predicted_step_s"] == pytest.approx(rest + 9 * f)
    assert r["pipeline_lockstep"]["bubble_s"] == pytest.approx(3 * f)
    assert r["predicted_mfu"] == pytest.approx(1e9 / (rest + 9 * f) / H100.peak_flops)


def test_the_summary_says_how_much_of_a_pipelined_step_is_waiting():
    from mtjax.inspect_summary import gpu_line
    g = {"target": "h100", "predicted_step_s": 0.010, "predicted_mfu": 0.5, "tokens_per_s": 1000.0,
         "exposed_collective_s": 0.001}
    assert "lockstep" not in gpu_line(g) and "step 10.00 ms, MFU 50.0%" in gpu_line(g)
    line = gpu_line(g | {"pipeline_lockstep": {"bubble_s": 0.002}})
    assert "step 10.00 ms (lockstep: 2.00 ms of it waiting in the pipeline's ticks), MFU 50.0%" in line

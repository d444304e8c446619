"""Tests for mtjax.hlo_report.executed_dot_flops: matmul FLOPs of compiled programs, counted
through loops, fusions and conditionals, against counts worked out from the shapes.

A [m, k] x [k, n] product costs 2 m k n FLOPs (a multiply-add is 2).
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from mtjax.hlo_report import executed_dot_flops, scope_of

B, H, N = 4, 8, 16  # rows, hidden, a third distinct size so that a wrong contraction shows


def _flops(f, *args, **kw):
    return executed_dot_flops(jax.jit(f).lower(*args).compile().as_text(), **kw)


def test_plain_matmul_is_2mnk():
    r = _flops(lambda x, w: x @ w, jnp.ones((B, H)), jnp.ones((H, N)))
    assert r["flops"] == 2 * B * H * N
    assert len(r["ops"]) == 1 and not r["conditionals_upper_bound"]


def test_scan_counts_every_layer():
    layers = 3

    def f(x, ws):
        return lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    r = _flops(f, jnp.ones((B, H)), jnp.ones((layers, H, H)))
    assert r["flops"] == layers * 2 * B * H * H
    assert r["unknown_trip_counts"] == []


def test_batch_dims_count_once():
    b, q, k, h, d = 2, 4, 6, 3, 5   # attention scores: batch b, h; contract d

    def f(qs, ks):
        return jnp.einsum("bqhd,bkhd->bhqk", qs, ks)

    r = _flops(f, jnp.ones((b, q, h, d)), jnp.ones((b, k, h, d)))
    assert r["flops"] == 2 * b * h * q * k * d


def test_grad_of_linear_layer_is_three_matmuls():
    # value_and_grad keeps the forward; backward: dx = dy w^T and dw = x^T dy, each 2 B H N.
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
    r = _flops(jax.value_and_grad(loss, argnums=(0, 1)), jnp.ones((H, N)), jnp.ones((B, H)))
    assert r["flops"] == 3 * 2 * B * H * N
    assert len(r["ops"]) == 3


def test_convolution():
    width, window, c_in, c_out = 10, 5, 3, 4
    conv = lambda x, k: lax.conv_general_dilated(x, k, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    r = _flops(conv, jnp.ones((B, width, c_in)), jnp.ones((window, c_in, c_out)))
    out_elements = B * (width - window + 1) * c_out
    assert r["flops"] == 2 * out_elements * window * c_in


# A pipeline-like tick loop: each tick is idle (0), forward (1) or backward (2); the backward
# replays the forward under jax.vjp, so its dots carry both scope names, backward outermost.
ACTIONS = (1, 1, 0, 2, 1, 2, 0, 2)


def _layer(w, x):
    with jax.named_scope("pipeline_forward"):
        return jnp.tanh(x @ w)


def _ticks(w, x, actions):
    def tick(carry, a):
        def forward():
            return _layer(w, carry)

        def backward():
            with jax.named_scope("pipeline_backward"):
                _, vjp = jax.vjp(_layer, w, carry)
                dw, dx = vjp(carry)         # recomputed forward, dx and dw: three matmuls
                return dx + jnp.sum(dw)     # dw used, so that it is not dead code

        return lax.switch(a, [lambda: carry, forward, backward]), None
    return lax.scan(tick, x, actions)[0]


def test_conditional_branches_weighted_by_scope():
    args = jnp.ones((H, H)), jnp.ones((B, H)), jnp.asarray(ACTIONS, jnp.int32)
    mm, ticks = 2 * B * H * H, len(ACTIONS)
    unweighted = _flops(_ticks, *args)
    assert unweighted["flops"] == ticks * (1 + 3) * mm          # every branch as if taken
    assert unweighted["conditionals_upper_bound"]

    share = {"pipeline_forward": ACTIONS.count(1) / ticks, "pipeline_backward": ACTIONS.count(2) / ticks}
    r = _flops(_ticks, *args, scope_weights=share)
    assert r["by_scope"] == {"pipeline_forward": ACTIONS.count(1) * mm,
                             "pipeline_backward": ACTIONS.count(2) * 3 * mm}
    assert r["flops"] == pytest.approx((ACTIONS.count(1) + 3 * ACTIONS.count(2)) * mm)
    assert r["unscoped_flops"] == 0 and not r["conditionals_upper_bound"]


def test_cond_in_scan_under_named_scope():
    ticks, every = 6, 3   # the matmul branch is taken on ticks 0 and 3

    def f(w, x):
        def tick(c, t):
            with jax.named_scope("pipeline_forward"):
                return lax.cond(t % every == 0, lambda: jnp.tanh(c @ w), lambda: c * 2.0), None
        return lax.scan(tick, x, jnp.arange(ticks))[0]

    taken = ticks // every
    r = _flops(f, jnp.ones((H, H)), jnp.ones((B, H)), scope_weights={"pipeline_forward": taken / ticks})
    assert r["flops"] == pytest.approx(taken * 2 * B * H * H)
    [op] = r["ops"]
    assert op["in_conditional"] and op["multiplicity"] == ticks and op["scope"] == "pipeline_forward"


def test_a_scope_inlined_in_the_entry_is_not_around_the_rest():
    """A pipeline's last tick after the loop is a scope inlined in the entry computation; the tick
    loop beside it is not inside it: a branch without a scope of its own stays unscoped, counted as
    if always taken (an upper bound), not as the last tick's work."""
    def f(w, x, actions):
        def tick(c, a):
            def forward():
                with jax.named_scope("pipeline_forward"):
                    return jnp.tanh(c @ w)
            return lax.switch(a, [lambda: c, forward, lambda: jnp.sin(c @ w.T)]), None   # no scope
        y = lax.scan(tick, x, actions)[0]
        with jax.named_scope("pipeline_final_tick"):
            return jnp.tanh(y @ w)

    actions = jnp.asarray([0, 1, 2, 1], jnp.int32)
    mm = 2 * B * H * H
    r = _flops(f, jnp.ones((H, H)), jnp.ones((B, H)), actions,
               scope_weights={"pipeline_forward": 0.5, "pipeline_final_tick": 1.0})
    assert r["by_scope"] == {"pipeline_forward": 0.5 * 4 * mm, "pipeline_final_tick": mm}
    assert r["unscoped_flops"] == 4 * mm and r["conditionals_upper_bound"]


def test_scope_of_outermost_component_wins():
    scopes = {"pipeline_forward", "pipeline_backward"}
    replay = "jit(f)/while/body/pipeline_backward/transpose(jvp(pipeline_forward))/dot_general"
    assert scope_of(replay, scopes) == "pipeline_backward"
    assert scope_of("jit(f)/transpose(jvp(pipeline_forward))/dot_general", scopes) == "pipeline_forward"
    assert scope_of("jit(f)/pipeline_forward_extra/dot_general", scopes) is None   # a component, not a prefix
    assert scope_of("", scopes) is None
    nested = scopes | {"pipeline_forward/pipeline_embed"}    # a scope within a scope, weighted on its own
    embed = "jit(f)/while/body/pipeline_forward/cond/pipeline_embed/dot_general"
    assert scope_of(embed, nested) == "pipeline_forward/pipeline_embed"
    assert scope_of(embed, scopes) == "pipeline_forward"
    assert scope_of("jit(f)/pipeline_backward/pipeline_embed/dot_general", nested) == "pipeline_backward"


def test_pipeline_scope_weights_put_the_embedding_on_stage_0():
    """The embedding (and a dense prefix) runs inside the tick's forward and backward, on stage 0
    only; with the last tick after the loop, the loop's scopes are shares of its ticks."""
    from mtjax.pipeline.scopes import scope_weights
    from mtjax.pipeline.schedules import make_schedule
    schedule = make_schedule("1f1b", 2, 4)                  # 6 ticks, 4 forwards and 4 backwards a stage
    first, last = scope_weights(schedule)
    assert first["pipeline_forward/pipeline_embed"] == first["pipeline_forward"] == 4 / 6
    assert last["pipeline_forward/pipeline_embed"] == last["pipeline_backward/pipeline_embed"] == 0
    first, last = scope_weights(schedule, reduce_last=True)  # stage 0's last backward after the loop
    assert first["pipeline_forward"] == last["pipeline_forward"] == 4 / 5 and first["pipeline_backward"] == 3 / 5
    assert (first["pipeline_final_tick"], last["pipeline_final_tick"]) == (1, 1)
    assert (first["pipeline_final_tick/pipeline_embed"], last["pipeline_final_tick/pipeline_embed"]) == (1, 0)


# Text that prints operand shapes, and a dot without metadata that takes its fusion's op_name.
SYNTHETIC = """HloModule m

%fused (p0: f32[4,8], p1: f32[8,16]) -> f32[4,16] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  ROOT %d = f32[4,16]{1,0} dot(f32[4,8]{1,0} %p0, f32[8,16]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %w = f32[8,16]{1,0} get-tuple-element(%t), index=2
  %f = f32[4,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused, metadata={op_name="jit(g)/while/body/pipeline_forward/dot_general"}
  ROOT %r = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(s32[] %i, %x, %w)
}

%cond (t: (s32[], f32[4,8], f32[8,16])) -> pred[] {
  %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4,8], b: f32[8,16]) -> f32[4,8] {
  %init = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %loop = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_synthetic_printed_shapes_and_inherited_metadata():
    r = executed_dot_flops(SYNTHETIC, {"pipeline_forward": 0.5})
    [op] = r["ops"]
    assert op["op_name"] == "jit(g)/while/body/pipeline_forward/dot_general"
    assert r["by_scope"]["pipeline_forward"] == 5 * 2 * 4 * 8 * 16 * 0.5


# XLA:GPU rewrites dots into cuBLAS calls; format as printed in XLA's own GPU tests (a batched
# gemm [3,4,8] x [3,8,16] whose result comes before a workspace buffer).
CUBLAS = """HloModule g

ENTRY %main (x: f32[3,4,8], y: f32[3,8,16]) -> f32[3,4,16] {
  %x = f32[3,4,8]{2,1,0} parameter(0)
  %y = f32[3,8,16]{2,1,0} parameter(1)
  %custom-call.1 = (f32[3,4,16]{2,1,0}, s8[1028]{0}) custom-call(%x, %y), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/dot_general"}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{"alpha_real":1,"alpha_imag":0,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]},"epilogue":"DEFAULT"}}
  ROOT %gte = f32[3,4,16]{2,1,0} get-tuple-element(%custom-call.1), index=0
}
"""


def test_cublas_gemm_counts_like_its_dot():
    r = executed_dot_flops(CUBLAS)
    assert r["flops"] == 2 * 3 * 4 * 16 * 8


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2),
                                        ("zb", 3, 6, 1), ("zbv", 2, 4, 1)])
def test_the_lockstep_of_the_scope_tables_is_the_schedules_own(name, p, m, v):
    """`gpu_report.lockstep` over `loop_scope_table`, each rank's scopes costing the schedule's
    default units (F 1, B 2; split: F 1, B 1, W 1) a tick, is the table's lockstep time, and each
    rank's own time its busy time: the same sum over ticks of the slowest stage, read two ways."""
    from mtjax.hlo_report.gpu_report import lockstep
    from mtjax.pipeline.schedules import make_schedule
    from mtjax.pipeline.scopes import loop_scope_table
    from mtjax.pipeline.table import default_costs
    schedule = make_schedule(name, p, m, v)
    f, b, w = (float(x) for x in default_costs(schedule.split))
    unit = {"pipeline_forward": f, "pipeline_backward": b if schedule.split else b + w, "pipeline_weight": w}
    tables = loop_scope_table(schedule)
    ranks = []
    for table in tables:
        spent = {s: unit[s] * float(a.sum()) for s, a in table.items() if s in unit}
        ranks.append({"predicted_step_s": sum(spent.values()), "time_by_scope": spent})
    r = lockstep(ranks, tables)
    busy = max(rank["predicted_step_s"] for rank in ranks)
    assert r["step_s"] == pytest.approx(float(schedule.time_over_ideal()) * busy)
    assert r["bubble_s"] == pytest.approx(r["step_s"] - busy) and r["ticks"] == schedule.ticks

"""The executor runs the split schedules (zb, zbv) and computes what one device computes.

Each backward runs as B (input gradient, sent upstream) and W (the matmul weights' gradients
X^T dY from the kept (X, dY) pairs, later). Loss and every gradient leaf against
tests/reference.py (fp32, relative error < 1e-5), and one AdamW step against plain AdamW on
those gradients, for zb at p = 4 (with tensor = 2 plus sequence parallelism; with data = 2 plus
the distributed optimizer under a memory cap) and zbv at p = 2, recompute none, selective and
block; zb at p = 2 with fewer kv heads than tensor ranks (MQA at t = 2 with data = 2 and the
distributed optimizer; k = 2 at t = 4 with sequence parallelism); pipelined validation loss and
logits too.
Then the compiled program's executed FLOPs (split = unsplit) and temporaries (zb against 1F1B at
the same cap; flat in m).
"""
import functools

import jax
import jax.numpy as jnp
import pytest

import reference
from layouts import BATCH, VOCAB, build, random_batch, relative, tiny_config
from mtjax.hlo_report import memory_report
from mtjax.inspect import compile_train_step, executed_flops
from test_equivalence import assert_step_matches

TOL = 1e-5

# zb with tensor 2 + SP at p = 4 (selective), zb under a cap with data 2 and the distributed
# optimizer (block), zbv at p = 2 with pipelined evaluation. Cut: zb at p = 2 alone, zb on (2, 2, 2)
# and zbv on the larger meshes, which repeated these pairs (zbv's B/W split is zb's; its V order is
# the kept zbv case's), and 1F1B under a cap: another table for the same executor, whose idle
# ticks the capped zb case runs (its tables: test_zero_bubble_schedules.py; its temporaries: the
# memory test below).
CASES = [  # schedule, data, pipe, tensor, sp, arch, recompute, m, max_in_flight, kv heads
    ("zb", 1, 4, 2, True, "llama", "selective", 4, 0, 2),
    ("zb", 2, 4, 1, False, "llama", "block", 4, 2, 2),
    ("zbv", 1, 2, 1, False, "llama", "none", 4, 0, 2),
    # k < t: each rank's K and V products use only its kv head's slice of the replicated kernel,
    # and W puts that head's X^T dY back at its place (`taps.placed_weight_gradient`): MQA k = 1 at
    # t = 2 with data 2 and the distributed optimizer (the plain tapped matmul), GQA k = 2 at t = 4
    # with SP (the gathered matmul's taps, head 0 or 1 by rank)
    ("zb", 2, 2, 2, False, "llama", "none", 4, 0, 1),
    ("zb", 1, 2, 4, True, "llama", "none", 4, 0, 2),
]
EVAL = {c for c in CASES if c[6] == "none"}     # pipelined evaluation where recompute is none


def _config(schedule, data, pipe, tensor, sp, arch, recompute, m, cap, kv):
    chunks = 2 if schedule == "zbv" else 1
    extra = [f"train.micro_batches={m}", f"parallel.schedule={schedule}", f"parallel.max_in_flight={cap}",
             f"model.num_kv_heads={kv}",
             f"model.num_layers={2 * pipe * chunks}", f"train.recompute={recompute}",
             f"parallel.distributed_optimizer={'true' if data > 1 else 'false'}"]
    if recompute == "block":
        extra.append("train.recompute_layers=1")    # of each chunk's 2 layers: two runs per chunk
    return tiny_config(arch, tensor, pipe, data, sp, micro_batch=BATCH // (data * m), extra=extra)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_split_schedule_matches_reference(case):
    schedule, data, pipe, tensor = case[:4]
    cfg = _config(*case)
    trainer = build(cfg, data, pipe, tensor)
    assert trainer.schedule.split == (schedule != "1f1b") and trainer.schedule.name == schedule
    if case[8]:
        assert (trainer.schedule.max_in_flight() <= case[8] * trainer.schedule.chunks).all()
    state = trainer.init_state()
    batch = random_batch()
    params = jax.device_get(trainer.canonical(state.params))    # zbv stores its layers in its V's order
    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)

    if case in EVAL:      # before the step, which donates the state
        eval_loss = trainer.eval_step(state.params, trainer.put_batch(batch))
        assert abs(float(eval_loss) - float(ref_loss)) / float(ref_loss) < TOL
        logits = trainer.logits_fn(state.params, trainer.put_batch(batch[:, :-1]))
        ref_logits = reference.logits(params, batch[:, :-1], cfg.model, VOCAB)
        assert relative(logits, ref_logits) < TOL

    # The loss and every gradient the step applied against the reference's, and the step as AdamW
    # on those gradients (test_equivalence.STEP_ON_OWN_GRADIENTS)
    assert_step_matches(trainer, cfg, state, batch, params, ref_loss, ref_grads)



# Cost and memory from the compiled program: a GPT of 8 layers, h = 64, s = 64, b = 1, p = 2.
H, S, LAYERS = 64, 64, 8


@functools.lru_cache(maxsize=None)
def _report(schedule, m, pipe=2, cap=0):
    cfg = tiny_config("gpt", 1, pipe, 1, micro_batch=1, extra=[
        f"parallel.schedule={schedule}", f"parallel.max_in_flight={cap}", f"train.global_batch={m}",
        f"model.hidden_size={H}", f"model.seq_len={S}", f"model.num_layers={LAYERS}", "train.recompute=none"])
    trainer = build(cfg, 1, pipe, 1)
    compiled = compile_train_step(trainer)      # `inspect.report`'s parts read here, not all of it
    return {"memory": memory_report(compiled), **executed_flops(trainer, compiled.as_text())}


def test_split_schedule_flops_and_memory_from_the_compiled_program():
    """One test for both checks below: they share three of their seven compiled steps (`_report`'s
    cache is per process, and the suite's workers split a file's tests between them)."""
    _executes_the_unsplit_flops()
    _memory_of_the_split_schedule()


def _executes_the_unsplit_flops():
    """Summed over pipe ranks, a zb and a zbv step execute the matmul FLOPs of the unpipelined
    step within 3% (recompute none). Per operation, zb's B + W is 1F1B's whole backward within 3%
    (W redoes none of B's work), and W is a real share of it (the weight-gradient matmuls)."""
    one = sum(_report("1f1b", 8, pipe=1)["executed_flops_per_pipe_rank"])
    for schedule, cap in (("zb", 2), ("zbv", 0)):
        r = _report(schedule, 8, cap=cap)
        assert not r["executed_flops_upper_bound"]
        assert abs(sum(r["executed_flops_per_pipe_rank"]) / one - 1) < 0.03, schedule
    whole = _report("1f1b", 8)["pipeline"]["flops_per_operation"]
    split = _report("zb", 8, cap=2)["pipeline"]["flops_per_operation"]
    for unsplit, ops in zip(whole, split):
        assert unsplit["W"] == 0 and abs(ops["F"] / unsplit["F"] - 1) < 0.03
        assert abs((ops["B"] + ops["W"]) / unsplit["B"] - 1) < 0.03 and ops["W"] > 0.25 * unsplit["B"], (ops, unsplit)


def _w_slot_bytes() -> int:
    """One W-stash slot of a stage (fp32): per layer and token, each matmul's X and dY: X of Q, K,
    V (each its own copy of the [h] input), O and fc1 ([h]) and fc2 ([4h]); dY of Q, K, V, O and
    fc2 ([h]) and fc1 ([4h]): 18 h values."""
    return 18 * H * S * 4 * (LAYERS // 2)


def _memory_of_the_split_schedule():
    """XLA's temporaries: zb at the cap p holds 1F1B's stash slots at that cap, since B leaves W's
    (X, dY) in the slot its residuals held (`stash.PackedStash`) and the cap counts a slot until
    W (`Schedule.slots_held`); beyond 1F1B's it keeps at most one W slot's worth (B's tap
    cotangents before they are filed), where separate rings kept every W-pending slot and a spare.
    A W slot is smaller than a stash slot waiting for B (the difference of 1F1B's temporaries
    holding 3 and 2). Neither zb nor zbv grows with m: m = 32 within 15% of m = 8."""
    zb, one_f_one_b = _report("zb", 8, cap=2), _report("1f1b", 8, cap=2)
    assert zb["pipeline"]["max_in_flight"] == one_f_one_b["pipeline"]["max_in_flight"] == [2, 1]
    assert max(zb["pipeline"]["slots_held"]) == 2 and max(zb["pipeline"]["w_pending"]) == 2
    extra = zb["memory"]["temp_bytes"] - one_f_one_b["memory"]["temp_bytes"]
    assert 0 <= extra <= _w_slot_bytes(), (extra, _w_slot_bytes())
    b_slot = _report("1f1b", 8)["memory"]["temp_bytes"] - one_f_one_b["memory"]["temp_bytes"]
    assert _report("1f1b", 8)["pipeline"]["max_in_flight"] == [3, 1] and _w_slot_bytes() < b_slot
    for schedule, cap in (("zb", 2), ("zbv", 0)):
        small, large = _report(schedule, 8, cap=cap), _report(schedule, 32, cap=cap)
        assert large["memory"]["temp_bytes"] <= 1.15 * small["memory"]["temp_bytes"], schedule


def test_packed_stash_round_trips_both_kinds_in_one_slot():
    """`stash.PackedStash`: B's leaves (several dtypes, a scalar, an empty leaf) read back bitwise
    from their slot; W's leaves written into the same slot afterwards read back too; a write to the
    spare slot (NONE) touches no other slot."""
    from mtjax.pipeline.stash import PackedStash, shared_widths
    f32, bf16 = jnp.float32, jnp.bfloat16
    b = [jnp.arange(6, dtype=f32).reshape(2, 3), jnp.zeros((0,), f32), f32(7), jnp.array([True, False, True]),
         jnp.arange(5, dtype=bf16) / 3]
    w = [jnp.linspace(0, 1, 9, dtype=f32), jnp.ones((2, 2), bf16)]
    widths = shared_widths([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in b],
                           [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in w])
    assert widths == {jnp.dtype(f32): 9, jnp.dtype(jnp.bool_): 3, jnp.dtype(bf16): 5}
    kinds = [PackedStash([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves], widths) for leaves in (b, w)]
    ring = kinds[0].write(kinds[0].empty(None, 2), jnp.int32(1), b)
    ring = kinds[1].write(ring, jnp.int32(-1), [x + 1 for x in w])          # the spare slot
    for got, want in zip(kinds[0].read(ring, jnp.int32(1)), b):
        assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all()
    ring = kinds[1].write(ring, jnp.int32(1), w)                             # W's pairs take B's slot
    for got, want in zip(kinds[1].read(ring, jnp.int32(1)), w):
        assert got.dtype == want.dtype and (got == want).all()

"""The pipeline executor computes what one device computes, and its stash is bounded by the schedule.

Loss and every gradient leaf against tests/reference.py (fp32, relative error < 1e-5) for
pipe in {2, 4}, micro-batches in {p, 2p}, GPipe, 1F1B and interleaved 1F1B (v = 2), with
recompute none, selective and full, tensor, data and sequence parallelism mixed in across a
covering subset of the cases; pipelined validation loss and logits against the reference too.
"""
import jax
import numpy as np
import pytest

import reference
from layouts import BATCH, SEQ, VOCAB, ZERO_GRADIENT, build, leaf_errors, random_batch, relative, tiny_config
from mtjax.inspect import compile_train_step, executed_flops

TOL = 1e-5

# A covering subset of the 36 cases of the full product (schedule x p in {2, 4} x m in {p, 2p} x
# recompute), each case being one more compile: every schedule, p = 2 and 4, m = p and 2p, each
# recompute mode, tensor with and without SP, data x pipe (interleaved) and the (2, 2, 2) mesh once
# (m = 2, SP), pipelined evaluation under 1F1B and interleaved (stored in run order). The cut
# cases repeated these pairs: a schedule is a table the one executor runs, the same chunk function
# on every layout (zb and zbv: test_zero_bubble_executor.py; data x pipe with the distributed
# optimizer: test_distributed_optimizer.py, test_pipe_sharded_state.py).
CASES = [  # (data, pipe, tensor, m, schedule, arch, sp, recompute)
    (1, 2, 2, 4, "gpipe", "gpt", False, "selective"),
    (1, 4, 1, 8, "1f1b", "llama", False, "none"),
    (2, 2, 2, 2, "interleaved", "llama", True, "selective"),
    (2, 2, 1, 4, "interleaved", "llama", False, "none"),
    (1, 4, 2, 8, "interleaved", "llama", False, "full"),
]
# pipelined evaluation (validation loss and logits) is checked where recompute is none
EVAL = {c for c in CASES if c[-1] == "none" and c[3] == 2 * c[1]}


@pytest.mark.parametrize("data,pipe,tensor,m,schedule,arch,sp,recompute", CASES)
def test_pipeline_matches_reference(data, pipe, tensor, m, schedule, arch, sp, recompute):
    v = 2 if schedule == "interleaved" else 1
    cfg = tiny_config(arch, tensor, pipe, data, sp, micro_batch=BATCH // (data * m),
                      extra=[f"train.micro_batches={m}", f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}",
                             f"model.num_layers={4 * v}", f"train.recompute={recompute}"])
    trainer = build(cfg, data, pipe, tensor)
    assert trainer.plan.micro_batches == m
    state = trainer.init_state()
    batch = random_batch()
    grads, loss = trainer.grad_fn(state.params, trainer.put_batch(batch), state.rng)
    params = jax.device_get(trainer.canonical(state.params))     # interleaved: stored in run order
    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < TOL
    errs = leaf_errors(jax.device_get(trainer.canonical(grads)), ref_grads, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
    if (data, pipe, tensor, m, schedule, arch, sp, recompute) in EVAL:
        eval_loss = trainer.eval_step(state.params, trainer.put_batch(batch))
        assert abs(float(eval_loss) - float(ref_loss)) / float(ref_loss) < TOL
        logits = trainer.logits_fn(state.params, trainer.put_batch(batch[:, :-1]))
        ref_logits = reference.logits(params, batch[:, :-1], cfg.model, VOCAB)
        assert logits.shape == ref_logits.shape
        assert relative(logits, ref_logits) < TOL


def test_interleaved_step_moves_no_layer_between_stages():
    """The layers are stored in the order the executor runs them: the only pipe traffic of an
    interleaved step is the tick loop's activation and gradient sends (plus the gradient sums of
    the parameters shared by the first and last stage), never a reordering of the layer stack."""
    from mtjax.hlo_report import collective_report
    cfg = tiny_config("gpt", 1, 2, 1, extra=["parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                                             "model.num_layers=4", "train.micro_batches=4"])
    trainer = build(cfg, 1, 2, 1)
    ops = collective_report(compile_train_step(trainer).as_text(), trainer.mesh)["ops"]
    ticks = trainer.schedule.ticks
    permutes = [o for o in ops if o["kind"] == "collective-permute"]
    assert len(permutes) == 2 and all(o["multiplicity"] == ticks for o in permutes), permutes
    b, h = trainer.plan.micro_batch, cfg.model.hidden_size      # each an fp32 [b, s, h] (docs/design.md, "Sends")
    assert all(o["bytes"] == 4 * b * SEQ * h and o["axes"] == ("pipe",) for o in permutes), permutes
    assert not [o for o in ops if o["kind"] == "all-to-all"]
    assert _pipe_gathered(ops) <= _shared_elements(trainer)


def _shared_elements(trainer) -> int:
    """Elements of the parameters outside the layer stack (embedding, positions, final norm,
    head): the only ones whose state is spread over `pipe` rather than used where it lives."""
    shapes = jax.eval_shape(trainer.init_state).params
    return sum(int(np.prod(w.shape)) for k, sub in shapes.items() if k != "layers" for w in jax.tree.leaves(sub))


def _pipe_gathered(ops) -> int:
    """Elements all-gathered over `pipe`, per step (loops counted)."""
    return sum(o["elements"] * o["multiplicity"] for o in ops if o["kind"] == "all-gather" and "pipe" in o["axes"])


def test_pipelined_evaluation_keeps_layers_sharded_over_pipe():
    """The forward-only functions take the layers sharded over `pipe` (no rank gathers them all):
    nothing but the shared parameters is all-gathered over `pipe`."""
    from mtjax.hlo_report import collective_report
    cfg = tiny_config("gpt", 1, 4, 1, extra=["model.num_layers=8", "train.micro_batches=4"])
    trainer = build(cfg, 1, 4, 1)
    state = trainer.init_state()
    text = trainer.eval_step.lower(state.params, trainer.put_batch(random_batch())).compile().as_text()
    assert _pipe_gathered(collective_report(text, trainer.mesh)["ops"]) <= _shared_elements(trainer)
    assert trainer.eval_step(state.params, trainer.put_batch(random_batch())).shape == ()


H, S = 64, 64


def _memory_config(m, schedule, v=1, pipe=2, extra=()):
    return tiny_config("gpt", 1, pipe, 1, micro_batch=1,
                       extra=[f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}", f"train.global_batch={m}",
                              f"model.hidden_size={H}", f"model.seq_len={S}", f"model.num_layers={4 * v}", *extra])


def _temp(cfg) -> int:
    """XLA's temporaries of the compiled step (`inspect.report`'s memory.temp_bytes, without the
    rest of the report: its collective, fusion and FLOP counts parse the program several times)."""
    from mtjax.hlo_report import memory_report
    return memory_report(compile_train_step(build(cfg, 1, 2, 1)))["temp_bytes"]


def _temp_bytes(m, schedule, v=1):
    return _temp(_memory_config(m, schedule, v))


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2)])
def test_memory_does_not_grow_with_micro_batches(schedule, v):
    """Per-device temporaries at m = 16p are at most 1.15x those at m = 4p (p = 2, same b)."""
    small, large = _temp_bytes(8, schedule, v), _temp_bytes(32, schedule, v)
    assert large <= 1.15 * small, (small, large)


def test_gpipe_memory_grows_with_micro_batches():
    """GPipe stashes every micro-batch: its temporaries grow by at least the 12 extra stage
    inputs of b*s*h fp32 values each from m = 4 to m = 16."""
    stash = 1 * S * H * 4
    assert _temp_bytes(16, "gpipe") - _temp_bytes(4, "gpipe") >= 12 * stash


# recompute none only: that each stage runs each forward once is what the sum proves; that
# train.recompute is applied under pipelining is test_block_recomputation_under_pipelining's
# full < block < none.
@pytest.mark.parametrize("recompute", ["none"])
def test_executed_flops_summed_over_stages_equal_one_stage(recompute):
    """The matmul FLOPs the compiled step executes (counted in its HLO, the tick loop's branches
    weighted by the schedule), summed over pipe ranks, are within 3% of the same step with pipe = 1:
    a pipelined step computes each forward once, plus only what train.recompute recomputes."""
    def executed(pipe, schedule, v=1):
        cfg = _memory_config(4, schedule, v, pipe, extra=[f"train.recompute={recompute}", "model.num_layers=4"])
        trainer = build(cfg, 1, pipe, 1)
        r = executed_flops(trainer, compile_train_step(trainer).as_text())    # not the whole report
        assert not r["executed_flops_upper_bound"]
        assert len(r["executed_flops_per_pipe_rank"]) == pipe
        return sum(r["executed_flops_per_pipe_rank"])

    one = executed(1, "1f1b")
    # (GPipe is another table of the same lockstep executor, `pipeline/whole_backward.py`: its
    # operations are 1F1B's in another order; interleaved at p = 2, v = 2: two chunks a stage)
    for pipe, schedule, v in [(2, "1f1b", 1), (2, "interleaved", 2)]:
        assert abs(executed(pipe, schedule, v) / one - 1) < 0.03, (pipe, schedule)


def test_executed_flops_with_the_last_tick_after_the_loop():
    """With data parallelism 1F1B runs its last tick (stage 0's last backward, the data reduction
    inside) after the tick loop, on every stage. A forward and a backward still count once each,
    as at d = 1 (the loop's work weighted by the loop's ticks, not the table's), and the last tick
    once per stage: the sum over ranks is d = 1's plus stage 1's backward on a zero gradient."""
    reports = []
    for data in (1, 2):
        cfg = _memory_config(4 * data, "1f1b", extra=[f"parallel.data={data}", "train.recompute=none"])
        trainer = build(cfg, data, 2, 1)
        reports.append(executed_flops(trainer, compile_train_step(trainer).as_text()))
    one, two = (r["pipeline"]["flops_per_operation"] for r in reports)
    for stage_one, stage_two in zip(one, two):
        assert stage_two == pytest.approx(stage_one, rel=1e-6), (one, two)
    total = [sum(r["executed_flops_per_pipe_rank"]) for r in reports]
    assert total[1] == pytest.approx(total[0] + one[1]["B"], rel=1e-6), (total, one)


def test_block_recomputation_under_pipelining():
    """Block mode with N = 1 of each stage's layers: two runs per chunk. The gradients equal the
    reference (dropout off), and its temporaries lie between full's and none's: the runs' weights
    are cut outside the forward's vjp and read again from the parameters, never stashed per
    micro-batch (stashed, a stage's 4 layers' weights, 4 x 197 KB per stash slot, would put
    block above none at b = 1, s = 64, h = 64)."""
    block = ["train.recompute=block", "train.recompute_layers=1"]
    cfg = tiny_config("llama", 1, 2, 1, micro_batch=2, extra=["model.num_layers=4", *block])
    trainer = build(cfg, 1, 2, 1)
    state = trainer.init_state()
    batch = random_batch(4)
    grads, loss = trainer.grad_fn(state.params, trainer.put_batch(batch), state.rng)
    params = jax.device_get(trainer.canonical(state.params))
    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < TOL
    errs = leaf_errors(jax.device_get(trainer.canonical(grads)), ref_grads, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, errs

    def temp(mode):
        extra = ["model.num_layers=8", *(block if mode == "block" else [f"train.recompute={mode}"])]
        return _temp(_memory_config(8, "1f1b", 1, 2, extra=extra))
    full, mid, none = temp("full"), temp("block"), temp("none")
    assert full < mid < none, (full, mid, none)


def test_dropout_masks_follow_the_layer_not_the_stage():
    """Each chunk draws its dropout from its virtual stage's key, so no two stages share masks and
    layouts with the same p v draw the same ones: 1F1B at p = 4 and interleaved at p = 2, v = 2 (one
    layer a virtual stage) give the same gradients with dropout on. Every stage drew its local
    chunk's key before: 1F1B's four layers shared one set of masks."""
    results = []
    for pipe, schedule, v in ((4, "1f1b", 1), (2, "interleaved", 2)):
        cfg = tiny_config("gpt", 1, pipe, 1, extra=["model.num_layers=4", "model.dropout=0.3", "train.micro_batches=4",
                                                    f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}"])
        trainer = build(cfg, 1, pipe, 1)
        state = trainer.init_state()
        grads, loss = trainer.grad_fn(state.params, trainer.put_batch(random_batch()), state.rng)
        results.append((float(loss), jax.device_get(trainer.canonical(grads))))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert abs(loss_a - loss_b) / loss_b < TOL
    errs = leaf_errors(grads_a, grads_b, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}

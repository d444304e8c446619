"""Megatron's communication, read from the compiled train step through `mtjax.inspect`.

Per micro-batch and transformer layer, on `tensor`: 2 all-reduces of b*s*h forward and 2
backward (attention and MLP exits, and the f operators' transposes); with sequence
parallelism the same volume as 2 all-gathers + 2 reduce-scatters each way, plus, as in
Megatron, 2 all-gathers in the backward that re-gather the norm outputs from the saved s/t
shards (the layer does not keep the gathered [b, s, h] tensors). Per micro-batch
outside the layers: the embedding's exit (forward) and the output layer's entry (its
transpose), plus 3 all-reduces of [b, s] in the vocabulary-parallel loss. Once per step: the
gradient all-reduce over `data`, the all-reduce over `tensor` of the gradients that are
partial there, and scalar reductions for the global gradient norm. Nothing else.
"""
import collections

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from layouts import BATCH, SEQ, build, step_report, tiny_config

D, T, B_MICRO = 2, 4, 2
M = BATCH // (B_MICRO * D)      # micro-batches per step


def members(rep, axes):
    """Counter of (kind, elements of the full tensor) over every tensor in collectives on `axes`."""
    out = collections.Counter()
    for op in rep["collectives"]["ops"]:
        if tuple(op["axes"]) != axes:
            continue
        for shape in op["shapes"]:
            dims = [int(x) for x in shape[shape.index("[") + 1:-1].split(",") if x]
            n = int(np.prod(dims)) if dims else 1
            if op["kind"] == "reduce-scatter":
                n *= op["group_size"]          # the result is 1/t of the reduced tensor
            out[(op["kind"], n)] += op["multiplicity"]
    return out


def local_sizes(trainer, mask_only=False):
    """Per-device sizes of the parameters (or of those whose gradients are partial over tensor)."""
    specs = trainer.specs.params
    mask = trainer.plan.params.tensor_sums
    shapes = jax.eval_shape(trainer.init_state).params
    sizes = []
    for shape, spec, partial in zip(jax.tree.leaves(shapes),
                                    jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                                    jax.tree.leaves(mask)):
        if mask_only and not partial:
            continue
        n = int(np.prod(shape.shape))
        for axis in spec:
            n //= trainer.mesh.shape[axis] if axis else 1
        sizes.append(n)
    return sorted(sizes)


# Each architecture with and without SP, one layer (the unrolled scan, no re-gathers) and several;
# the cut gpt-1 without SP and gpt-3 with SP repeat those counts (per layer, linear in layers).
@pytest.mark.parametrize("sp,arch,layers", [(False, "gpt", 3), (False, "llama", 2), (True, "gpt", 1),
                                            (True, "llama", 2)])
def test_tensor_collectives_are_megatrons(arch, layers, sp):
    cfg = tiny_config(arch, tensor=T, data=D, sp=sp, micro_batch=B_MICRO, extra=[f"model.num_layers={layers}", "model.hidden_size=48"])  # b*s != h
    trainer = build(cfg, D, 1, T)
    rep = step_report(trainer)
    h = cfg.model.hidden_size
    bsh, bs = B_MICRO * SEQ * h, B_MICRO * SEQ
    found = members(rep, ("tensor",))

    per_mb = 4 * layers + 2                      # 4 per layer, embedding exit, output-layer entry
    if sp:
        # the backward's re-gathers: with one layer XLA unrolls the length-1 layer scan and merges
        # them with the forward's gathers (CSE), keeping the gathered tensor instead
        regather = 2 * layers if layers > 1 else 0
        assert found.pop(("all-gather", bsh)) == M * (per_mb + regather)
        assert found.pop(("reduce-scatter", bsh)) == M * per_mb
    else:
        assert found.pop(("all-reduce", bsh)) == M * per_mb
    assert found.pop(("all-reduce", bs)) == 3 * M   # loss: max, sum of exponentials, target logit

    grad_reductions = sorted(n for (kind, n), c in found.items() if kind == "all-reduce" and n > 1
                             for _ in range(c))
    assert grad_reductions == local_sizes(trainer, mask_only=True)
    if arch == "gpt" and not sp:
        assert grad_reductions == []             # MHA without SP: every replicated gradient is complete
    rest = {k: v for k, v in found.items() if not (k[0] == "all-reduce" and k[1] > 1)}
    assert set(rest) <= {("all-reduce", 1)}      # only scalars (the global gradient norm) remain

    # bytes: every b*s*h collective moves the fp32 tensor once
    for op in rep["collectives"]["ops"]:
        if tuple(op["axes"]) == ("tensor",) and op["kind"] in ("all-gather", "reduce-scatter"):
            assert op["bytes"] == 4 * bsh


def test_data_parallel_gradient_reduction_runs_once_per_step():
    """Every gradient element is all-reduced over `data` once per step (not per micro-batch): the
    layers' stacks layer by layer, inside the last micro-batch's backward (`step._last_micro_batch`),
    the other leaves whole after it; plus the loss."""
    cfg = tiny_config("gpt", tensor=T, data=D, micro_batch=B_MICRO)
    trainer = build(cfg, D, 1, T)
    found = members(step_report(trainer), ("data",))
    assert set(k[0] for k in found) == {"all-reduce"}
    sizes = sorted(n for (_, n), c in found.items() for _ in range(c))
    layers = cfg.model.num_layers
    shapes = jax.eval_shape(trainer.init_state).params
    specs = jax.tree.leaves(trainer.specs.params, is_leaf=lambda x: isinstance(x, P))
    expected = []
    for (path, shape), spec in zip(jax.tree_util.tree_leaves_with_path(shapes), specs, strict=True):
        n = int(np.prod(shape.shape)) // int(np.prod([trainer.mesh.shape[a] for a in spec if a] or [1]))
        per_layer = jax.tree_util.keystr(path).startswith("['layers']")
        expected += [n // layers] * layers if per_layer else [n]
    assert sizes == sorted(expected + [1])


def test_pipelined_tensor_collectives_count_the_ticks_that_run_them():
    """Under a pipeline the layers' collectives sit in the tick loop's forward and backward
    branches, which a rank takes in m of the loop's ticks each. `inspect` weights them by the
    schedule (as its executed FLOPs): per rank, 6 sequence-major all-gathers and 4 reduce-scatters
    per layer and micro-batch over `tensor` (counted every tick, 1F1B at p = 2, m = 4 has 5); and
    the model ends' crossings, [b, s, h], once per micro-batch on the stage that runs them (the
    embedding's on stage 0, within its forward and backward; the head's on stage 1): m/2 a rank."""
    from mtjax.hlo_report import collective_report
    from mtjax.inspect import compile_train_step, pipeline_scope_weights
    m, stage_layers = 4, 2
    cfg = tiny_config("gpt", tensor=2, pipe=2, sp=True, micro_batch=1,
                      extra=[f"model.num_layers={2 * stage_layers}", f"train.global_batch={m}"])
    trainer = build(cfg, 1, 2, 2)
    rep = collective_report(compile_train_step(trainer).as_text(), trainer.mesh, pipeline_scope_weights(trainer))
    h = cfg.model.hidden_size
    count = collections.Counter()
    for op in rep["ops"]:
        if tuple(op["axes"]) == ("tensor",) and op["shapes"] in ([f"f32[{SEQ},1,{h}]"], [f"f32[{SEQ // 2},1,{h}]"]):
            count[op["kind"]] += op["multiplicity"]
        if tuple(op["axes"]) == ("tensor",) and op["shapes"] in ([f"f32[1,{SEQ},{h}]"], [f"f32[1,{SEQ // 2},{h}]"]):
            count["ends", op["kind"]] += op["multiplicity"]
    assert count == {"all-gather": 6 * m * stage_layers, "reduce-scatter": 4 * m * stage_layers,
                     ("ends", "all-gather"): m, ("ends", "reduce-scatter"): m}, count
    assert not rep["conditionals_upper_bound"]


def test_executed_flops_are_the_models_with_replicated_kv_heads_and_selective_recompute():
    """The matmul FLOPs of the compiled step (docs/guide/inspect.md) against the analytical count
    (`analytical.model_flops_per_step`, Megatron's, recomputation included), per device, Llama with
    k = 2 kv heads at t = 4: each rank projects the one replicated kv head its query heads use (the
    kernel sliced first), which t/k ranks each compute, 4 h d (1 - k/t) a token and layer more,
    three times a step (projecting all k and keeping one was 4 h d (k - k/t)); `selective`
    recomputes the scores but not P V, which the backward does not read: 2 s a d a token and layer
    less than the count."""
    from mtjax.hlo_report import executed_dot_flops
    from mtjax.inspect import compile_train_step
    from mtjax.training.flops import step_flops
    cfg = tiny_config("llama", tensor=T, data=D, micro_batch=B_MICRO,
                      extra=["model.hidden_size=48", "model.num_heads=12", "train.recompute=selective"])
    trainer = build(cfg, D, 1, T)
    m = cfg.model
    h, a, k, d, layers = m.hidden_size, m.num_heads, m.kv_heads, m.head_dim, m.num_layers
    tokens = BATCH * SEQ / trainer.mesh.size * T           # a tensor rank's tokens: every token of its data rank
    replicated_kv = 3 * 4 * h * d * (1 - k / T) * layers * tokens
    skipped_pv = 2 * SEQ * a * d * layers * tokens / T
    executed = executed_dot_flops(compile_train_step(trainer).as_text())["flops"]
    assert executed == step_flops(m, trainer.plan) / trainer.mesh.size + replicated_kv - skipped_pv

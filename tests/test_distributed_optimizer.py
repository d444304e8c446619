"""The distributed optimizer (ZeRO-1) makes the updates of plain optax AdamW on one device, and its
communication is a gradient reduce-scatter plus a parameter all-gather over `data`."""
import collections

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import reference
from layouts import VOCAB, ZERO_GRADIENT, build, leaf_errors, random_batch, step_report, tiny_config, unpad
from mtjax.inspect import persistent_bytes

STEPS = 3


def parameters_per_device(trainer) -> int:
    """Parameters one device holds while computing (these layouts split only over tensor = 2)."""
    shapes = jax.tree.leaves(jax.eval_shape(trainer.init_state).params)
    specs = jax.tree.leaves(trainer.param_specs, is_leaf=lambda x: isinstance(x, P))
    return sum(int(np.prod(s.shape)) // (2 if "tensor" in tuple(sp) else 1) for s, sp in zip(shapes, specs))


def split_over_data(leaf) -> bool:
    names = [n for entry in leaf.sharding.spec for n in (entry if isinstance(entry, tuple) else (entry,))]
    return "data" in names


def reference_run(cfg, params):
    """STEPS steps of optax AdamW (+ clip) on reference gradients, on one device."""
    op = cfg.optim
    mask = jax.tree_util.tree_map_with_path(lambda p, _: p[-1].key not in ("bias", "scale"), params)
    tx = optax.chain(optax.clip_by_global_norm(op.clip_grad),
                     optax.adamw(op.lr, b1=op.beta1, b2=op.beta2, eps=op.eps, weight_decay=op.weight_decay,
                                 mask=mask))
    @jax.jit     # one program per step, not an eager dispatch (and compile) per optax op
    def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = jax.jit(tx.init)(params)
    for i in range(STEPS):
        grads = jax.grad(reference.loss)(params, random_batch(i), cfg.model, VOCAB)
        params, state = update(grads, state, params)
    return params


# data = 4 alone (against one device) and data x pipe x tensor; the cut data = 2 alone is data = 4's
# code on a smaller split (data = 2 with pipe and tensor is the (2, 2, 2) case).
@pytest.mark.parametrize("data,pipe,tensor", [(4, 1, 1), (2, 2, 2)])
def test_distributed_optimizer_equals_adamw_on_one_device(data, pipe, tensor):
    cfg = tiny_config("gpt", tensor, pipe, data, micro_batch=1,
                      extra=["parallel.distributed_optimizer=true", "optim.min_lr=0.001"])  # constant lr
    trainer = build(cfg, data, pipe, tensor)
    state = trainer.init_state()
    start = jax.device_get(state.params)
    # master weights and both moments are split over `data`
    assert all(split_over_data(leaf) for leaf in jax.tree.leaves(state.params))
    mu = state.opt_state[1][0].mu
    assert all(split_over_data(leaf) for leaf in jax.tree.leaves(mu))
    for i in range(STEPS):
        state, _ = trainer.train_step(state, trainer.put_batch(random_batch(i)))
    got = jax.device_get(state.params)

    # The same steps through plain optax AdamW (no distributed optimizer): on one device when the
    # layout is pure data parallelism; with tensor/pipe splits, on the same layout, since their
    # different summation order (~1e-7 in the gradients) is amplified by Adam where |g| ~ eps.
    base = (1, 1, 1) if pipe == tensor == 1 else (data, pipe, tensor)
    single = build(tiny_config("gpt", base[2], base[1], base[0], micro_batch=1, extra=["optim.min_lr=0.001"]),
                   *base)
    one = single.init_state()
    for i in range(STEPS):
        one, _ = single.train_step(one, single.put_batch(random_batch(i)))
    errs = leaf_errors(unpad(got), unpad(jax.device_get(one.params)), skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < 1e-6, {k: v for k, v in errs.items() if v >= 1e-6}

    # and the independent reference model with optax: equal to the model tolerance
    errs = leaf_errors(unpad(got), unpad(reference_run(cfg, start)), skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < 1e-5, {k: v for k, v in errs.items() if v >= 1e-5}


def test_distributed_optimizer_communicates_gradients_once():
    """Over `data`: every gradient element is reduce-scattered once (the layer stacks a layer at a
    time, inside the last backward, `grad_reduce`; the other leaves whole after it), every
    parameter all-gathered once (at the start of the step)."""
    d = 4
    cfg = tiny_config("gpt", 2, 1, d, micro_batch=1, extra=["parallel.distributed_optimizer=true"])
    trainer = build(cfg, d, 1, 2)
    rep = step_report(trainer)
    found = collections.Counter()
    for op in rep["collectives"]["ops"]:
        if tuple(op["axes"]) == ("data",):
            big = op["elements"] > len(op["shapes"])       # scalars: the loss and gradient-norm sums
            found[op["kind"] if big else "scalar"] += op["multiplicity"] * len(op["shapes"])
    leaves = len(jax.tree.leaves(trainer.param_specs, is_leaf=lambda x: isinstance(x, P)))
    in_layers = len(jax.tree.leaves(trainer.param_specs["layers"], is_leaf=lambda x: isinstance(x, P)))
    dims = jax.tree.leaves(trainer.plan.split.data_dims["layers"], is_leaf=lambda x: x is None)
    assert 0 not in dims                     # no layer stack is split along its layer axis here
    assert found["reduce-scatter"] == leaves - in_layers + in_layers * cfg.model.num_layers
    assert found["all-gather"] == leaves
    assert found["all-reduce"] == 0          # beyond scalars, nothing is all-reduced over data
    data_bytes = sum(op["bytes"] * op["multiplicity"] for op in rep["collectives"]["ops"]
                     if tuple(op["axes"]) == ("data",) and op["kind"] == "reduce-scatter")
    assert data_bytes == 4 * parameters_per_device(trainer)     # the fp32 gradient bytes, moved once


def test_the_parameter_all_gather_moves_bf16():
    """Under bf16 the updated weights are gathered over `data` in bf16: one all-gather per leaf, of
    2 bytes per parameter, in the partitioned program (XLA:CPU widens it to f32 later on)."""
    from mtjax.hlo_report import collective_report, partitioned_hlo, select
    from mtjax.inspect import abstract_state
    from mtjax.training.step import batch_sharding
    d = 4
    cfg = tiny_config("gpt", 2, 1, d, micro_batch=1, extra=[
        "parallel.distributed_optimizer=true", "train.precision=bf16"])
    trainer = build(cfg, d, 1, 2)
    batch = jax.ShapeDtypeStruct((8, 17), np.int32, sharding=batch_sharding(trainer.mesh))
    hlo = partitioned_hlo(trainer.train_step.lower(abstract_state(trainer), batch))
    gathers = select(collective_report(hlo, trainer.mesh), kind="all-gather", axes=("data",))
    leaves = jax.tree.leaves(jax.eval_shape(trainer.init_state).params)
    assert len(gathers) == len(leaves)
    assert {op["dtype"] for op in gathers} == {"bf16"}
    assert sum(op["bytes"] for op in gathers) == 2 * parameters_per_device(trainer)


@pytest.mark.parametrize("dist", [False, True, "fsdp"])
def test_persistent_bytes_per_parameter(dist):
    """Argument bytes per parameter between steps: 12 (fp32 weights + 2 moments), 12/d when
    distributed or under FSDP, under bf16 compute, against Megatron's 18, 6 + 12/d (its bf16
    weights and main_grad persist; here they are temporaries of the step) and FSDP's 18/d."""
    d = 4
    layout = ["parallel.fsdp=true"] if dist == "fsdp" else [f"parallel.distributed_optimizer={dist}"]
    cfg = tiny_config("gpt", 2, 1, d, micro_batch=1, extra=[*layout, "train.precision=bf16"])
    trainer = build(cfg, d, 1, 2)
    per = persistent_bytes(trainer, step_report(trainer)["memory"], jax.eval_shape(trainer.init_state).params)
    expected = 12 / d if dist else 12.0
    assert per["expected"] == expected
    assert per["megatron_formula"] == {False: 18.0, True: 6 + 12 / d, "fsdp": 18 / d}[dist]
    assert abs(per["measured"] - expected) < 0.05 * expected    # plus the batch and counters


@pytest.mark.parametrize("case", ["context", "experts"])
def test_persistent_bytes_count_the_replicas_each_leaf_is_split_over(case):
    """The formulas beside the measured bytes (no compile): with context parallelism the state is
    split over data x context, 12/(d c) a parameter (Megatron's distributed optimizer at fp32:
    8 + 8/(d c)); experts already split over the replicas (e = d) are not split again, 12 on
    them and 12/d on the rest (Megatron: 16 on them, 8 + 8/d on the rest)."""
    d, c = 2, 2 if case == "context" else 1
    extra = ["parallel.context=2"] if case == "context" else [
        "model.num_experts=4", "model.moe_top_k=2", "parallel.expert=2"]
    cfg = tiny_config("llama", 1, 1, d, extra=[*extra, "parallel.distributed_optimizer=true"])
    trainer = build(cfg, d, 1, 1, context=c)
    shapes = jax.eval_shape(trainer.init_state).params
    per = persistent_bytes(trainer, {"argument_bytes": None}, shapes)
    experts = sum(int(np.prod(s.shape)) // d for path, s in jax.tree_util.tree_leaves_with_path(shapes)
                  if "experts" in jax.tree_util.keystr(path))
    rest = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes)) - d * experts
    assert per["parameters_per_device"] == experts + rest
    share = experts / (experts + rest)
    assert per["expected"] == pytest.approx(12 * share + 12 / (d * c) * (1 - share))
    assert per["megatron_formula"] == pytest.approx(16 * share + (8 + 8 / (d * c)) * (1 - share))


def test_every_data_size_makes_the_same_update():
    """data in {1, 2, 4}, with tensor, distributed optimizer on: identical updates (with pipe:
    tests/test_pipe_sharded_state.py, pipe 2 makes the updates of pipe 1)."""
    params = {}
    for data, pipe, tensor in [(1, 1, 2), (2, 1, 2), (4, 1, 2)]:
        cfg = tiny_config("gpt", tensor, pipe, data, extra=["parallel.distributed_optimizer=true",
                                                            "train.micro_batches=2"])
        trainer = build(cfg, data, pipe, tensor)
        state, _ = trainer.train_step(trainer.init_state(), trainer.put_batch(random_batch(5)))
        params[data] = unpad(jax.device_get(state.params))
    for data in (2, 4):
        errs = leaf_errors(params[data], params[1], skip=(ZERO_GRADIENT,))
        assert max(errs.values()) < 1e-5, (data, {k: v for k, v in errs.items() if v >= 1e-5})


def test_data_all_reduce_of_the_layers_runs_inside_the_last_backward():
    """Without the distributed optimizer, the layers' gradients are all-reduced over `data` inside
    the last micro-batch's backward, layer by layer (Megatron's overlap_grad_reduce): in the
    compiled step the data all-reduces of the layer gradients sit in a loop that runs once per
    layer, they move every layer gradient's fp32 bytes once per step (not once per micro-batch:
    m = 2 here), and what is left after the backward is the small leaves outside the layers."""
    from mtjax.training.grad_reduce import overlaps_data_reduction
    d, layers = 2, 2
    cfg = tiny_config("gpt", 2, 1, d, micro_batch=2)           # B = 8 over d = 2: m = 2 micro-batches
    trainer = build(cfg, d, 1, 2)
    assert overlaps_data_reduction(trainer.plan) and trainer.plan.micro_batches == 2
    rep = step_report(trainer)
    data_reduces = [op for op in rep["collectives"]["ops"] if tuple(op["axes"]) == ("data",)
                    and op["kind"] == "all-reduce" and op["elements"] > len(op["shapes"])]
    in_loop = [op for op in data_reduces if op["multiplicity"] == layers]
    after = [op for op in data_reduces if op["multiplicity"] == 1]
    assert in_loop and len(in_loop) + len(after) == len(data_reduces)
    shapes = jax.eval_shape(trainer.init_state).params
    specs = trainer.param_specs
    local = lambda s, sp: int(np.prod(s.shape)) // (2 if "tensor" in tuple(sp) else 1)   # noqa: E731
    layer_bytes = 4 * sum(local(s, sp) for s, sp in zip(jax.tree.leaves(shapes["layers"]),
                                                        jax.tree.leaves(specs["layers"], is_leaf=lambda x: isinstance(x, P))))
    assert sum(op["bytes"] * op["multiplicity"] for op in in_loop) == layer_bytes
    rest = sum(op["bytes"] for op in after) - (4 * parameters_per_device(trainer) - layer_bytes)
    assert 0 <= rest <= 8, rest              # XLA may combine the loss's fp32 scalar into one of them


@pytest.mark.parametrize("zero", [False, True])
def test_pipelined_data_reduction_of_the_layers_runs_inside_the_last_backward(zero):
    """With a pipeline (1F1B, p = 2), the step's last tick (stage 0's last backward) runs after the
    tick loop with the data reduction inside its layer scan: in the compiled step the layers'
    data all-reduces (reduce-scatters with the distributed optimizer) run once per layer of the
    stage, outside the tick loop, each layer gradient's fp32 bytes once per step."""
    d, pipe, layers = 2, 2, 4
    extra = ["model.num_layers=4", "train.micro_batches=2"] + (["parallel.distributed_optimizer=true"] if zero else [])
    trainer = build(tiny_config("gpt", 1, pipe, d, extra=extra), d, pipe, 1)
    kind = "reduce-scatter" if zero else "all-reduce"
    reduces = [op for op in step_report(trainer)["collectives"]["ops"] if tuple(op["axes"]) == ("data",)
               and op["kind"] == kind and op["elements"] > len(op["shapes"])]
    in_loop = [op for op in reduces if op["multiplicity"] == layers // pipe]
    assert in_loop and all(op["multiplicity"] in (1, layers // pipe) for op in reduces)
    if not zero:
        shapes = jax.eval_shape(trainer.init_state).params["layers"]
        stage_bytes = 4 * sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes)) // pipe
        assert sum(op["bytes"] * op["multiplicity"] for op in in_loop) == stage_bytes


@pytest.mark.parametrize("data,pipe,layers", [(4, 1, 4), (2, 2, 8)])
def test_no_layer_leaf_is_split_along_the_layer_axis_while_another_dimension_divides(data, pipe, layers):
    """The state split (`zero.scatter_dim`) takes a layer leaf's layer axis only when no other
    dimension divides d: one split along it is reduced after the backward, not in it
    (`grad_reduce.AFTER`), and FSDP holds it whole. The GPT fc1 bias [l, f] has no free dimension
    (`pipe`, `tensor`), and l/p divisible by d made it the layer axis; f divides too. No compile."""
    cfg = tiny_config("gpt", 1, pipe, data, extra=[f"model.num_layers={layers}", "parallel.fsdp=true"])
    trainer = build(cfg, data, pipe, 1)
    dims = jax.tree_util.tree_leaves_with_path(trainer.plan.split.data_dims["layers"])
    on_layer_axis = []
    for (path, dim), shape in zip(dims, jax.tree.leaves(trainer.plan.params.shapes["layers"]), strict=True):
        local = [n // (pipe if i == 0 else 1) for i, n in enumerate(shape.shape)]   # tensor = 1
        if dim == 0 and any(n % data == 0 for n in local[1:]):
            on_layer_axis.append(jax.tree_util.keystr(path))
    assert not on_layer_axis
    assert all(k is not None for _, k in trainer.plan.fsdp.dims), trainer.plan.fsdp.dims    # none held whole

"""`python -m mtjax.inspect --config FILE [--cpu-devices N] [--json] [group.field=value ...]`

Compiles the train step for a config without running it and prints a short summary
(`mtjax.inspect_summary`): the layout, per-device memory, the FLOPs executed per step, the
collectives per step by mesh axis, and the GPU prediction with `--target`. Nothing is read but
the tokenizer and nothing is written.

`--json` prints the whole report as one JSON object: per-device memory from XLA, every
collective of the compiled program (count and bytes per kind and per mesh axis, loop bodies
counted per execution; collectives over groups of one device, which send nothing, apart under
`no_op`), the matmul FLOPs the program executes (`executed_flops_per_device`, counted from its
HLO, loops included), the analytical figures to hold them against (Megatron's FLOPs, parameter
count), and XLA's own cost analysis under `xla_cost_analysis`, whose counts take each loop body
once whatever its trip count (so for a scanned model they are not the step's).

`--target h100 [--gpus N]` compiles the step with XLA:GPU for N H100s that are not here
(`mtjax.compile_only`; needs JAX's CUDA plugin) instead of this machine's devices, and adds a
`gpu` section: every kernel of the optimized program with its modelled time, the predicted step
time and MFU, per kind, per loop and per layer (`mtjax.hlo_report.gpu_report`). N defaults to
data x pipe x context x tensor (data = -1 counting 1).
"""
from __future__ import annotations

import json
import time

from mtjax import cli
from mtjax.inspect_target import MAX_GPUS, check_target_options, target_setup


def abstract_state(trainer):
    """ShapeDtypeStructs of the TrainState, carrying their shardings (nothing allocated)."""
    import jax
    shapes = jax.eval_shape(trainer.init_state)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, trainer.state_shardings)


def compile_train_step(trainer):
    """The compiled train step (jax.stages.Compiled) for abstract inputs."""
    import jax
    import jax.numpy as jnp

    from mtjax.training.step import batch_sharding
    plan = trainer.plan
    batch = jax.ShapeDtypeStruct((plan.global_batch, plan.seq_len + 1), jnp.int32,
                                 sharding=batch_sharding(trainer.mesh))
    return trainer.train_step.lower(abstract_state(trainer), batch).compile()


def persistent_bytes(trainer, memory: dict, shapes) -> dict:
    """Bytes per parameter that live on a device across steps (XLA's argument bytes of the step,
    i.e. the TrainState shard and the batch), against the formulas.

    Megatron (Rajbhandari et al.'s accounting) with 16-bit compute keeps bf16 weights 2, an fp32
    main_grad 4, and the fp32 master + 2 moments 12 between steps: 18, or 6 + 12/d with the
    distributed optimizer; with fp32 compute the weights are the master: 16, or 8 + 8/d. Our state
    holds only the master and moments, 12 or 12/d: the compute copy and the gradient sums are
    temporaries of the step (cast and gathered at its start, reduced at its end), which costs no
    more at the step's peak (the copy and the sums exist then in both designs) and less between
    steps. Under FSDP (ZeRO-3) Megatron's FSDP splits every one of those buffers over the d
    replicas: 18/d with 16-bit compute, 16/d with fp32.

    Here d is, per leaf, the replicas its state is split over beyond the compute layout
    (`training/zero.py`): data x context, 1 for a leaf already split over them (experts at
    e = d c) or whole over them. With p > 1 the state of the leaves replicated over `pipe`
    (embedding, positions, final norm, head) is split over `pipe` too: r the share of a device's
    parameters (as it computes with them) so split, f = 1 - r (1 - 1/p). `expected` is 12 bytes a
    parameter of the state's shards, over all leaves (12 f, or 12 f/d when every leaf splits d
    ways); Megatron's formula takes each leaf's d and no pipe split.
    """
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    from mtjax.mesh import CONTEXT, DATA, PIPE

    def names(spec):
        return [a for n in spec if n is not None for a in (n if isinstance(n, tuple) else (n,))]
    sizes = dict(trainer.mesh.shape)
    ways = lambda axes: int(np.prod([sizes[a] for a in axes] or [1]))  # noqa: E731
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    dist, fsdp = trainer.plan.distributed_optimizer, trainer.plan.fsdp is not None
    half = trainer.plan.precision != "fp32"
    base, split = (18.0, 12.0) if half else (16.0, 8.0)    # Megatron's bytes, and those ZeRO-1 splits
    per_device = pipe_split = state = megatron = 0
    for shape, spec, state_spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(trainer.param_specs, is_leaf=is_spec),
                                       jax.tree.leaves(trainer.specs.params, is_leaf=is_spec)):
        size, computed, kept = int(np.prod(shape.shape)), names(spec), names(state_spec)
        n = size // ways(computed)
        per_device += n
        pipe_split += n if PIPE in kept and PIPE not in computed else 0
        state += size // ways(kept)
        d = ways([a for a in kept if a in (DATA, CONTEXT) and a not in computed])
        megatron += n * (base / d if fsdp else base - split + split / d if dist else base)
    measured = memory["argument_bytes"] / per_device if memory.get("argument_bytes") is not None else None
    return {"parameters_per_device": per_device, "pipe_split_share": pipe_split / per_device, "measured": measured,
            "expected": 12 * state / per_device, "megatron_formula": megatron / per_device}


def pipeline_scope_weights(trainer) -> list[dict]:
    """One `executed_dot_flops` scope_weights dict per pipe rank: {named scope of the tick loop's
    work: the share of the loop's ticks in which that rank takes it} (`pipeline.scopes`: the
    executor runs each tick's forward, head and backward under its own scope, and the last
    tick, where it runs after the loop, under one every rank runs once). Without pipelining
    there is no tick loop: [{}]."""
    if trainer.plan.pipe == 1:
        return [{}]
    from mtjax.pipeline.scopes import scope_weights
    from mtjax.training.grad_reduce import last_tick_after_loop
    return scope_weights(trainer.schedule, last_tick_after_loop(trainer.plan))


def pipeline_scope_ticks(trainer) -> list[dict] | None:
    """Per pipe rank, {named scope: bool [the tick loop's ticks]} (`scopes.loop_scope_table`),
    for the lockstep time of `gpu_report`; None without pipelining."""
    if trainer.plan.pipe == 1:
        return None
    from mtjax.pipeline.scopes import loop_scope_table
    from mtjax.training.grad_reduce import last_tick_after_loop
    return loop_scope_table(trainer.schedule, last_tick_after_loop(trainer.plan))


def executed_flops(trainer, hlo_text: str) -> dict:
    """Matmul FLOPs the compiled step executes: per pipe rank (with that rank's scope weights),
    and per device = their mean, so that summed over the pipe ranks it is per device x pipe.
    (The SPMD program is one device's; ranks differ only in which conditional branches they
    take: the pipeline's tick loop, weighted per rank by scope, and the ring attention's blocks,
    whose branches cost the same and count once, `hlo_report.equal_branches_once`.)"""
    from mtjax.hlo_report import executed_dot_flops
    per_rank = [executed_dot_flops(hlo_text, w) for w in pipeline_scope_weights(trainer)]
    flops = [r["flops"] for r in per_rank]
    out = {"executed_flops_per_device": sum(flops) / len(flops), "executed_flops_per_pipe_rank": flops,
           # True while some conditional's work is counted as if taken on every execution
           "executed_flops_upper_bound": any(r["conditionals_upper_bound"] for r in per_rank)}
    if trainer.plan.pipe > 1:
        from mtjax.training.grad_reduce import last_tick_after_loop
        out["pipeline"] = pipeline_work(trainer.schedule, per_rank, last_tick_after_loop(trainer.plan))
    return out


def pipeline_work(schedule, per_rank: list[dict], final_after_loop: bool = False) -> dict:
    """The schedule's table read at the executed costs: per stage, the matmul FLOPs of one F (a
    chunk's forward), one B (its backward; split: the input gradient only, with any recomputation)
    and one W (split: the weight gradients), from the named scopes of the tick loop's work
    (`scopes.scope_ticks` in the loop; the head's loss and its backward, and the last tick when
    `final_after_loop`, are counted apart); their ratios
    F:B:W (means over stages, F = 1); and the table's lockstep time over ideal at those ratios
    beside the assumed ones' (`Schedule.time_over_ideal`)."""
    from fractions import Fraction

    from mtjax.pipeline.scopes import BACKWARD_SCOPE, FORWARD_SCOPE, WEIGHT_SCOPE, scope_ticks
    work = {"F": FORWARD_SCOPE, "B": BACKWARD_SCOPE, "W": WEIGHT_SCOPE}
    stages = [{k: r["by_scope"].get(scope, 0.0) / n[scope] if n[scope] else 0.0 for k, scope in work.items()}
              for r, n in zip(per_rank, scope_ticks(schedule, schedule.ticks - final_after_loop))]
    mean = {k: sum(s[k] for s in stages) / len(stages) for k in work}
    ratios = [mean[k] / mean["F"] for k in ("F", "B", "W")] if mean["F"] else None
    costs = None if ratios is None else [Fraction(round(x, 3)).limit_denominator(1000) for x in ratios]
    if costs is not None and not schedule.split:
        costs = costs[:2]      # the backward is whole: B holds the weight gradients
    measured = None if costs is None else float(schedule.time_over_ideal(costs=costs))
    return {"schedule": schedule.name, "ticks": schedule.ticks,
            "max_in_flight": [int(n) for n in schedule.max_in_flight()],
            "w_pending": [int(n) for n in schedule.w_pending()],
            "slots_held": [int(n) for n in schedule.slots_held()], "flops_per_operation": stages,
            "measured_costs": None if costs is None else ",".join(f"{float(c):g}" for c in costs),
            "time_over_ideal": float(schedule.time_over_ideal()), "time_over_ideal_at_measured_costs": measured}


def report(trainer, target: str | None = None) -> dict:
    """The inspector's report for a built Trainer; with `target` (a GPU of
    `hlo_report.hardware.TARGETS` whose compile-only devices the mesh holds) its `gpu` section."""
    import jax

    from mtjax.hlo_report import compiled_report
    from mtjax.inspect_summary import plan_layout
    from mtjax.model.layer_pattern import layer_pattern
    from mtjax.training.flops import (expert_slots_per_token, inactive_parameters, megatron_formula, model_flops,
                                      parameter_count, step_flops)
    cfg, plan = trainer.cfg, trainer.plan
    t0 = time.perf_counter()
    compiled = compile_train_step(trainer)
    compile_s = time.perf_counter() - t0
    out = compiled_report(compiled, trainer.mesh, pipeline_scope_weights(trainer))  # tick work: its ranks' mean
    xla = out.pop("flops")
    out["xla_cost_analysis"] = {"flops_loop_bodies_once": xla["flops"],
                                "bytes_accessed_loop_bodies_once": xla["bytes_accessed"]}
    out["collectives"] = without_no_ops(out["collectives"])
    shapes = jax.eval_shape(trainer.init_state).params
    out["compile_seconds"] = compile_s
    out["layout"] = plan_layout(plan)
    out["persistent_bytes_per_parameter"] = persistent_bytes(trainer, out["memory"], shapes)
    per_step = step_flops(cfg.model, plan)
    weights = parameter_count(shapes)
    out["analytical"] = {
        "parameters": weights,
        "active_parameters": weights - inactive_parameters(cfg.model),
        "model_flops_per_step": per_step,
        "model_flops_per_step_per_device": per_step / trainer.mesh.size,
        "megatron_formula_flops_per_step": megatron_formula(cfg.model, plan.padded_vocab, plan.global_batch),
    }
    if cfg.model.moe:      # what the experts' static buffers execute, empty slots included
        slots = expert_slots_per_token(cfg.model, plan.context)
        out["analytical"] |= {"moe_top_k": cfg.model.moe_top_k, "expert_slots_per_token": slots,
                              "expert_slot_flops_per_step_per_device":
                              step_flops(cfg.model, plan, slots) / trainer.mesh.size}
    text = compiled.as_text()
    out |= executed_flops(trainer, text)
    # the layer scans' rows (units of f layers)
    rows = layer_pattern(cfg.model, plan.layers_per_chunk).rows(plan.layers_per_chunk)
    unit = trainer.layout.local_model().ctx.half_batch_unit(rows) or 1   # rows per loop iteration
    out["fusion"]["per_layer"] = per_layer_fusions(out["fusion"]["loops"], rows // unit, unit)
    if target is not None:
        from mtjax.hlo_report.gpu_report import gpu_report
        mfu_flops = model_flops(cfg.model, plan) / trainer.mesh.size                    # MFU: no recomputation
        out["gpu"] = gpu_report(text, mfu_flops, target, trainer.mesh.size, rows // unit,
                                pipeline_scope_weights(trainer) if plan.pipe > 1 else None, unit,
                                pipeline_scope_ticks(trainer))
        out["gpu"]["tokens_per_s"] = plan.global_batch * plan.seq_len / out["gpu"]["predicted_step_s"]
    return out


def without_no_ops(coll: dict) -> dict:
    """A collective_report with the collectives over groups of one device (no mesh axis: each
    device reduces or gathers with itself, nothing is sent) taken out of `by_kind` and
    `by_axes` and counted apart under `no_op`; `ops` keeps every op (axes () for those)."""
    by_kind, no_op = {}, {}
    for op in coll["ops"]:
        entry = (by_kind if op["axes"] else no_op).setdefault(op["kind"], {"count": 0, "bytes": 0})
        entry["count"] += op["multiplicity"]
        entry["bytes"] += op["multiplicity"] * op["bytes"]
    by_axes = {axes: kinds for axes, kinds in coll["by_axes"].items() if axes}
    return {**coll, "by_kind": by_kind, "by_axes": by_axes, "no_op": no_op}


def per_layer_fusions(loops: list[dict], layers: int, unit: int = 1) -> dict:
    """Fusions and unfused elementwise ops of one layer, forward and backward: the loop bodies
    that run `layers` times and hold no loop that does too (the layer scans; block recompute's
    two runs of other lengths are not found), plus the loops inside them times their trip
    count (with dropout, XLA:CPU keeps the random-bit generator's rounds as a small loop);
    divided by `unit`, the layers one iteration runs (half-batch units: their mean). A unit that
    is the whole run leaves a loop of one iteration, which XLA removes: nothing is found."""
    runs = [loop for loop in loops if loop["trip_count"] == layers]
    outer = {loop["parent"] for loop in runs}
    layer = [loop for loop in runs if loop["body"] not in outer]
    bodies = {loop["body"] for loop in layer}
    inner = [loop for loop in loops if loop["parent"] in bodies]
    weighted = [(loop, 1) for loop in layer] + [(loop, loop["trip_count"] or 1) for loop in inner]
    kinds = {}
    for loop, n in weighted:
        for kind, k in loop["fusions"].items():
            kinds[kind] = kinds.get(kind, 0) + k * n
    mean = (lambda k: k) if unit == 1 else (lambda k: k / unit)            # noqa: E731
    return {"bodies": sorted(bodies), "nested_loops": len(inner), "layers_per_iteration": unit,
            "fusions": {kind: mean(k) for kind, k in sorted(kinds.items())},
            "fusion_count": mean(sum(loop["fusion_count"] * n for loop, n in weighted)),
            "unfused_elementwise_count": mean(sum(loop["unfused_elementwise_count"] * n for loop, n in weighted))}


def main(argv: list[str]) -> int:
    from mtjax.hlo_report.hardware import TARGETS
    parser = cli.make_parser("python -m mtjax.inspect", "Compile the train step and print its memory, FLOPs and "
                             "collectives (--json: the full report, fusions and kernels included).",
                             check_options=check_target_options)
    parser.add_argument("--json", action="store_true", help="print the full report as one JSON object")
    parser.add_argument("--target", choices=sorted(TARGETS), default=None,
                        help="compile for this GPU (not present; needs JAX's CUDA plugin) and model its step time")
    parser.add_argument("--gpus", type=int, default=None, metavar="N",
                        help=f"with --target: the number of GPUs, 1 to {MAX_GPUS} (default data x pipe x context "
                             "x tensor)")
    args = parser.parse_args(argv)
    cfg, mesh = target_setup(args) if args.target else cli.setup(args)
    from mtjax.data.tokenizer import config_tokenizer
    from mtjax.training.data_setup import completed_config, resolve_vocab
    from mtjax.training.trainer import Trainer
    tokenizer = config_tokenizer(completed_config(cfg))
    trainer = Trainer(cfg, mesh, resolve_vocab(cfg, tokenizer.vocab_size), eod=tokenizer.eod_id)
    rep = report(trainer, args.target)
    if args.json:
        print(json.dumps(rep, indent=1, default=str))
        return 0
    from mtjax.inspect_summary import summary
    from mtjax.training.metrics import devices_text, layout
    devices = devices_text(mesh.size, mesh.devices.flat[0].platform, args.target)
    print(summary(rep, layout(trainer.plan, cfg, devices)))
    return 0


if __name__ == "__main__":
    cli.run(main)

"""`python -m mtjax.inspect`'s default output: its report (`mtjax.inspect.report`) as a few lines.

The layout; per-device memory (XLA's buffer assignment) and the state's bytes per parameter;
the matmul FLOPs the step executes per device (loops counted through their trip counts) beside
the model's; the collectives per step by mesh axis; the schedule's time over ideal when
pipelined; the GPU prediction with `--target`. `--json` prints the whole report instead.
"""
from __future__ import annotations

from mtjax.training.metrics import size


def summary(rep: dict, layout: list[str]) -> str:
    """The report `rep` in lines, under the layout fields `layout` (`training.metrics.layout`)."""
    lines = [f"layout: {'; '.join(layout)}", memory_line(rep), flops_line(rep), *collective_lines(rep["collectives"])]
    if "pipeline" in rep:
        lines.append(pipeline_line(rep["pipeline"]))
    if "gpu" in rep:
        lines.append(gpu_line(rep["gpu"]))
    lines.append(f"compiled in {rep['compile_seconds']:.1f} s; --json prints the full report")
    return "\n".join(lines)


def plan_layout(plan) -> dict:
    """The report's `layout` section: the mesh (data x pipe x context x tensor devices) and the
    step's shape, from a `training.plan.StepPlan`."""
    return {"data": plan.data, "pipe": plan.pipe, "context": plan.context, "tensor": plan.tensor,
            "micro_batches": plan.micro_batches, "micro_batch": plan.micro_batch,
            "seq_len": plan.seq_len, "vocab": plan.vocab, "padded_vocab": plan.padded_vocab,
            "sequence_parallel": plan.sequence_parallel, "precision": plan.precision,
            "recompute": plan.recompute.mode, "attention": plan.attention}


def memory_line(rep: dict) -> str:
    """Peak estimate = arguments + outputs + temporaries - aliased (donated) buffers, per device."""
    m, state = rep["memory"], rep["persistent_bytes_per_parameter"]
    if m["peak_estimate_bytes"] is None:
        return "memory per device: not reported by this backend"
    parts = [f"arguments {size(m['argument_bytes'])}", f"outputs {size(m['output_bytes'])}",
             f"temporaries {size(m['temp_bytes'])}", f"aliased {size(m['alias_bytes'])}"]
    kept = "" if state["measured"] is None else (
        f"; between steps {state['measured']:.3g} bytes per parameter (expected {state['expected']:.3g}: the fp32 "
        f"master weights and 2 moments, as split; Megatron's formula {state['megatron_formula']:.3g})")
    return f"memory per device: peak {size(m['peak_estimate_bytes'])} ({', '.join(parts)}){kept}"


def flops_line(rep: dict) -> str:
    """Executed: the program's matmuls through loop trip counts (the mean over pipe ranks);
    model: Megatron's count of the step (recomputation included) over the devices."""
    executed = rep["executed_flops_per_device"]
    bound = " (an upper bound: some branches counted as always taken)" if rep["executed_flops_upper_bound"] else ""
    model = rep["analytical"]["model_flops_per_step_per_device"]
    a = rep["analytical"]
    active = f", {a['active_parameters']:,} active" if a["active_parameters"] != a["parameters"] else ""
    return (f"FLOPs per device per step: {si(executed)}FLOP of matmuls executed{bound}; "
            f"the model's {si(model)}FLOP ({a['parameters']:,} parameters{active}){_slots(rep)}")


def _slots(rep: dict) -> str:
    """MoE: the experts run static buffers of C slots a row each, filled or not (E C slots for the
    k s routed entries of a row of s tokens), so the step executes more than the model's active FLOPs."""
    a = rep["analytical"]
    if "expert_slots_per_token" not in a:
        return ""
    return (f"; {si(a['expert_slot_flops_per_step_per_device'])}FLOP with the experts' empty capacity slots "
            f"({a['expert_slots_per_token']:.3g} expert MLPs run a token, {a['moe_top_k']} routed)")


def collective_lines(coll: dict) -> list[str]:
    """One line per mesh axis (group): each kind's count per step and bytes moved per device."""
    if not coll["by_axes"] and not coll.get("no_op"):
        return ["collectives per step: none"]
    bound = " (an upper bound: some branches counted as always taken)" if coll.get("conditionals_upper_bound") else ""
    lines = [f"collectives per step, by mesh axis (count, bytes per device: each collective's whole tensor, "
             f"an all-gather's result, a reduce-scatter's operand){bound}:"]
    for axes, kinds in sorted(coll["by_axes"].items()):
        lines.append(f"  {axes}: {_kinds(kinds)}")
    if coll.get("no_op"):
        lines.append(f"  no-op (groups of one device, nothing sent): {_kinds(coll['no_op'])}")
    return lines


def _kinds(kinds: dict) -> str:
    return ", ".join(f"{kind} {v['count']:g} ({size(v['bytes'])})" for kind, v in sorted(kinds.items()))


def pipeline_line(p: dict) -> str:
    measured = "" if p["time_over_ideal_at_measured_costs"] is None else (
        f", {p['time_over_ideal_at_measured_costs']:.3f} at the executed costs {p['measured_costs']}")
    return (f"pipeline {p['schedule']}: {p['ticks']} ticks, time over ideal {p['time_over_ideal']:.3f}{measured}; "
            f"micro-batches in flight per stage {p['max_in_flight']}")


def gpu_line(g: dict) -> str:
    mfu = "" if g["predicted_mfu"] is None else f", MFU {g['predicted_mfu']:.1%}"
    lock = g.get("pipeline_lockstep")
    bubble = "" if lock is None else (f" (lockstep: {lock['bubble_s'] * 1e3:.2f} ms of it waiting in the "
                                      "pipeline's ticks)")
    return (f"GPU {g['target']} (predicted): step {g['predicted_step_s'] * 1e3:.2f} ms{bubble}{mfu}, "
            f"{g['tokens_per_s']:,.0f} tokens/s, exposed collectives {g['exposed_collective_s'] * 1e3:.2f} ms")


def si(x: float) -> str:
    """A count in decimal prefixes with its trailing space: '1.61 G', '240 M'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}"
    return f"{x:.3g} "

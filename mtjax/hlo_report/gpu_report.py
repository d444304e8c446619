"""The `gpu` section of `mtjax.inspect --target`: the kernels of `gpu_model.kernel_times` summed
into a predicted step time and MFU, by kind, per loop and per layer.

    predicted_step_s = sum over kernels of time x executions
                       + exposed collective time + loop iterations x loop cost
    predicted_mfu    = Megatron's model FLOPs per step and device / predicted_step_s / peak
"""
from __future__ import annotations

import re

from mtjax.hlo_report.gpu_model import kernel_times
from mtjax.hlo_report.hardware import TARGETS, GpuSpec
from mtjax.hlo_report.parse import _NAME, _TRIP_RE, FUSION_OPS, _call_edges

TOP = 5


def _top(kernels: list, n: int = TOP, per: str = "total") -> list:
    """The n kernels with the most time (per step, or per execution of their computation): name,
    kind, bound, time per execution (us), executions, and FLOPs and bytes read plus written per
    execution."""
    key = (lambda k: k["time_s"] * k["executions"]) if per == "total" else (lambda k: k["time_s"])
    return [{"name": k["name"], "kind": k["kind"], "bound": k["bound"], "time_us": round(k["time_s"] * 1e6, 2),
             "executions": k["executions"], "flops": k["flops"], "bytes": k["bytes"]}
            for k in sorted(kernels, key=key, reverse=True)[:n]]


def _by_kind(kernels: list) -> dict:
    out = {}
    for k in kernels:
        row = out.setdefault(k["kind"], {"count": 0, "flops": 0.0, "bytes": 0.0, "time_s": 0.0})
        row["count"] += k["executions"]
        row["flops"] += k["flops"] * k["executions"]
        row["bytes"] += k["bytes"] * k["executions"]
        row["time_s"] += k["time_s"] * k["executions"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["time_s"]))


def _loops(program, kernels: list) -> list:
    """Per while loop: its body's kernels (nested loops' kernels times their trip counts, through
    calls and branches), per iteration."""
    parsed = program.parsed
    loops = []
    for comp, instrs in parsed.items():
        for instr in instrs:
            if instr["opcode"] != "while" or not program.mult[comp]:
                continue
            body = re.search(r"\bbody=" + _NAME, instr["attrs"]).group(1)
            trip = _TRIP_RE.search(instr["raw"])
            weights = _reach(parsed, body)
            inside = [(k, weights[k["computation"]]) for k in kernels if k["computation"] in weights]
            loops.append({"body": body, "trip_count": int(trip.group(1)) if trip else None,
                          "inner_bodies": sorted(c for c in weights if c != body),
                          "executions": program.mult[body],
                          "kernels_per_iteration": sum(w for _, w in inside),
                          "time_s_per_iteration": sum(k["time_s"] * w for k, w in inside),
                          "top": _top([k | {"executions": w} for k, w in inside])})
    return loops


def _reach(parsed: dict, root: str) -> dict:
    """{computation: runs per run of `root`} for the unfused computations `root` calls (loops
    times their trip count, everything else once)."""
    out, todo = {}, [(root, 1)]
    while todo:
        comp, w = todo.pop()
        out[comp] = out.get(comp, 0) + w
        for instr in parsed.get(comp, []):
            if instr["opcode"] in FUSION_OPS:
                continue
            for callee, factor, _ in _call_edges(instr, [], comp):
                if callee in parsed:
                    todo.append((callee, w * factor))
    return out


def gpu_report(hlo_text: str, model_flops: float, target: str | GpuSpec = "h100", num_devices: int = 1,
               layers: int | None = None, rank_scope_weights: list | None = None, unit: int = 1,
               rank_scope_ticks: list | None = None) -> dict:
    """The modelled time of one execution of a compiled program on `target` (see module docstring).
    `model_flops`: Megatron's FLOPs of the step per device; `layers`: the trip count of the layer
    loops, for the `per_layer` summary (the loop bodies that run `layers` times per execution of
    their parent and hold no such loop themselves); `unit`: the layers one iteration of those loops
    runs (half-batch units, `block.halved`), by which the summary is divided. `rank_scope_weights`:
    one scope-weight dict per pipe rank (`kernel_times`); the SPMD program is every rank's, only
    its branches differ: `per_pipe_rank_step_s` gives each rank's own time, and the report is the
    slowest rank's. With `rank_scope_ticks` (per rank, {scope: bool [ticks]}: the tick loop's
    ticks that run the scope's work, `pipeline.scopes.loop_scope_table`) the step is the lockstep
    time instead (`lockstep`): a tick lasts as long as its slowest rank's work, so the schedule's
    bubble counts, which a rank's own sum leaves out."""
    spec = TARGETS[target] if isinstance(target, str) else target
    ranks = [_rank_report(hlo_text, model_flops, spec, num_devices, layers, w, unit)
             for w in rank_scope_weights or [None]]
    out = max(ranks, key=lambda r: r["predicted_step_s"])
    if rank_scope_weights:
        out["per_pipe_rank_step_s"] = [r["predicted_step_s"] for r in ranks]
    if rank_scope_ticks:
        out["pipeline_lockstep"] = lockstep(ranks, rank_scope_ticks)
        step = out["predicted_step_s"] = out["pipeline_lockstep"]["step_s"]
        out["predicted_mfu"] = model_flops / step / spec.peak_flops if step else None
    return out


def lockstep(ranks: list[dict], tables: list[dict]) -> dict:
    """The pipelined step as the ranks run it, in lockstep ticks:

        step = max_i R_i + sum over ticks t of max_i sum_s [rank i runs s in t] c_i(s)

    where c_i(s) = rank i's time under scope s (kernels and exposed collectives) / the ticks in
    which it runs s (one execution's time), and R_i is the rest of rank i's time (the work
    outside the tick loop's scopes: before and after the loop, and what every tick runs
    unconditionally). A rank's own time, R_i + sum_t (...), leaves out the ticks it waits for a
    slower rank: the schedule's bubble (`bubble_s`, against the slowest rank's own time)."""
    import numpy as np
    ticks, rest = [], []
    for rank, table in zip(ranks, tables):
        scoped = {s: rank["time_by_scope"].get(s, 0.0) for s in table}
        cost = {s: scoped[s] / a.sum() for s, a in table.items() if a.sum()}
        ticks.append(sum((table[s] * c for s, c in cost.items()), np.zeros(len(next(iter(table.values()))))))
        rest.append(rank["predicted_step_s"] - sum(scoped.values()))
    step = max(rest) + float(np.max(ticks, axis=0).sum())
    own = max(r["predicted_step_s"] for r in ranks)
    return {"ticks": len(ticks[0]), "step_s": step, "bubble_s": step - own,
            "tick_s": [float(x) for x in np.max(ticks, axis=0)]}


def _rank_report(hlo_text: str, model_flops: float, spec: GpuSpec, num_devices: int, layers: int | None,
                 scope_weights: dict | None, unit: int = 1) -> dict:
    times = kernel_times(hlo_text, spec, num_devices, scope_weights)
    kernels, collectives = times["kernels"], times["collectives"]
    compute = sum(k["time_s"] * k["executions"] for k in kernels)
    exposed = sum(c["exposed_s"] * c["executions"] for c in collectives)
    loop_cost = times["loop_iterations"] * spec.loop_iteration_s
    step = compute + exposed + loop_cost
    loops = _loops(times["program"], kernels)
    out = {
        "target": spec.name, "predicted_step_s": step,
        "predicted_mfu": model_flops / step / spec.peak_flops if step else None,
        "model_flops": model_flops, "kernel_time_s": compute,
        "launch_s": spec.launch_s * sum(k["executions"] for k in kernels),
        "kernels_per_step": sum(k["executions"] for k in kernels),
        "collective_s": sum(c["time_s"] * c["executions"] for c in collectives),
        "exposed_collective_s": exposed,
        "collective_sent_bytes": sum(c["sent_bytes"] * c["executions"] for c in collectives),
        "loop_iterations": times["loop_iterations"], "loop_s": loop_cost,
        "bound": {b: sum(k["time_s"] * k["executions"] for k in kernels if k["bound"] == b)
                  for b in ("flops", "memory", "alu", "pcie")},
        "conditionals_upper_bound": times["conditionals_upper_bound"],
        "by_kind": _by_kind(kernels), "top": _top(kernels, 10), "kernels": _top(kernels, len(kernels)),
        "loops": loops,
        "collectives": _top_collectives(collectives),
        "time_by_scope": _time_by_scope(kernels, collectives),
    }
    if layers:
        out["per_layer"] = _per_layer(loops, layers, collectives, unit)
    return out


def _time_by_scope(kernels: list, collectives: list) -> dict:
    """{named scope: its kernels' time + its exposed collective time, per step} over the scopes
    kernel_times weighted (the pipeline's tick work)."""
    out = {}
    for k in kernels:
        if k["scope"] is not None:
            out[k["scope"]] = out.get(k["scope"], 0.0) + k["time_s"] * k["executions"]
    for c in collectives:
        if c["scope"] is not None:
            out[c["scope"]] = out.get(c["scope"], 0.0) + c["exposed_s"] * c["executions"]
    return out


def _top_collectives(collectives: list) -> list:
    rows = sorted(collectives, key=lambda c: c["time_s"] * c["executions"], reverse=True)[:TOP]
    return [{"name": c["name"], "kind": c["kind"], "executions": c["executions"], "sent_bytes": c["sent_bytes"],
             "time_us": round(c["time_s"] * 1e6, 2), "exposed_us": round(c["exposed_s"] * 1e6, 2)} for c in rows]


def _per_layer(loops: list, layers: int, collectives: list, unit: int = 1) -> dict:
    """One layer's kernels, forward and backward: the loops of trip count `layers` that hold no
    other such loop (the layer scans), per iteration over the `unit` layers an iteration runs; and
    the collective time in them that no kernel hides (`exposed_collective_s`, per layer). With
    unit > 1 the figures are a unit's means: its layers' windows differ (`half_batches`)."""
    runs = [loop for loop in loops if loop["trip_count"] == layers]
    bodies = {loop["body"] for loop in runs}
    layer = [loop for loop in runs if not bodies & set(loop["inner_bodies"])]
    tops = sorted((t for loop in layer for t in loop["top"]), key=lambda t: t["time_us"] * t["executions"],
                  reverse=True)[:TOP]
    names = {loop["body"] for loop in layer}
    return {"bodies": sorted(names), "layers_per_iteration": unit,
            "kernels": sum(loop["kernels_per_iteration"] for loop in layer) / unit,
            "time_s": sum(loop["time_s_per_iteration"] for loop in layer) / unit,
            "exposed_collective_s": sum(c["exposed_s"] for c in collectives if c["computation"] in names) / unit,
            "top": tops}

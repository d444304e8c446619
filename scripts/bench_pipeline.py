"""`python scripts/bench_pipeline.py [--quick | --tables-only] [--json OUT]`

Pipeline parallelism: the schedule tables' cost model against Megatron's formulas, then
the compiled executor's memory and step time on 8 simulated CPU devices.
Shape legend: p stages, m micro-batches, v chunks per stage, b micro-batch,
s sequence, h hidden, l layers, B = b m global batch.

1. Tables (numpy, nothing compiled), for gpipe and 1f1b (v = 1) and interleaved
   (v in {2, 4}), p in {2, 4, 8}, m in {p, 4p, 8p}: ticks; the lockstep time over one
   stage's busy time read from the table (`Schedule.time_over_ideal`: a tick lasts as long
   as its slowest stage, a chunk forward costs 1 and its backward 2, or 3 recomputing)
   against Megatron's 1 + (p-1)/(v m); the stashes held on stage 0 (`max_in_flight()[0]`,
   min(v m, (v+1) p - 1) for 1f1b and interleaved, m for gpipe); and the slots
   `plan_buffers` gives the executor per stage (activations, gradients, stashes, head inputs).
1b. Split-backward tables (numpy): 1f1b, interleaved (v = 2), zb and zbv at p in {4, 8},
   m in {8, 32}, per-chunk costs F:B:W in {1:1:1, 1:1:0.5, 1:8/7:6/7} (the last the executed
   matmul FLOPs of a GPT chunk's F, B and W, `mtjax.inspect`'s `pipeline` section; the unsplit
   schedules' backward costs B + W), with no cap and with the cap N = p
   (`max_in_flight`): the lockstep time over ideal at those costs beside ZB-H1's bound
   (m(F+B+W) + (p-1)(F+B-W)) / m(F+B+W), and stage 0's stashes waiting for B and for W, in
   micro-batches of a whole stage (a chunk's stash is 1/v of it).
2. Compiled train step of a small fp32 GPT on a (data=1, pipe=p, tensor=1) mesh, b = 1,
   for every schedule (interleaved with v = 2, and at fewer m to keep the run short):
     - per-device `temp_size_in_bytes` from XLA (it holds the stash ring: m slots for
       GPipe, 2p - 1 for 1F1B, of one chunk's residuals each, as `train.recompute=none` keeps them);
     - seconds to lower and compile;
     - median process CPU seconds (all threads) and wall seconds of a step on random
       batches, and their ratios to the same model on one device (pipe = 1, the same B
       and b, so the same m micro-batches accumulated by a scan);
     - |loss - pipe=1 loss| after the same steps from the same initial state.
3. The CPU-time ratio for 1F1B and interleaved at one m, pipelined and pipe = 1 steps
   alternated for several rounds (the load of a shared machine drifts).

The executor runs each chunk's forward once and stashes its residuals, as a step without
pipelining does, so a pipelined step computes the same FLOPs: a CPU ratio near 1. The
simulated devices share this machine's cores (one XLA thread each, below): CPU seconds sum
the work of all devices, and wall seconds say nothing about a pipeline's speed-up.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from fractions import Fraction

from mtjax.mesh import simulate_cpu_devices

# One thread per simulated device for its matmuls, so CPU time sums work, not pool overhead.
os.environ["XLA_FLAGS"] = " ".join(os.environ.get("XLA_FLAGS", "").split() + ["--xla_cpu_multi_thread_eigen=false"])
simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtjax.config import load_config, validate  # noqa: E402
from mtjax.hlo_report import memory_report  # noqa: E402
from mtjax.inspect import compile_train_step  # noqa: E402
from mtjax.mesh import make_mesh  # noqa: E402
from mtjax.pipeline.buffers import plan_buffers  # noqa: E402
from mtjax.pipeline.schedules import SCHEDULES, make_schedule  # noqa: E402
from mtjax.pipeline.zero_bubble import zb_lower_bound  # noqa: E402
from mtjax.training.trainer import Trainer  # noqa: E402

VOCAB = 257                                    # the byte tokenizer's
TABLE_STAGES = (2, 4, 8)
M_MULTIPLES = (1, 4, 8)                        # m = k p
TABLE_CHUNKS = {"gpipe": (1,), "1f1b": (1,), "interleaved": (2, 4)}
COMPILED_CHUNKS = 2                            # v for interleaved in part 2
AB_SCHEDULES = ("1f1b", "interleaved")         # timed again, alternating with pipe = 1 (part 3)
MODES = {   # model; pipe sizes, m multiples, (warm-up, timed) steps; paired timing at m = ab_multiple p
    "full": {"l": 8, "h": 128, "a": 4, "s": 128, "pipes": (2, 4), "mults": (1, 2, 4, 8), "interleaved_mults": (1, 4),
             "steps": (1, 3), "ab_multiple": 4, "ab_rounds": 6},
    "quick": {"l": 4, "h": 64, "a": 4, "s": 64, "pipes": (2,), "mults": (1, 2), "interleaved_mults": (1, 2),
              "steps": (1, 1), "ab_multiple": 2, "ab_rounds": 2},
}


# 1. tables -----------------------------------------------------------------------------------
def megatron(p: int, m: int, v: int) -> Fraction:
    """Megatron's time over ideal: 1 + (p - 1)/(v m) (v = 1 without interleaving)."""
    return 1 + Fraction(p - 1, v * m)


def table_row(name: str, p: int, m: int, v: int) -> dict:
    """One schedule's figures, all read from its table and its buffer plan."""
    s, formula = make_schedule(name, p, m, v), megatron(p, m, v)
    plan = plan_buffers(s)
    ratio, ratio_recompute = s.time_over_ideal(), s.time_over_ideal(recompute=True)
    return {"schedule": name, "p": p, "m": m, "v": v, "ticks": s.ticks,
            "time_over_ideal": float(ratio), "time_over_ideal_recompute": float(ratio_recompute),
            "megatron": float(formula), "exact": ratio == formula and ratio_recompute == formula,
            "in_flight_stage0": int(s.max_in_flight()[0]),
            "slots": {"act": plan.act_slots, "grad": plan.grad_slots, "stash": plan.stash_slots,
                      "head": plan.head_slots}}


def table_rows() -> list[dict]:
    return [table_row(name, p, k * p, v) for name in SCHEDULES for p in TABLE_STAGES
            for k in M_MULTIPLES for v in TABLE_CHUNKS[name]]


SPLIT_ROWS = {"schedules": (("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zbv", 1)), "stages": (4, 8),
              "micro_batches": (8, 32),
              # assumed, the paper's GPT layer, and measured (`mtjax.inspect`: a GPT h = s = 64, recompute none)
              "costs": ((1, 1, 1), (1, 1, Fraction(1, 2)), (1, Fraction(8, 7), Fraction(6, 7)))}


def split_rows() -> list[dict]:
    """Part 1b: one row per (costs, p, m, schedule, cap in {none, p}), read from the tables."""
    rows = []
    for costs in SPLIT_ROWS["costs"]:
        for p in SPLIT_ROWS["stages"]:
            for m in SPLIT_ROWS["micro_batches"]:
                for name, v in SPLIT_ROWS["schedules"]:
                    for cap in (0, p):
                        s = make_schedule(name, p, m, v, cap, costs)
                        rows.append({"schedule": name, "p": p, "m": m, "v": s.chunks, "costs": ":".join(map(str, costs)),
                                     "cap": cap, "ticks": s.ticks, "time_over_ideal": float(s.time_over_ideal(costs=costs)),
                                     "zb_bound": float(zb_lower_bound(p, m, costs)),
                                     "b_pending_stage0": int(s.max_in_flight()[0]) / s.chunks,
                                     "w_pending_stage0": int(s.w_pending()[0]) / s.chunks,
                                     "b_pending_most": int(s.max_in_flight().max()) / s.chunks,
                                     "w_pending_most": int(s.w_pending().max()) / s.chunks})
    return rows


# 2. compiled ---------------------------------------------------------------------------------
def config(size: dict, pipe: int, m: int, schedule: str):
    """The benchmark GPT at B = m, b = 1 on pipe stages (ConfigError if validation refuses it)."""
    cfg = load_config(None, [
        "model.arch=gpt", f"model.num_layers={size['l']}", f"model.hidden_size={size['h']}",
        f"model.num_heads={size['a']}", f"model.seq_len={size['s']}", "parallel.data=1",
        f"parallel.pipe={pipe}", "parallel.tensor=1", f"parallel.schedule={schedule}",
        f"parallel.virtual_stages={chunks(schedule)}", f"train.global_batch={m}", "train.micro_batch=1",
        "train.precision=fp32"])
    validate(cfg, pipe)
    return cfg


def chunks(schedule: str) -> int:
    """v used for a schedule in parts 2 and 3."""
    return COMPILED_CHUNKS if schedule == "interleaved" else 1


class Runner:
    """A compiled train step with its live state, stepping on random batches."""

    def __init__(self, tr: Trainer, compiled, host_state):
        self.tr, self.compiled = tr, compiled
        self.state = jax.device_put(host_state, tr.state_shardings)
        self.rng = np.random.default_rng(0)
        self.loss = float("nan")

    def step(self) -> tuple[float, float]:
        """(process CPU s of all threads, wall s) of one step, synchronised on the new state and metrics."""
        cfg = self.tr.cfg
        batch = self.tr.put_batch(self.rng.integers(0, VOCAB, (cfg.train.global_batch, cfg.model.seq_len + 1)))
        jax.block_until_ready(batch)
        c0, w0 = time.process_time(), time.perf_counter()
        self.state, metrics = self.compiled(self.state, batch)
        jax.block_until_ready((self.state, metrics))
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        self.loss = float(metrics["loss"])
        if not np.isfinite(self.loss):
            raise FloatingPointError(f"non-finite loss {self.loss}")
        return cpu, wall


def trainer(size: dict, pipe: int, m: int, schedule: str) -> Trainer:
    return Trainer(config(size, pipe, m, schedule), make_mesh(1, pipe, 1, jax.devices()[:pipe]), VOCAB)


def initial_state(size: dict):
    """The initial TrainState on the host. Its global shapes do not depend on p or m, so every
    layout starts from it (one init compile instead of one per layout; equal losses are a check)."""
    return jax.device_get(trainer(size, 1, 1, "1f1b").init_state())


def measure(size: dict, pipe: int, m: int, schedule: str, host_state) -> tuple[dict, Runner]:
    """Compile, read XLA's memory, and time warm-up + timed steps (medians)."""
    tr = trainer(size, pipe, m, schedule)
    t0 = time.perf_counter()
    compiled = compile_train_step(tr)
    compile_s = time.perf_counter() - t0
    run = Runner(tr, compiled, host_state)
    warmup, steps = size["steps"]
    times = [run.step() for _ in range(warmup + steps)][warmup:]
    row = {"schedule": schedule, "p": pipe, "m": m, "v": chunks(schedule), "compile_s": compile_s,
           "temp_bytes": memory_report(compiled)["temp_bytes"], "cpu_s": statistics.median(c for c, _ in times),
           "wall_s": statistics.median(w for _, w in times), "loss": run.loss}
    return row, run


def compiled_rows(size: dict, log) -> tuple[list[dict], dict]:
    """One row per (p, m, schedule) with ratios to pipe = 1 at the same B; and the Runners kept
    for the paired timing, {(schedule, p, m): (runner, pipe=1 runner)} at m = ab_multiple p."""
    baselines, rows, kept = {}, [], {}
    host_state = initial_state(size)
    for pipe in size["pipes"]:
        for k in size["mults"]:
            m = k * pipe
            if m not in baselines:
                baselines[m] = measure(size, 1, m, "1f1b", host_state)
                log(f"  pipe=1 m={m}: step {baselines[m][0]['wall_s']:.3f} s")
            base = baselines[m][0]
            for name in SCHEDULES:
                if name == "interleaved" and k not in size["interleaved_mults"]:
                    continue
                r, run = measure(size, pipe, m, name, host_state)
                r.update(base_cpu_s=base["cpu_s"], base_wall_s=base["wall_s"], base_temp_bytes=base["temp_bytes"],
                         cpu_ratio=r["cpu_s"] / base["cpu_s"], wall_ratio=r["wall_s"] / base["wall_s"],
                         loss_gap=abs(r["loss"] - base["loss"]))
                rows.append(r)
                if k == size["ab_multiple"] and name in AB_SCHEDULES:
                    kept[(name, pipe, m)] = (run, baselines[m][1])
                log(f"  {name} p={pipe} m={m}: compile {r['compile_s']:.1f} s, step {r['wall_s']:.3f} s")
    return rows, kept


def paired_rows(size: dict, kept: dict, log) -> list[dict]:
    """Pipelined vs pipe=1 steps alternated (A B B A ...), so that load drifts hit both alike; the
    median over rounds of the per-round CPU and wall ratios."""
    rows = []
    for (name, pipe, m), (run, base) in kept.items():
        cpu, wall = [], []
        for i in range(size["ab_rounds"]):
            order = (run, base) if i % 2 == 0 else (base, run)
            times = {id(r): r.step() for r in order}
            (c, w), (bc, bw) = times[id(run)], times[id(base)]
            cpu.append(c / bc)
            wall.append(w / bw)
        rows.append({"schedule": name, "p": pipe, "m": m, "v": chunks(name), "rounds": size["ab_rounds"],
                     "cpu_ratio": statistics.median(cpu), "cpu_ratio_min": min(cpu), "cpu_ratio_max": max(cpu),
                     "wall_ratio": statistics.median(wall)})
        log(f"  paired {name} p={pipe} m={m}: CPU ratio {rows[-1]['cpu_ratio']:.2f}")
    return rows


# printing ------------------------------------------------------------------------------------
def render_tables(tab: list[dict]) -> str:
    out = ["### 1. Schedule tables: lockstep time over ideal (forward 1, backward 2; 3 recomputing) "
           "vs Megatron's 1 + (p-1)/(v m); slots per stage",
           "| schedule | p | m | v | ticks | time/ideal (table) | recompute | Megatron | equal | "
           "in flight, stage 0 | slots act / grad / stash / head |",
           "|---|---:|---:|---:|---:|---:|---:|---:|:--:|---:|---:|"]
    for r in tab:
        slots = " / ".join(str(r["slots"][k]) for k in ("act", "grad", "stash", "head"))
        out.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['ticks']} | {r['time_over_ideal']:.4f} "
                   f"| {r['time_over_ideal_recompute']:.4f} | {r['megatron']:.4f} | {'yes' if r['exact'] else 'NO'} "
                   f"| {r['in_flight_stage0']} | {slots} |")
    return "\n".join(out)


def render_split(rows: list[dict]) -> str:
    out = ["### 1b. Split backward (B, W) and the memory cap: lockstep time over ideal at F:B:W, stage 0's "
           "stashes in micro-batches of a whole stage (most on any stage in brackets)",
           "| F:B:W | p | m | schedule | cap | ticks | time/ideal | ZB-H1 bound | waiting for B, stage 0 (most) "
           "| waiting for W, stage 0 (most) |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['costs']} | {r['p']} | {r['m']} | {r['schedule']}{' v=2' if r['schedule'] == 'interleaved' else ''} "
                   f"| {r['cap'] or '-'} | {r['ticks']} | {r['time_over_ideal']:.3f} | {r['zb_bound']:.3f} "
                   f"| {r['b_pending_stage0']:g} ({r['b_pending_most']:g}) | {r['w_pending_stage0']:g} ({r['w_pending_most']:g}) |")
    return "\n".join(out)


def render_compiled(comp: list[dict], paired: list[dict], size: dict) -> str:
    sbh = size["s"] * size["h"]
    out = [f"### 2. Compiled train step, GPT l={size['l']} h={size['h']} s={size['s']} b=1 fp32, B = m "
           f"(one activation b·s·h = {sbh * 4 / 2**10:.0f} KiB)",
           "| schedule | p | v | m | temp MiB/device | pipe=1 temp MiB | compile s | CPU s | CPU / pipe=1 "
           "| wall s | wall / pipe=1 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in comp:
        out.append(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | {r['temp_bytes'] / 2**20:.2f} "
                   f"| {r['base_temp_bytes'] / 2**20:.2f} | {r['compile_s']:.1f} | {r['cpu_s']:.3f} "
                   f"| {r['cpu_ratio']:.2f} | {r['wall_s']:.3f} | {r['wall_ratio']:.2f} |")
    if comp:
        out.append(f"largest |loss - pipe=1 loss| after the same steps: {max(r['loss_gap'] for r in comp):.1e}")
    out += ["", "### 3. Paired timing: pipelined and pipe=1 steps alternated, median of per-round ratios",
            "| schedule | p | v | m | rounds | CPU / pipe=1 (min–max) | wall / pipe=1 |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for r in paired:
        out.append(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | {r['rounds']} | {r['cpu_ratio']:.2f} "
                   f"({r['cpu_ratio_min']:.2f}–{r['cpu_ratio_max']:.2f}) | {r['wall_ratio']:.2f} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/bench_pipeline.py",
                                 description="Pipeline schedules: cost model, stash, XLA memory and step time.")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="compile l=4 h=64 s=64 at pipe=2, m in {2, 4}, "
                       "one timed step (a smoke run)")
    group.add_argument("--tables-only", action="store_true", help="part 1 only (numpy, a second)")
    ap.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    mode = "tables" if args.tables_only else "quick" if args.quick else "full"
    size = MODES.get(mode)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", flush=True)

    print(f"jax {jax.__version__}, {len(jax.devices())} simulated CPU devices on {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}; mode {mode}; XLA_FLAGS={os.environ['XLA_FLAGS']}", flush=True)
    tab, split = table_rows(), split_rows()
    log(f"1. {len(tab)} schedule tables, {len(split)} split or capped")
    comp, paired = [], []
    if size:
        log(f"2. compiling {', '.join(SCHEDULES)} (warm-up, timed steps = {size['steps']})")
        comp, kept = compiled_rows(size, log)
        log(f"3. paired timing, {size['ab_rounds']} rounds")
        paired = paired_rows(size, kept, log)
    log(f"done, load average at the end {os.getloadavg()[0]:.2f}\n")
    print(render_tables(tab))
    print("\n" + render_split(split))
    if size:
        print("\n" + render_compiled(comp, paired, size))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"jax": jax.__version__, "argv": argv, "mode": mode, "size": size,
                       "xla_flags": os.environ["XLA_FLAGS"], "tables": tab, "split_tables": split,
                       "compiled": comp, "paired": paired},
                      f, indent=1)
    return 0 if all(r["exact"] for r in tab) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

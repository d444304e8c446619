"""`python scripts/bench_pipeline.py [--quick] [--json OUT]`

Pipeline parallelism on 8 simulated CPU devices: the schedule tables against
Megatron's formulas, then the compiled executor's memory and step time.
Shape legend: p stages, m micro-batches, v chunks per stage, b micro-batch,
s sequence, h hidden, l layers, B = b m global batch.

1. Tables (numpy, nothing compiled), for gpipe, 1f1b and interleaved (v in {2, 4}),
   p in {2, 4, 8}, m in {p, 2p, 4p, 8p}: ticks, `Schedule.bubble_fraction` against
   (p-1)/m or (p-1)/(v m), the most (micro-batch, chunk) pairs in flight on a stage
   (`max_in_flight().max()`), and the stash slots `plan_buffers` gives the executor
   (per chunk; a dash where it does not plan that schedule).
2. Compiled train step of a small fp32 GPT on a (data=1, pipe=p, tensor=1) mesh,
   b = 1, for every schedule `mtjax.config.validate` accepts at pipe > 1
   (interleaved with v = 2, and at fewer m to keep the run short):
     - per-device `temp_size_in_bytes` from XLA (it holds the stash: m slots for
       GPipe, about p for 1F1B, of b*s*h each);
     - seconds to lower and compile;
     - median process CPU seconds (all threads) and wall seconds of a step on
       random batches, and their ratios to the same model on one device (pipe = 1,
       the same B and b, so the same m micro-batches accumulated by a scan).
3. The same ratios for 1F1B and interleaved at one m, pipelined and pipe = 1 steps
   alternated for several rounds (the load of a shared machine drifts).

The executor's backward recomputes each chunk's forward from the stashed chunk
input, and the last of the p v chunks skips its forward tick; so a pipelined step
runs l(4 - 1/(p v)) layer passes against 3l without pipelining, plus the same
3 passes of the head: `flop_ratio`, from `mtjax.training.flops.forward_flops_per_token`.
The simulated devices share this machine's cores (one XLA thread each, below):
CPU seconds sum the work of all devices; wall seconds say little.
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

from mtjax.config import ConfigError, load_config, validate  # noqa: E402
from mtjax.hlo_report import memory_report  # noqa: E402
from mtjax.inspect import compile_train_step  # noqa: E402
from mtjax.mesh import make_mesh  # noqa: E402
from mtjax.parallel.vocab import padded_vocab_size  # noqa: E402
from mtjax.pipeline.buffers import plan_buffers  # noqa: E402
from mtjax.pipeline.schedules import SCHEDULES, make_schedule  # noqa: E402
from mtjax.training.flops import forward_flops_per_token  # noqa: E402
from mtjax.training.trainer import Trainer  # noqa: E402

VOCAB = 257                                    # the byte tokenizer's
TABLE_STAGES = (2, 4, 8)
M_MULTIPLES = (1, 2, 4, 8)                     # m = k p
TABLE_CHUNKS = (2, 4)                          # v for interleaved
COMPILED_CHUNKS = 2                            # v for interleaved in part 2
AB_SCHEDULES = ("1f1b", "interleaved")         # timed again, alternating with pipe = 1 (part 3)
MODES = {   # model; pipe sizes, m multiples, (warm-up, timed) steps; paired timing at m = ab_multiple p
    "full": {"l": 8, "h": 128, "a": 4, "s": 128, "pipes": (2, 4), "mults": M_MULTIPLES, "interleaved_mults": (1, 4),
             "steps": (1, 3), "ab_multiple": 4, "ab_rounds": 6},
    "quick": {"l": 4, "h": 64, "a": 4, "s": 64, "pipes": (2,), "mults": (1, 2), "interleaved_mults": (1, 2),
              "steps": (1, 1), "ab_multiple": 2, "ab_rounds": 2},
}


# 1. tables -----------------------------------------------------------------------------------
def stash_plan(s):
    """The executor's slot plan, or None where `plan_buffers` does not handle the schedule yet."""
    try:
        return plan_buffers(s)
    except NotImplementedError:
        return None


def table_rows() -> list[dict]:
    rows = []
    for name in SCHEDULES:
        for p in TABLE_STAGES:
            for k in M_MULTIPLES:
                m = k * p
                for v in TABLE_CHUNKS if name == "interleaved" else (1,):
                    s = make_schedule(name, p, m, v)
                    plan = stash_plan(s)
                    rows.append({"schedule": name, "p": p, "m": m, "v": v, "ticks": s.ticks,
                                 "bubble": float(s.bubble_fraction), "formula": (p - 1) / (v * m),
                                 "exact": s.bubble_fraction == Fraction(p - 1, v * m),
                                 "max_in_flight": int(s.max_in_flight().max()),
                                 "fwd_slots": plan.fwd_slots if plan else None,
                                 "bwd_slots": plan.bwd_slots if plan else None})
    return rows


# 2. compiled ---------------------------------------------------------------------------------
def config(size: dict, pipe: int, m: int, schedule: str, v: int = 1):
    """The benchmark GPT at B = m, b = 1 on pipe stages; ConfigError if validation refuses it."""
    cfg = load_config(None, [
        "model.arch=gpt", f"model.num_layers={size['l']}", f"model.hidden_size={size['h']}",
        f"model.num_heads={size['a']}", f"model.seq_len={size['s']}", "parallel.data=1",
        f"parallel.pipe={pipe}", "parallel.tensor=1", f"parallel.schedule={schedule}",
        f"parallel.virtual_stages={v}", f"train.global_batch={m}", "train.micro_batch=1",
        "train.precision=fp32"])
    validate(cfg, pipe)
    return cfg


def compiled_schedules(size: dict) -> tuple[list[str], dict]:
    """Schedules the config validation accepts at pipe = 2, and {schedule: reason} for the refused."""
    ok, refused = [], {}
    for name in SCHEDULES:
        try:
            config(size, 2, 4, name, chunks(name))
            ok.append(name)
        except ConfigError as e:
            refused[name] = str(e)
    return ok, refused


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


def chunks(schedule: str) -> int:
    """v used for a schedule in part 2."""
    return COMPILED_CHUNKS if schedule == "interleaved" else 1


def trainer(size: dict, pipe: int, m: int, schedule: str) -> Trainer:
    cfg = config(size, pipe, m, schedule, chunks(schedule))
    return Trainer(cfg, make_mesh(1, pipe, 1, jax.devices()[:pipe]), VOCAB)


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


def flop_ratio(size: dict, pipe: int, v: int) -> float:
    """Pipelined over unpipelined FLOPs of a step: layers l(4 - 1/(p v)) vs 3l passes (only the last of
    the p v chunks skips its forward), head 3 passes each (matrix products, Megatron's accounting)."""
    cfg = config(size, 1, 1, "1f1b")
    vocab = padded_vocab_size(VOCAB, cfg.model.vocab_multiple, 1)
    weights, attention, head = forward_flops_per_token(cfg.model, vocab)
    layer, l = weights + attention, size["l"]
    return (l * (4 - 1 / (pipe * v)) * layer + 3 * head) / (3 * l * layer + 3 * head)


def compiled_rows(size: dict, schedules: list[str], log) -> tuple[list[dict], dict]:
    """One row per (p, m, schedule) with ratios to pipe = 1 at the same B; and the Runners kept
    for the paired timing, {(schedule, p, m): (runner, pipe=1 runner)} at m = AB_MULTIPLE p."""
    baselines, rows, kept = {}, [], {}
    host_state = initial_state(size)
    for pipe in size["pipes"]:
        for k in size["mults"]:
            m = k * pipe
            if m not in baselines:
                baselines[m] = measure(size, 1, m, "1f1b", host_state)
                log(f"  pipe=1 m={m}: step {baselines[m][0]['wall_s']:.3f} s")
            base = baselines[m][0]
            for name in schedules:
                if name == "interleaved" and k not in size["interleaved_mults"]:
                    continue
                r, run = measure(size, pipe, m, name, host_state)
                r.update(base_cpu_s=base["cpu_s"], base_wall_s=base["wall_s"], base_temp_bytes=base["temp_bytes"],
                         cpu_ratio=r["cpu_s"] / base["cpu_s"], wall_ratio=r["wall_s"] / base["wall_s"],
                         flop_ratio=flop_ratio(size, pipe, r["v"]), loss_gap=abs(r["loss"] - base["loss"]))
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
                     "wall_ratio": statistics.median(wall), "flop_ratio": flop_ratio(size, pipe, chunks(name))})
        log(f"  paired {name} p={pipe} m={m}: CPU ratio {rows[-1]['cpu_ratio']:.2f}")
    return rows


# tables --------------------------------------------------------------------------------------
def render(tab: list[dict], comp: list[dict], paired: list[dict], refused: dict, size: dict) -> str:
    out = ["### 1. Schedule tables (tick: one chunk's forward or backward; slots per stage, v x per chunk)",
           "| schedule | p | m | v | ticks | bubble (table) | formula | equal | max in flight | "
           "stash slots fwd / bwd |", "|---|---:|---:|---:|---:|---:|---:|:--:|---:|---:|"]
    for r in tab:
        per = "" if r["v"] == 1 else f"{r['v']}×"
        slots = f"{per}{r['fwd_slots']} / {per}{r['bwd_slots']}" if r["fwd_slots"] else "–"
        out.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['ticks']} | {r['bubble']:.4f} "
                   f"| {r['formula']:.4f} | {'yes' if r['exact'] else 'NO'} | {r['max_in_flight']} | {slots} |")
    sbh = size["s"] * size["h"]
    out += ["", f"### 2. Compiled train step, GPT l={size['l']} h={size['h']} s={size['s']} b=1 fp32, "
            f"B = m (one stashed input b·s·h = {sbh * 4 / 2**10:.0f} KiB)",
            "| schedule | p | v | m | temp MiB/device | pipe=1 temp MiB | compile s | CPU s | CPU / pipe=1 "
            "| wall s | wall / pipe=1 | FLOP ratio |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in comp:
        out.append(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | {r['temp_bytes'] / 2**20:.2f} "
                   f"| {r['base_temp_bytes'] / 2**20:.2f} | {r['compile_s']:.1f} | {r['cpu_s']:.3f} "
                   f"| {r['cpu_ratio']:.2f} | {r['wall_s']:.3f} | {r['wall_ratio']:.2f} | {r['flop_ratio']:.3f} |")
    for name, why in refused.items():
        out.append(f"{name}: not compiled, config validation refuses it: {why}")
    if comp:
        out.append(f"largest |loss - pipe=1 loss| after the same steps: {max(r['loss_gap'] for r in comp):.1e}")
    out += ["", "### 3. Paired timing: pipelined and pipe=1 steps alternated, median of per-round ratios",
            "| schedule | p | v | m | rounds | CPU / pipe=1 (min–max) | wall / pipe=1 | FLOP ratio |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in paired:
        out.append(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | {r['rounds']} | {r['cpu_ratio']:.2f} "
                   f"({r['cpu_ratio_min']:.2f}–{r['cpu_ratio_max']:.2f}) | {r['wall_ratio']:.2f} "
                   f"| {r['flop_ratio']:.3f} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/bench_pipeline.py",
                                 description="Pipeline schedules: bubble, stash, XLA memory and step time.")
    ap.add_argument("--quick", action="store_true", help="l=4 h=64 s=64, pipe=2, m in {2, 4}, one timed step "
                    "(a smoke run)")
    ap.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    size = MODES[mode]
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", flush=True)

    print(f"jax {jax.__version__}, {len(jax.devices())} simulated CPU devices on {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}; mode {mode}; XLA_FLAGS={os.environ['XLA_FLAGS']}", flush=True)
    tab = table_rows()
    log(f"1. {len(tab)} schedule tables")
    schedules, refused = compiled_schedules(size)
    log(f"2. compiling {', '.join(schedules)} (warm-up, timed steps = {size['steps']})")
    comp, kept = compiled_rows(size, schedules, log)
    log(f"3. paired timing, {size['ab_rounds']} rounds")
    paired = paired_rows(size, kept, log)
    log(f"done, load average at the end {os.getloadavg()[0]:.2f}\n")
    print(render(tab, comp, paired, refused, size))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"jax": jax.__version__, "argv": argv, "mode": mode, "size": size,
                       "xla_flags": os.environ["XLA_FLAGS"], "refused": refused, "tables": tab,
                       "compiled": comp, "paired": paired}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

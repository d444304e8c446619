"""`python scripts/bench_zero_bubble.py [--stages 4 8] [--micro-batches 8 32] [--json OUT]`

Split-backward pipelining (issue 24) from the compiled train step: per-device temporaries
(XLA's memory analysis; the SPMD program sizes every stage's slot rings alike, so this is the
stage holding the most, stage 0) for 1f1b, interleaved (v = 2), zb and zbv, with their own
table and under the cap N = p (`parallel.max_in_flight`), and each table's lockstep time over
ideal at F:B:W = 1:1:1 and at the executed ratios `mtjax.inspect` measures (its `pipeline`
section). A small fp32 GPT on 8 simulated CPU devices: h = 64, s = 64, b = 1, l = 16 layers,
recompute none. Shape legend: p stages, m micro-batches, v chunks per stage.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zbv", 1))


def row(schedule: str, v: int, p: int, m: int, cap: int) -> dict:
    from mtjax.config import load_config
    from mtjax.inspect import report
    from mtjax.mesh import make_mesh
    from mtjax.training.trainer import Trainer
    import jax
    cfg = load_config(None, [
        "model.arch=gpt", "model.num_layers=16", "model.hidden_size=64", "model.num_heads=8", "model.seq_len=64",
        f"parallel.pipe={p}", "parallel.data=1", f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}",
        f"parallel.max_in_flight={cap}", f"train.global_batch={m}", "train.micro_batch=1", "train.recompute=none"])
    trainer = Trainer(cfg, make_mesh(1, p, 1, jax.devices()[:p]), 301)
    r = report(trainer)
    pipe = r["pipeline"]
    return {"schedule": schedule, "p": p, "m": m, "cap": cap, "temp_bytes": r["memory"]["temp_bytes"],
            "b_pending_stage0": pipe["max_in_flight"][0], "w_pending_stage0": pipe["w_pending"][0],
            "slots_held_most": max(pipe["slots_held"]),
            "chunks": trainer.schedule.chunks, "time_over_ideal": pipe["time_over_ideal"],
            "measured_costs": pipe["measured_costs"], "time_over_ideal_measured": pipe["time_over_ideal_at_measured_costs"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    print("| p | m | schedule | cap | time/ideal 1:1:1 | time/ideal measured (F:B:W) | stage 0 waiting for B + W "
          "(chunks) | stash slots held, most on a stage | temporaries MiB |\n"
          "|---:|---:|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for p in args.stages:
        for m in args.micro_batches:
            for name, v in SCHEDULES:
                for cap in (0, p):
                    r = row(name, v, p, m, cap)
                    rows.append(r)
                    print(f"| {p} | {m} | {name}{' v=2' if v > 1 else ''} | {cap or '-'} | {r['time_over_ideal']:.3f} "
                          f"| {r['time_over_ideal_measured']:.3f} ({r['measured_costs']}) "
                          f"| {r['b_pending_stage0']} + {r['w_pending_stage0']} ({r['chunks']}) "
                          f"| {r['slots_held_most']} "
                          f"| {r['temp_bytes'] / 2**20:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

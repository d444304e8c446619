"""`python scripts/bench_train.py [--steps N] [--configs tiny,gpt100m] [--override K=V ...] [--peak-tflops P] [--json OUT]`

Single-device training benchmark on synthetic token batches (no corpus is read).
For each config it reports
  - compile time: seconds for `train_step.lower(abstract inputs).compile()`,
  - step time: the median of N steps (per config, or --steps) after 2 warm-up steps, each step
    synchronised with `jax.block_until_ready` on the new state and the metrics,
  - tokens/s = B s / step time, and TFLOP/s = `flops_per_step` / step time
    (Megatron's model-FLOPs accounting, mtjax/training/flops.py),
and then the compile time of the tiny model at 4 and at 32 layers: the layers are
one `nn.scan`, so the compiled program, and its compile time, should barely grow.

Each config runs with the overrides in BENCH (printed), sized so that the
whole script takes a few minutes on a 2-core CPU; `--override group.field=value` (repeatable)
is appended to every config's overrides (e.g. a larger batch and `train.precision=bf16` on a GPU),
and `--peak-tflops P` adds a column MFU = TFLOP/s / P. `--no-depth` skips the compile-time
comparison. Runs on `jax.devices()[0]`: the first GPU where there is one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.config import load_config, validate
from mtjax.inspect import abstract_state
from mtjax.mesh import make_mesh
from mtjax.training.flops import step_flops
from mtjax.training.step import batch_sharding
from mtjax.training.trainer import Trainer

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
VOCAB = 257                    # the byte tokenizer's vocabulary (256 bytes + end of document)
WARMUP_STEPS = 2
DEPTHS = (4, 32)               # layer counts for the compile-time comparison (tiny model)
DEPTH_REPEATS = 3              # compile each depth this often (interleaved) and keep the fastest
BENCH = {                      # config name -> (overrides, timed steps unless --steps is given)
    "tiny": ([], 10),
    "gpt100m": (["train.global_batch=2", "train.micro_batch=2"], 3),   # ~25 s a step on 2 CPU cores
}


def build(name: str, overrides: list[str]) -> Trainer:
    """A Trainer for configs/NAME.yaml on a (1, 1, 1) mesh, after the config's validation pass."""
    cfg = load_config(os.path.join(CONFIGS, f"{name}.yaml"), overrides)
    validate(cfg, 1)
    return Trainer(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), vocab=VOCAB)


def timed_compile(trainer: Trainer):
    """(compiled train step, seconds spent lowering and compiling it)."""
    cfg = trainer.cfg
    state = abstract_state(trainer)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=batch_sharding(trainer.mesh))
    t0 = time.perf_counter()
    compiled = trainer.train_step.lower(state, batch).compile()
    return compiled, time.perf_counter() - t0


def step_times(trainer: Trainer, compiled, steps: int) -> list[float]:
    """Seconds per step for `steps` steps after WARMUP_STEPS, on random tokens [B, s+1]."""
    cfg = trainer.cfg
    rng = np.random.default_rng(0)
    batches = [trainer.put_batch(rng.integers(0, VOCAB, (cfg.train.global_batch, cfg.model.seq_len + 1)))
               for _ in range(WARMUP_STEPS + steps)]
    state = trainer.init_state()
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    if not np.isfinite(float(metrics["loss"])):
        raise FloatingPointError(f"non-finite loss {float(metrics['loss'])}")
    return times[WARMUP_STEPS:]


def bench_config(name: str, overrides: list[str], steps: int) -> dict:
    trainer = build(name, overrides)
    cfg = trainer.cfg
    compiled, compile_s = timed_compile(trainer)
    step_s = statistics.median(step_times(trainer, compiled, steps))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(trainer.init_state).params))
    flops = step_flops(cfg.model, trainer.plan)
    return {"config": name, "overrides": overrides, "params": params, "layers": cfg.model.num_layers,
            "hidden": cfg.model.hidden_size, "seq_len": cfg.model.seq_len,
            "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch,
            "precision": cfg.train.precision, "steps": steps, "compile_s": compile_s, "step_s": step_s,
            "tokens_per_s": cfg.train.global_batch * cfg.model.seq_len / step_s,
            "tflops": flops / step_s / 1e12}


def bench_depth() -> dict:
    """Fastest compile time of the tiny model at each of DEPTHS layers (fresh Trainer each time)."""
    best = {}
    for _ in range(DEPTH_REPEATS):
        for layers in DEPTHS:
            _, seconds = timed_compile(build("tiny", [f"model.num_layers={layers}"]))
            best[layers] = min(seconds, best.get(layers, float("inf")))
    return {"config": "tiny", "compile_s_by_layers": best, "ratio": best[DEPTHS[1]] / best[DEPTHS[0]]}


def table(rows: list[dict], depth: dict | None, peak: float | None = None) -> str:
    mfu = f" MFU (of {peak:g}) |" if peak else ""
    lines = ["| config | params | l | h | s | B (b) | precision | compile s | step s (median of N) | N | tokens/s "
             "| TFLOP/s |" + mfu,
             "|---|---:|---:|---:|---:|---:|:--|---:|---:|---:|---:|---:|" + ("---:|" if peak else "")]
    for r in rows:
        lines.append(f"| {r['config']} | {r['params'] / 1e6:.2f}M | {r['layers']} | {r['hidden']} | {r['seq_len']} "
                     f"| {r['global_batch']} ({r['micro_batch']}) | {r['precision']} | {r['compile_s']:.2f} "
                     f"| {r['step_s']:.4f} | {r['steps']} | {r['tokens_per_s']:,.0f} | {r['tflops']:.3f} |"
                     + (f" {100 * r['tflops'] / peak:.1f}% |" if peak else ""))
    if depth is None:
        return "\n".join(lines)
    lo, hi = DEPTHS
    by = depth["compile_s_by_layers"]
    lines.append(f"\ncompile time, tiny model (fastest of {DEPTH_REPEATS}): {lo} layers {by[lo]:.2f} s, "
                 f"{hi} layers {by[hi]:.2f} s, ratio {hi}/{lo} = {depth['ratio']:.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_train.py", description=__doc__.splitlines()[2])
    p.add_argument("--steps", type=int, help="timed steps per config after 2 warm-up steps "
                   f"(default: {', '.join(f'{n} {steps}' for n, (_, steps) in BENCH.items())})")
    p.add_argument("--configs", default="tiny,gpt100m", help=f"comma-separated, from {', '.join(BENCH)}")
    p.add_argument("--override", action="append", default=[], metavar="K=V",
                   help="group.field=value appended to every config's overrides (repeatable)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of the device: adds an MFU column")
    p.add_argument("--no-depth", action="store_true", help="skip the tiny model's compile time at 4 and 32 layers")
    p.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in BENCH]
    if unknown or (args.steps is not None and args.steps < 1):
        p.error(f"unknown config {unknown[0]}" if unknown else "--steps must be at least 1")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for name in names:
        overrides, steps = BENCH[name]
        overrides, steps = overrides + args.override, args.steps or steps
        print(f"{name}: configs/{name}.yaml {' '.join(overrides) or '(no overrides)'}, {steps} timed steps",
              flush=True)
        rows.append(bench_config(name, overrides, steps))
    depth = None
    if not args.no_depth:
        print(f"depth: configs/tiny.yaml model.num_layers={DEPTHS[0]} vs {DEPTHS[1]}", flush=True)
        depth = bench_depth()
    print(f"load average at the end {os.getloadavg()[0]:.2f}\n")
    print(table(rows, depth, args.peak_tflops))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "argv": argv,
                       "peak_tflops": args.peak_tflops, "rows": rows, "depth": depth}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python scripts/bench_memory.py [--quick | --size h,a,s,b] [--tensor T] [--precision P] [--json OUT]`

Activation recomputation (`train.recompute` none | selective | full | block) on 8 simulated
CPU devices, held against Korthikanti et al. (2022), for a small GPT (MHA, dropout on so
that the masks exist, one micro-batch per step) on three layouts: one device, tensor = T,
and tensor = T with sequence parallelism (SP).
Shape legend: b micro-batch, s sequence, h hidden, a heads, t tensor size, l layers.

1. Activation memory per layer per device, three measures (`mtjax/activations.py`):
   - the saved set: the residuals `jax.vjp` keeps (the pullback's leaves, traced, by dtype) in
     bf16, against Korthikanti's count at 16-bit values and 1-byte masks (`korthikanti_bytes`):
       none       sbh(10/r + 24/t) + 5 a s^2 b / t     (r = t with SP, else 1)
       selective  sbh(10/r + 24/t)
       full       2 sbh / r, the layer input only
       block      N = l/2 of the l layers as full, the rest as none: the mean of the two;
   - at PRECISION (fp32 by default: XLA:CPU has no bf16 arithmetic and keeps fp32 copies of
     bf16 residuals, so its bf16 buffers describe the backend, not the model): the saved set
     again, and what XLA holds for it: the compiled gradient's buffers with a leading `layers`
     dimension in its buffer assignment (`xla_stacked_bytes`; weight gradients, shaped like the
     stacked parameters, counted apart), held against the saved set;
   - XLA's temp bytes at two depths, difference / delta-l (a packed heap: lifetimes overlap and
     fragmentation changes with depth, so this is the loosest of the three).
2. Step time of each mode relative to `none` on the same layout: median over steps of the
   process CPU time (all threads) and wall time of `Trainer.train_step` (fp32) on random
   batches, the three modes taking turns step by step so that load changes fall on all
   alike; next to it the analytical ratio of `flops_per_step(..., recompute=mode)`
   (Megatron's accounting: matmuls only). The paper: full about +33 %, selective a few %.

On a GPU (the script runs on `jax.devices()`, the GPUs where there are any): `--tensor 1` keeps
only the one-device layout, `--precision bf16` makes part 1's XLA columns and part 2 16-bit
(a GPU keeps bf16 residuals in bf16), and `--size h,a,s,b` sets the shape.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from mtjax.mesh import simulate_cpu_devices

# One thread per simulated device for its matmuls, so CPU time sums work, not pool overhead.
os.environ["XLA_FLAGS"] = " ".join(os.environ.get("XLA_FLAGS", "").split() + ["--xla_cpu_multi_thread_eigen=false"])
simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtjax.activations import compile_grad, korthikanti_bytes, saved_bytes_per_layer, xla_stacked_bytes  # noqa: E402
from mtjax.config import load_config, validate  # noqa: E402
from mtjax.mesh import make_mesh  # noqa: E402
from mtjax.training.flops import flops_per_step  # noqa: E402
from mtjax.training.trainer import Trainer  # noqa: E402

VOCAB = 257                                    # the byte tokenizer's
MODES = ("none", "selective", "full", "block")   # block: recompute_layers = l/2
SIZES = {"full": {"h": 256, "a": 8, "s": 256, "b": 2}, "quick": {"h": 64, "a": 8, "s": 64, "b": 2}}
MEMORY_DEPTHS = (2, 6)                         # l for XLA's temp bytes
TIME_DEPTH = 4                                 # l for part 2: the layers dominate the step
STEPS = {"full": (2, 5), "quick": (1, 3)}      # (warm-up, timed) steps per mode and layout


def layouts(t: int) -> list[tuple[int, bool]]:
    """(t, sp): one device, then tensor = t without and with sequence parallelism."""
    if t == 1:
        return [(1, False)]
    return [(1, False), (t, False), (t, True)]


PRECISION = "fp32"                             # --precision sets it (part 2, and part 1's XLA columns)


def trainer(size: dict, layers: int, t: int, sp: bool, mode: str, precision: str = "") -> Trainer:
    """A Trainer (PRECISION unless given) on a (1, 1, t) mesh with one micro-batch per step."""
    cfg = load_config(None, [
        "model.arch=gpt", f"model.num_layers={layers}", f"model.hidden_size={size['h']}",
        f"model.num_heads={size['a']}", f"model.seq_len={size['s']}", "model.dropout=0.1",
        "model.attention_dropout=0.1", "parallel.data=1", f"parallel.tensor={t}",
        f"parallel.sequence_parallel={str(sp).lower()}", f"train.global_batch={size['b']}",
        f"train.micro_batch={size['b']}", f"train.precision={precision or PRECISION}", f"train.recompute={mode}",
        f"train.recompute_layers={layers // 2 if mode == 'block' else 0}"])
    validate(cfg, t)
    return Trainer(cfg, make_mesh(1, 1, t, jax.devices()[:t]), VOCAB)


def width() -> int:
    """Bytes per value at PRECISION."""
    return 4 if PRECISION == "fp32" else 2


# 1. activation memory ------------------------------------------------------------------------
def formula(size: dict, t: int, sp: bool, mode: str, value_bytes: int) -> float:
    """`korthikanti_bytes` per layer and device (masks 1 byte); block: half the layers full,
    half none, so the mean of the two."""
    if mode == "block":
        return (formula(size, t, sp, "full", value_bytes) + formula(size, t, sp, "none", value_bytes)) / 2
    return korthikanti_bytes(size["s"], size["b"], size["h"], size["a"], t, sp, mode, value_bytes)


def memory_rows(size: dict, t: int) -> list[dict]:
    """Per layer and device, every layout and mode: the saved set in bf16 against the 16-bit
    formula; at PRECISION the saved set, XLA's stacked residual buffers and delta-temp / delta-l
    (held against the saved set: what XLA adds to what autodiff asks for)."""
    l1, l2 = MEMORY_DEPTHS
    rows = []
    for tt, sp in layouts(t):
        for mode in MODES:
            saved16 = saved_bytes_per_layer(trainer(size, l2, tt, sp, mode, "bf16"))
            shallow = compile_grad(trainer(size, l1, tt, sp, mode)).memory_analysis().temp_size_in_bytes
            deep_tr = trainer(size, l2, tt, sp, mode)
            deep = compile_grad(deep_tr).memory_analysis().temp_size_in_bytes
            saved = saved_bytes_per_layer(deep_tr)["total"]
            stacked = xla_stacked_bytes(deep_tr, {l2 // 2, l2 - l2 // 2} if mode == "block" else {l2})
            xla = (deep - shallow) / (l2 - l1)
            acts, grads = stacked["activations"] / l2, stacked["weights"] / l2
            ref16 = formula(size, tt, sp, mode, 2)
            rows.append({"t": tt, "sp": sp, "mode": mode, "saved_bf16": saved16, "formula_16bit": ref16,
                         "saved_bf16_ratio": saved16["total"] / ref16, "saved": saved,
                         "formula": formula(size, tt, sp, mode, width()), "temp_bytes": {l1: int(shallow), l2: int(deep)},
                         "xla_delta_temp": xla, "stacked_activations": acts, "stacked_grads": grads,
                         "stacked_ratio": acts / saved, "delta_temp_ratio": xla / saved})
            print(f"   t={tt} sp={sp} {mode}: saved bf16 {saved16['total'] / ref16:.3f} x formula; {PRECISION} "
                  f"stacked {acts / saved:.3f} x saved, delta-temp {xla / saved:.3f} x saved", flush=True)
    return rows


# 2. step time ----------------------------------------------------------------------------------
def timed_step(run: dict, batch) -> tuple[float, float]:
    """(process CPU seconds over all threads, wall seconds) of one step; the state moves on."""
    c0, w0 = time.process_time(), time.perf_counter()
    run["state"], metrics = run["trainer"].train_step(run["state"], batch)
    jax.block_until_ready((run["state"], metrics))
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    if not np.isfinite(float(metrics["loss"])):
        raise FloatingPointError(f"non-finite loss {float(metrics['loss'])}")
    return cpu, wall


def time_rows(size: dict, t: int, steps: tuple[int, int]) -> list[dict]:
    """Median CPU / wall seconds per step of each mode, and the ratio to `none`, per layout."""
    warmup, timed = steps
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, VOCAB, (size["b"], size["s"] + 1)) for _ in range(warmup + timed)]
    rows = []
    for tt, sp in layouts(t):
        runs = {}
        for mode in MODES:
            tr = trainer(size, TIME_DEPTH, tt, sp, mode)
            runs[mode] = {"trainer": tr, "state": tr.init_state()}
        samples = {mode: [] for mode in MODES}
        for i, batch in enumerate(batches):
            for mode, run in runs.items():       # the first pass compiles
                sample = timed_step(run, run["trainer"].put_batch(batch))
                if i >= warmup:
                    samples[mode].append(sample)
        cfg = runs["none"]["trainer"].cfg
        vocab = runs["none"]["trainer"].padded_vocab
        base_flops = flops_per_step(cfg.model, vocab, cfg.train.global_batch, "none")
        block = TIME_DEPTH // 2
        for mode in MODES:
            cpu = statistics.median(c for c, _ in samples[mode])
            wall = statistics.median(w for _, w in samples[mode])
            rows.append({"t": tt, "sp": sp, "mode": mode, "steps": timed, "cpu_s": cpu, "wall_s": wall,
                         "flops_ratio": flops_per_step(cfg.model, vocab, cfg.train.global_batch, mode, block) / base_flops})
        base = rows[-len(MODES)]
        for r in rows[-len(MODES):]:
            r["cpu_ratio"], r["wall_ratio"] = r["cpu_s"] / base["cpu_s"], r["wall_s"] / base["wall_s"]
        print(f"   t={tt} sp={sp}: " + ", ".join(f"{r['mode']} {r['cpu_ratio']:.2f}" for r in rows[-len(MODES):]), flush=True)
    return rows


# tables ------------------------------------------------------------------------------------------
def tables(mem: list, steps: list, size: dict) -> str:
    sp_name = lambda r: ("on" if r["sp"] else "off") if r["t"] > 1 else "–"  # noqa: E731
    sbh = size["s"] * size["b"] * size["h"]
    kib = lambda n: f"{n / 1024:,.1f}"  # noqa: E731
    out = [f"### 1. Activation memory per layer per device (KiB; s·b·h = {sbh} elements, "
           f"a·s/h = {size['a'] * size['s'] / size['h']:g})",
           f"| t | SP | recompute | saved bf16 | formula 16-bit | saved / formula | saved {PRECISION} "
           f"| XLA stacked {PRECISION} | stacked / saved | XLA Δtemp/Δl | Δtemp / saved |",
           "|---:|:--:|:--|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in mem:
        out.append(f"| {r['t']} | {sp_name(r)} | {r['mode']} | {kib(r['saved_bf16']['total'])} "
                   f"| {kib(r['formula_16bit'])} | {r['saved_bf16_ratio']:.3f} | {kib(r['saved'])} "
                   f"| {kib(r['stacked_activations'])} | {r['stacked_ratio']:.3f} | {kib(r['xla_delta_temp'])} "
                   f"| {r['delta_temp_ratio']:.2f} |")
    out += ["", f"### 2. {PRECISION} train step (l = {TIME_DEPTH}, median of {steps[0]['steps']} steps), "
            "relative to recompute = none on the same layout",
            "| t | SP | recompute | CPU s (all threads) | CPU / none | wall s | wall / none | FLOPs / none |",
            "|---:|:--:|:--|---:|---:|---:|---:|---:|"]
    for r in steps:
        out.append(f"| {r['t']} | {sp_name(r)} | {r['mode']} | {r['cpu_s']:.3f} | {r['cpu_ratio']:.2f} "
                   f"| {r['wall_s']:.3f} | {r['wall_ratio']:.2f} | {r['flops_ratio']:.3f} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_memory.py",
                                description="Activation recomputation: memory per layer and step time.")
    p.add_argument("--quick", action="store_true", help="h=64, s=64 and fewer timed steps (a smoke run)")
    p.add_argument("--tensor", type=int, default=4, help="tensor size of the parallel layouts (default 4)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="train.precision (default fp32; bf16 on a GPU)")
    p.add_argument("--size", metavar="h,a,s,b", help="model shape instead of the preset (e.g. 768,12,1024,8)")
    p.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    global PRECISION
    PRECISION = args.precision
    mode = "quick" if args.quick else "full"
    size = SIZES[mode]
    if args.size:
        size = dict(zip("hasb", (int(v) for v in args.size.split(","))))
        if len(size) != 4:
            p.error("--size takes four integers h,a,s,b")
    if args.tensor > len(jax.devices()):
        p.error(f"--tensor {args.tensor} needs that many devices; {len(jax.devices())} here")
    print(f"jax {jax.__version__}, {len(jax.devices())} × {jax.devices()[0].device_kind} on {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}; GPT h={size['h']} a={size['a']} s={size['s']} b={size['b']}, "
          f"dropout 0.1, {PRECISION}, XLA_FLAGS={os.environ['XLA_FLAGS']}", flush=True)
    t0 = time.perf_counter()
    print(f"1. memory at l={MEMORY_DEPTHS} ...", flush=True)
    mem = memory_rows(size, args.tensor)
    print(f"2. step time at l={TIME_DEPTH} ... ({time.perf_counter() - t0:.0f} s)", flush=True)
    steps = time_rows(size, args.tensor, STEPS[mode])
    print(f"done in {time.perf_counter() - t0:.0f} s, load average at the end {os.getloadavg()[0]:.2f}\n")
    print(tables(mem, steps, size))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "argv": argv,
                       "precision": PRECISION, "size": size, "xla_flags": os.environ["XLA_FLAGS"],
                       "memory_depths": MEMORY_DEPTHS, "time_depth": TIME_DEPTH, "memory": mem, "steps": steps},
                      f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

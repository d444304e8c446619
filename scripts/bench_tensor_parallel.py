"""`python scripts/bench_tensor_parallel.py [--quick] [--json OUT]`

Tensor (and sequence) parallelism on 8 simulated CPU devices, held against
Megatron's figures, for a small GPT (MHA, dropout on so that the masks exist)
at t in {1, 2, 4, 8}, sequence parallelism (SP) off and on.
Shape legend: b micro-batch, s sequence, h hidden, a heads, t tensor size, l layers.

1. Collective bytes per layer and micro-batch on `tensor`, read from the compiled train
   step at two depths (`compile_train_step` + `compiled_report`, the two halves of
   `mtjax.inspect.report`, so part 3 times the same executables), difference / delta-l.
   fp32, because XLA:CPU sends bf16 as f32. Theory, 4-byte elements:
     no SP: 4 all-reduces of b*s*h (2 forward, 2 backward);
     SP:    6 all-gathers + 4 reduce-scatters of b*s*h (the report counts the full
            tensor): the 4 of an all-reduce's ring traffic (reduce-scatter + all-gather), and
            the backward gathers the two norm outputs again from the s/t shards the layer keeps.
   With SP the gradients of the per-layer replicated parameters (2 LayerNorms, the
   attention-output and fc2 biases: 6h) are partial sums, all-reduced once per step.
2. Activation memory per layer per device (recompute = none) against Korthikanti et al.
   2022 (`mtjax.activations.korthikanti_bytes`, 16-bit bytes): sbh(34 + 5as/h) at t = 1,
   sbh(10 + 24/t + 5as/(ht)) with t, (sbh/t)(34 + 5as/h) with t and SP; for fp32 the same
   tensors at 4 bytes and the masks at 1 byte. Every mode is in bench_memory.py.
   - saved: the bytes autodiff keeps for backward (the leaves of jax.vjp's closure, traced
     per device inside shard_map), per layer, only those that grow with b; bf16 and fp32.
   - XLA: `temp_size_in_bytes` of the compiled gradient function (micro_batches = 1) at
     two depths, difference / delta-l, in fp32. It also holds each layer's fp32 gradient
     buffer. In bf16 XLA:CPU, which has no bf16 arithmetic, keeps f32 copies of the stacked
     bf16 residuals for the backward loop, so bf16 temp bytes describe the CPU backend, not
     the model; one bf16 figure (t = 1) is printed to show it.
3. CPU time of one fp32 train step on a tensor = t mesh relative to one device, same
   global batch: median over steps of process CPU time (all threads) and wall time, the
   layouts taking turns step by step. The 8 simulated devices share this machine's cores;
   total CPU time near 1 device's means the work is split, not repeated.
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

from mtjax.activations import compile_grad, korthikanti_bytes, saved_bytes_per_layer  # noqa: E402
from mtjax.config import load_config, validate  # noqa: E402
from mtjax.hlo_report import compiled_report  # noqa: E402
from mtjax.inspect import compile_train_step  # noqa: E402
from mtjax.mesh import TENSOR, make_mesh  # noqa: E402
from mtjax.training.trainer import Trainer  # noqa: E402

VOCAB = 257                                    # the byte tokenizer's
TENSOR_SIZES = (1, 2, 4, 8)
SIZES = {"full": {"h": 256, "a": 8, "s": 256, "b": 2}, "quick": {"h": 64, "a": 8, "s": 64, "b": 2}}
COLLECTIVE_DEPTHS = (2, 4)                     # l for part 1; the first also times part 3
MEMORY_DEPTHS = (2, 6)                         # l for XLA's temp bytes (per-layer steps vary by a few %)
RESIDUAL_DEPTH = 3                             # l for saved residuals: stacked arrays lead with l (not b or 2b)
STEPS = {"full": (2, 7), "quick": (1, 3)}       # (warm-up, timed) train steps per layout, part 3


def layouts():
    """(t, sp) pairs: one device, then each t > 1 without and with sequence parallelism."""
    return [(1, False)] + [(t, sp) for t in TENSOR_SIZES[1:] for sp in (False, True)]


def trainer(size: dict, layers: int, t: int, sp: bool, precision: str, b: int | None = None) -> Trainer:
    """A Trainer on a (1, 1, t) mesh with micro_batches = 1 (global batch = b)."""
    b = b or size["b"]
    cfg = load_config(None, [
        "model.arch=gpt", f"model.num_layers={layers}", f"model.hidden_size={size['h']}",
        f"model.num_heads={size['a']}", f"model.seq_len={size['s']}", "model.dropout=0.1",
        "model.attention_dropout=0.1", "parallel.data=1", f"parallel.tensor={t}",
        f"parallel.sequence_parallel={str(sp).lower()}", f"train.global_batch={b}", f"train.micro_batch={b}",
        f"train.precision={precision}"])
    validate(cfg, t)
    return Trainer(cfg, make_mesh(1, 1, t, jax.devices()[:t]), VOCAB)


# 1. collectives ------------------------------------------------------------------------------
def tensor_members(collectives: dict, bsh: int) -> dict:
    """{(kind, 'act' | 'other'): [count, bytes]} over collectives on `tensor`, through loops.

    'act' are the b*s*h activation tensors (per micro-batch); 'other' the rest (loss
    reductions, once-per-step gradient reductions, scalars)."""
    out = {}
    for op in collectives["ops"]:
        if tuple(op["axes"]) != (TENSOR,):
            continue
        scale = op["group_size"] if op["kind"] == "reduce-scatter" else 1
        for shape in op["shapes"]:
            dims = [int(x) for x in shape[shape.index("[") + 1:-1].split(",") if x]
            n = int(np.prod(dims)) * scale
            width = op["bytes"] // op["elements"] if op["elements"] else 0
            key = (op["kind"], "act" if n == bsh else "other")
            count, nbytes = out.get(key, (0, 0))
            out[key] = (count + op["multiplicity"], nbytes + op["multiplicity"] * n * width)
    return out


def collective_rows(size: dict, compiled_l1: dict) -> list[dict]:
    """Per-layer tensor-axis bytes, measured (depth difference) vs theory, for t > 1."""
    h, bsh = size["h"], size["b"] * size["s"] * size["h"]
    l1, l2 = COLLECTIVE_DEPTHS
    rows = []
    for t, sp in layouts()[1:]:
        tr = trainer(size, l2, t, sp, "fp32")
        deep = tensor_members(compiled_report(compile_train_step(tr), tr.mesh)["collectives"], bsh)
        shallow = tensor_members(compiled_l1[(t, sp)]["collectives"], bsh)
        per_layer = {k: [(d - s) / (l2 - l1) for d, s in zip(deep.get(k, (0, 0)), shallow.get(k, (0, 0)))]
                     for k in set(deep) | set(shallow)}
        kinds = ("all-gather", "reduce-scatter") if sp else ("all-reduce",)
        counts = {k: per_layer.get((k, "act"), (0, 0))[0] for k in kinds}
        measured = {k: per_layer.get((k, "act"), (0, 0))[1] for k in kinds}
        expected = {(k, "act") for k in kinds} | {("all-reduce", "other")}
        stray = {f"{k[0]} ({k[1]})": v for k, v in per_layer.items() if any(v) and k not in expected}
        # SP: the backward gathers the two norm outputs again from their s/t shards (Megatron's
        # choice, Korthikanti et al. 4.2.2), so 6 all-gathers to 4 reduce-scatters
        theory = {k: (6 if k == "all-gather" else 4) * bsh * 4 for k in kinds}
        ring = sum(measured.values()) * (t - 1) / t * (1 if sp else 2)   # bytes each device sends
        rows.append({"t": t, "sp": sp, "counts": counts, "measured": measured, "theory": theory,
                     "ratio": sum(measured.values()) / sum(theory.values()), "ring_bytes_per_device": ring,
                     "grad_reduce_bytes": per_layer.get(("all-reduce", "other"), (0, 0))[1],
                     "grad_reduce_theory": 6 * h * 4 if sp else 0, "unexpected": stray})
    return rows


# 2. activation memory ------------------------------------------------------------------------
def formula_bytes(size: dict, t: int, sp: bool, width: int = 2) -> float:
    """`korthikanti_bytes` of recompute = none, values `width` bytes, masks 1 byte."""
    return korthikanti_bytes(size["s"], size["b"], size["h"], size["a"], t, sp, "none", width)


def xla_per_layer(size: dict, t: int, sp: bool, precision: str) -> float:
    """(temp(l2) - temp(l1)) / (l2 - l1) of the gradient function, bytes per device."""
    l1, l2 = MEMORY_DEPTHS
    temps = [compile_grad(trainer(size, l, t, sp, precision)).memory_analysis().temp_size_in_bytes for l in (l1, l2)]
    return (temps[1] - temps[0]) / (l2 - l1)


def saved_per_layer(size: dict, t: int, sp: bool, precision: str) -> dict:
    """`saved_bytes_per_layer` of a RESIDUAL_DEPTH-layer model."""
    return saved_bytes_per_layer(trainer(size, RESIDUAL_DEPTH, t, sp, precision))


def memory_rows(size: dict) -> list[dict]:
    rows = []
    for t, sp in layouts():
        saved16, saved32 = (saved_per_layer(size, t, sp, p) for p in ("bf16", "fp32"))
        xla = xla_per_layer(size, t, sp, "fp32")
        f16, f32 = formula_bytes(size, t, sp, 2), formula_bytes(size, t, sp, 4)
        rows.append({"t": t, "sp": sp, "formula_16bit": f16, "saved_bf16": saved16,
                     "saved_bf16_ratio": saved16["total"] / f16, "formula_fp32": f32, "saved_fp32": saved32,
                     "saved_fp32_ratio": saved32["total"] / f32, "xla_fp32": xla, "xla_fp32_ratio": xla / f32})
    return rows


# 3. CPU time ---------------------------------------------------------------------------------
def timed_step(run: dict) -> tuple[float, float]:
    """(process CPU seconds over all threads, wall seconds) of one step; the state moves on."""
    c0, w0 = time.process_time(), time.perf_counter()
    run["state"], metrics = run["compiled"](run["state"], run["batch"])
    jax.block_until_ready((run["state"], metrics))
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    if not np.isfinite(float(metrics["loss"])):
        raise FloatingPointError(f"non-finite loss {float(metrics['loss'])}")
    return cpu, wall


def step_rows(size: dict, mode: str) -> tuple[list[dict], dict]:
    """Median CPU/wall seconds per step for each (t, sp) at l = COLLECTIVE_DEPTHS[0], and those
    programs' reports (reused by part 1). Layouts take turns step by step, so that changes in
    the machine's load fall on all of them alike."""
    warmup, steps = STEPS[mode]
    tokens = np.random.default_rng(0).integers(0, VOCAB, (size["b"], size["s"] + 1))
    runs, reports = {}, {}
    for t, sp in layouts():
        tr = trainer(size, COLLECTIVE_DEPTHS[0], t, sp, "fp32")
        compiled = compile_train_step(tr)
        reports[(t, sp)] = compiled_report(compiled, tr.mesh)
        runs[(t, sp)] = {"compiled": compiled, "state": tr.init_state(), "batch": tr.put_batch(tokens)}
    samples = {key: [] for key in runs}
    for i in range(warmup + steps):
        for key, run in runs.items():
            sample = timed_step(run)
            if i >= warmup:
                samples[key].append(sample)
    rows = [{"t": t, "sp": sp, "steps": steps, "cpu_s": statistics.median(c for c, _ in samples[(t, sp)]),
             "wall_s": statistics.median(w for _, w in samples[(t, sp)])} for t, sp in runs]
    for r in rows:
        r["cpu_ratio"], r["wall_ratio"] = r["cpu_s"] / rows[0]["cpu_s"], r["wall_s"] / rows[0]["wall_s"]
    return rows, reports


# tables --------------------------------------------------------------------------------------
def mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def tables(coll: list, mem: list, bf16_xla: float, steps: list, size: dict) -> str:
    sp_name = {False: "off", True: "on"}
    out = ["### 1. Tensor-axis collectives per layer per micro-batch (fp32, MiB; report bytes = full tensor)",
           "| t | SP | all-reduce | all-gather | reduce-scatter | theory | measured/theory "
           "| ring MiB sent/device | grad all-reduce B/layer (theory) |",
           "|---:|:--:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in coll:
        m = r["measured"]
        cells = [f"{r['counts'][k]:g} × {mib(m[k] / r['counts'][k])} = {mib(m[k])}" if k in m else "–"
                 for k in ("all-reduce", "all-gather", "reduce-scatter")]
        out.append(f"| {r['t']} | {sp_name[r['sp']]} | {' | '.join(cells)} | {mib(sum(r['theory'].values()))} "
                   f"| {r['ratio']:.2f} | {mib(r['ring_bytes_per_device'])} "
                   f"| {r['grad_reduce_bytes']:.0f} ({r['grad_reduce_theory']}) |")
    if any(r["unexpected"] for r in coll):
        out.append(f"unexpected per-layer collectives: {[(r['t'], r['sp'], r['unexpected']) for r in coll]}")
    sbh = size["s"] * size["b"] * size["h"]
    out += ["", f"### 2. Activation memory per layer per device (MiB; s·b·h = {sbh} elements)",
            "| t | SP | formula 16-bit | saved bf16 (of it fp32 / bf16 / bool) | saved/formula "
            "| formula fp32 | saved fp32 | saved/formula | XLA Δtemp/Δl fp32 | XLA/formula | XLA − saved |",
            "|---:|:--:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in mem:
        s16 = r["saved_bf16"]
        parts = " / ".join(mib(s16.get(k, 0)) for k in ("float32", "bfloat16", "bool"))
        out.append(f"| {r['t']} | {sp_name[r['sp']] if r['t'] > 1 else '–'} | {mib(r['formula_16bit'])} "
                   f"| {mib(s16['total'])} ({parts}) | {r['saved_bf16_ratio']:.2f} | {mib(r['formula_fp32'])} "
                   f"| {mib(r['saved_fp32']['total'])} | {r['saved_fp32_ratio']:.2f} | {mib(r['xla_fp32'])} "
                   f"| {r['xla_fp32_ratio']:.2f} | {mib(r['xla_fp32'] - r['saved_fp32']['total'])} |")
    out.append(f"XLA Δtemp/Δl in bf16 at t = 1: {mib(bf16_xla)} MiB (fp32: {mib(mem[0]['xla_fp32'])} MiB)")
    out += ["", "### 3. One fp32 train step (median), tensor = t mesh vs one device, same global batch",
            "| t | SP | CPU s (all threads) | CPU / 1 device | wall s | wall / 1 device |",
            "|---:|:--:|---:|---:|---:|---:|"]
    for r in steps:
        out.append(f"| {r['t']} | {sp_name[r['sp']] if r['t'] > 1 else '–'} | {r['cpu_s']:.3f} "
                   f"| {r['cpu_ratio']:.2f} | {r['wall_s']:.3f} | {r['wall_ratio']:.2f} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_tensor_parallel.py",
                                description="Tensor/sequence parallelism against Megatron's figures.")
    p.add_argument("--quick", action="store_true", help="h=64, s=64 and fewer timed steps (a smoke run)")
    p.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    mode = "quick" if args.quick else "full"
    size = SIZES[mode]
    print(f"jax {jax.__version__}, {len(jax.devices())} simulated CPU devices on {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}; GPT h={size['h']} a={size['a']} s={size['s']} b={size['b']}, "
          f"dropout 0.1, XLA_FLAGS={os.environ['XLA_FLAGS']}", flush=True)
    t0 = time.perf_counter()
    print("3. timing train steps (l=%d, fp32) ..." % COLLECTIVE_DEPTHS[0], flush=True)
    steps, reports = step_rows(size, mode)
    print(f"1. collectives at l={COLLECTIVE_DEPTHS[1]} ... ({time.perf_counter() - t0:.0f} s)", flush=True)
    coll = collective_rows(size, reports)
    print(f"2. memory at l={MEMORY_DEPTHS} ... ({time.perf_counter() - t0:.0f} s)", flush=True)
    mem = memory_rows(size)
    bf16_xla = xla_per_layer(size, 1, False, "bf16")
    print(f"done in {time.perf_counter() - t0:.0f} s, load average at the end {os.getloadavg()[0]:.2f}\n")
    print(tables(coll, mem, bf16_xla, steps, size))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"jax": jax.__version__, "argv": argv, "size": size, "xla_flags": os.environ["XLA_FLAGS"],
                       "collectives": coll, "memory": mem,
                       "xla_bf16_per_layer_t1": bf16_xla, "steps": steps}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

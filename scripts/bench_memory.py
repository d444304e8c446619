"""`python scripts/bench_memory.py [--quick | --size h,a,s,b] [--tensor T] [--precision P] [--json OUT]`

Activation recomputation (`train.recompute` none | selective | full | block) on 8 simulated
CPU devices, held against Korthikanti et al. (2022), for a small GPT (MHA, dropout on so
that the masks exist, one micro-batch per step) on three layouts: one device, tensor = T,
and tensor = T with sequence parallelism (SP).
Shape legend: b micro-batch, s sequence, h hidden, a heads, t tensor size, l layers.

1. Activation memory per layer per device: `temp_size_in_bytes` of the compiled gradient
   function (`Trainer.grad_fn`, micro_batches = 1) at two depths, difference / delta-l, as in
   bench_tensor_parallel. fp32, because XLA:CPU has no bf16 arithmetic and keeps f32 copies of
   bf16 residuals, so its bf16 temp bytes describe the backend, not the model. The reference
   is Korthikanti's 16-bit figure times 2 (every tensor at 4 bytes, masks included), bytes:
     none       sbh(34 + 5as/h) at t = 1; sbh(10 + 24/t + 5as/(ht)); SP (sbh/t)(34 + 5as/h)
     selective  sbh(10 + 24/t) (34 sbh at t = 1); SP 34 sbh/t
     full       2 sbh, the layer input only; SP 2 sbh/t
     block      N = l/2 of the l layers as full, the rest as none: the mean of the two
   Two things make delta-temp an imperfect measure of activations, so the deeper program's
   buffer assignment (XLA's dump for that one compile) is also read: the temp buffers with a
   leading `layers` dimension, split into the stacked fp32 weight gradients (shaped like this
   device's share of a layer's parameters, about 4 * 12h^2/t bytes; not activations, but temp
   here) and the rest, the saved activations. And the temp size is a packed
   heap (lifetimes overlap, fragmentation changes with depth), so delta-temp / delta-l can be
   smaller than the stacked bytes per layer when the per-layer part is small.
2. Step time of each mode relative to `none` on the same layout: median over steps of the
   process CPU time (all threads) and wall time of `Trainer.train_step` (fp32) on random
   batches, the three modes taking turns step by step so that load changes fall on all
   alike; next to it the analytical ratio of `flops_per_step(..., recompute=mode)`
   (Megatron's accounting: matmuls only). The paper: full about +33 %, selective a few %.

On a GPU (the script runs on `jax.devices()`, the GPUs where there are any): `--tensor 1` keeps
only the one-device layout, `--precision bf16` measures 16-bit activations against Korthikanti's
16-bit bytes as they are (fp32 keeps the factor 2), and `--size h,a,s,b` sets the shape.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import re
import sys
import tempfile
import time

from mtjax.mesh import simulate_cpu_devices

# One thread per simulated device for its matmuls, so CPU time sums work, not pool overhead.
os.environ["XLA_FLAGS"] = " ".join(os.environ.get("XLA_FLAGS", "").split() + ["--xla_cpu_multi_thread_eigen=false"])
simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from mtjax.config import load_config, validate  # noqa: E402
from mtjax.inspect import abstract_state  # noqa: E402
from mtjax.mesh import make_mesh  # noqa: E402
from mtjax.training.flops import flops_per_step  # noqa: E402
from mtjax.training.step import batch_sharding  # noqa: E402
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


PRECISION = "fp32"                             # --precision sets it


def trainer(size: dict, layers: int, t: int, sp: bool, mode: str) -> Trainer:
    """A PRECISION Trainer on a (1, 1, t) mesh with one micro-batch per step (global batch = b)."""
    cfg = load_config(None, [
        "model.arch=gpt", f"model.num_layers={layers}", f"model.hidden_size={size['h']}",
        f"model.num_heads={size['a']}", f"model.seq_len={size['s']}", "model.dropout=0.1",
        "model.attention_dropout=0.1", "parallel.data=1", f"parallel.tensor={t}",
        f"parallel.sequence_parallel={str(sp).lower()}", f"train.global_batch={size['b']}",
        f"train.micro_batch={size['b']}", f"train.precision={PRECISION}", f"train.recompute={mode}",
        f"train.recompute_layers={layers // 2 if mode == 'block' else 0}"])
    validate(cfg, t)
    return Trainer(cfg, make_mesh(1, 1, t, jax.devices()[:t]), VOCAB)


def bytes_per_element() -> int:
    return 4 if PRECISION == "fp32" else 2


# 1. activation memory ------------------------------------------------------------------------
def formula_16bit(size: dict, t: int, sp: bool, mode: str) -> float:
    """Korthikanti et al. (2022), 16-bit bytes per layer per device.

    In s*b*h units: 10 (2 LayerNorm inputs, attention and MLP inputs, 2 one-byte dropout masks)
    replicated over `tensor` unless SP splits them; 24 (Q, K, V, attention output, fc1 and GeLU
    outputs) split over t; 5as/h (softmax, its dropout mask and output) split over t. Selective
    recomputation drops the 5as/h term; full keeps only the layer input (2 bytes per element)."""
    s, b, h, a = size["s"], size["b"], size["h"], size["a"]
    sbh, r = s * b * h, (t if sp else 1)
    if mode == "full":
        return 2 * sbh / r
    if mode == "block":          # half the layers as full, half as none
        return (formula_16bit(size, t, sp, "full") + formula_16bit(size, t, sp, "none")) / 2
    attention = 5 * a * s / (h * t) if mode == "none" else 0.0
    return sbh * (10 / r + 24 / t + attention)


VALUE = re.compile(r"value: <\d+ \S+ @\d+> \(size=(\d+),offset=(\d+)\): \w+\[([\d,]*)\]")


def grad_compile(tr: Trainer, dump_dir: str | None = None):
    """The jitted gradient function compiled for abstract inputs; with `dump_dir`, XLA dumps
    this one compile there (its buffer assignment is what `stacked_bytes` reads)."""
    cfg = tr.cfg
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=batch_sharding(tr.mesh))
    key = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(tr.mesh, P()))
    options = {"xla_dump_to": dump_dir} if dump_dir else None
    return jax.jit(tr.grad_fn).lower(abstract_state(tr).params, batch, rng).compile(compiler_options=options)


def local_param_shapes(tr: Trainer) -> set[tuple[int, ...]]:
    """This device's shapes of every parameter (the stacked layer weights lead with l)."""
    return {tuple(leaf.sharding.shard_shape(leaf.shape)) for leaf in jax.tree.leaves(abstract_state(tr).params)}


def stacked_bytes(dump_dir: str, layers: set, weight_shapes: set) -> dict:
    """Bytes of the temp buffers with a leading dimension in `layers` (the run lengths: l, or
    block mode's N and l - N) in XLA's buffer assignment,
    {'weights': shaped like the stacked parameters (their gradients), 'activations': the rest}.
    Values that share an offset are one buffer (XLA aliases in-place updates): counted once."""
    path = next(os.path.join(dump_dir, f) for f in sorted(os.listdir(dump_dir))
                if f.endswith("after_optimizations-buffer-assignment.txt"))
    with open(path, encoding="utf-8") as f:
        text = f.read()
    temp = text[text.index("preallocated-temp:"):]
    temp = temp[:temp.find("\nallocation ")] if "\nallocation " in temp else temp
    buffers = {}
    for size, offset, dims in VALUE.findall(temp):
        shape = tuple(int(d) for d in dims.split(",") if d)
        if len(shape) > 1 and shape[0] in layers:
            kind = "weights" if shape[1:] in {w[1:] for w in weight_shapes} else "activations"
            old = buffers.get(int(offset), (0, kind))
            buffers[int(offset)] = max(old, (int(size), kind))
    out = {"weights": 0, "activations": 0}
    for size, kind in buffers.values():
        out[kind] += size
    return out


def memory_rows(size: dict, t: int) -> list[dict]:
    """Per layer and device: XLA delta-temp / delta-l and the stacked buffers, against 2 x the
    16-bit formula, for every layout and mode."""
    l1, l2 = MEMORY_DEPTHS
    rows = []
    for tt, sp in layouts(t):
        for mode in MODES:
            shallow = grad_compile(trainer(size, l1, tt, sp, mode)).memory_analysis().temp_size_in_bytes
            deep_tr = trainer(size, l2, tt, sp, mode)
            with tempfile.TemporaryDirectory(prefix="bench_memory_") as dump:
                deep = grad_compile(deep_tr, dump).memory_analysis().temp_size_in_bytes
                stacked = stacked_bytes(dump, {l2 // 2, l2 - l2 // 2} if mode == "block" else {l2},
                                        local_param_shapes(deep_tr))
            xla = (deep - shallow) / (l2 - l1)
            acts, grads = stacked["activations"] / l2, stacked["weights"] / l2
            ref = bytes_per_element() / 2 * formula_16bit(size, tt, sp, mode)
            rows.append({"t": tt, "sp": sp, "mode": mode, "temp_bytes": {l1: int(shallow), l2: int(deep)},
                         "xla_fp32": xla, "stacked_activations": acts, "stacked_grads": grads,
                         "formula_16bit": ref / 2, "reference_fp32": ref,
                         "xla_ratio": xla / ref, "activations_ratio": acts / ref})
            print(f"   t={tt} sp={sp} {mode}: delta-temp {xla / 2**20:.3f} MiB/layer, stacked activations "
                  f"{acts / 2**20:.3f} + weight gradients {grads / 2**20:.3f}", flush=True)
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
    e = bytes_per_element()
    factor = "16-bit × 2" if e == 4 else "16-bit"
    out = [f"### 1. Activation memory per layer per device, {PRECISION} (MiB; s·b·h = {sbh} elements, "
           f"a·s/h = {size['a'] * size['s'] / size['h']:g}; reference = {e // 2} × Korthikanti's 16-bit bytes)",
           "| t | SP | recompute | XLA Δtemp/Δl | stacked activations | stacked weight grads "
           f"| reference {PRECISION} ({factor}) | Δtemp / ref | activations / ref | activations in s·b·h × {e} B |",
           "|---:|:--:|:--|---:|---:|---:|---:|---:|---:|---:|"]
    for r in mem:
        out.append(f"| {r['t']} | {sp_name(r)} | {r['mode']} | {r['xla_fp32'] / 2**20:.3f} "
                   f"| {r['stacked_activations'] / 2**20:.3f} | {r['stacked_grads'] / 2**20:.3f} "
                   f"| {r['reference_fp32'] / 2**20:.3f} | {r['xla_ratio']:.2f} | {r['activations_ratio']:.2f} "
                   f"| {r['stacked_activations'] / (e * sbh):.2f} |")
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

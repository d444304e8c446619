"""`python scripts/bench_offload.py [--layers L] [--size h,a,s,b] [--steps N] [--json OUT]`

Activation offload (`train.offload_activations=true`) on one GPU: does it take the saved
residuals out of device memory, what does it cost in step time, and are the gradients unchanged?
It needs an accelerator with a pinned_host memory space (validation refuses it on CPU).

For recompute in {none, selective, block (N = L/2)}, each without and with offload, bf16, a GPT of
L layers (h, a, s, b from --size), one device, one micro-batch:
  - device temp bytes and host temp bytes of the compiled gradient function (XLA's memory
    analysis: `temp_size_in_bytes`, `host_temp_size_in_bytes`);
  - the median step time of the train step over N steps after 2 warm-up steps;
  - max |g_offload - g| / max |g| over the gradient leaves, against the same mode without offload,
    leaving out the key projection's bias (its true gradient is exactly zero: softmax ignores a
    constant q.b_k per query row, so both sides hold rounding noise only), and the leaf where
    the worst one is found. bf16 (and TF32 for fp32 matmuls on NVIDIA GPUs) rounding differs
    between fusions, so expect 1e-3 to 1e-2 here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtjax.config import load_config, validate  # noqa: E402
from mtjax.mesh import make_mesh  # noqa: E402
from mtjax.training.trainer import Trainer  # noqa: E402

VOCAB = 257
ZERO_GRADIENT = "['layers']['attn']['k']['bias']"


def build(layers: int, size: tuple[int, int, int, int], mode: str, offload: bool) -> Trainer:
    h, a, s, b = size
    cfg = load_config(None, [
        "model.arch=gpt", f"model.num_layers={layers}", f"model.hidden_size={h}", f"model.num_heads={a}",
        f"model.seq_len={s}", f"train.global_batch={b}", f"train.micro_batch={b}", "train.precision=bf16",
        f"train.recompute={mode}", f"train.recompute_layers={layers // 2 if mode == 'block' else 0}",
        f"train.offload_activations={'true' if offload else 'false'}"])
    validate(cfg, 1)
    return Trainer(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), VOCAB)


def measure(trainer: Trainer, steps: int, batch, reference=None) -> dict:
    state = trainer.init_state()
    params, rng = state.params, state.rng
    grad = jax.jit(trainer.grad_fn)
    memory = grad.lower(params, batch, rng).compile().memory_analysis()
    grads, _ = grad(params, batch, rng)
    grads = jax.device_get(grads)
    times = []
    for _ in range(2 + steps):
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    row = {"temp_bytes": memory.temp_size_in_bytes,
           "host_temp_bytes": getattr(memory, "host_temp_size_in_bytes", None),
           "step_s": float(np.median(times[2:]))}
    if reference is not None:
        def rel(path, g, r):
            g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
            return float(np.max(np.abs(g - r))) / max(float(np.max(np.abs(r))), 1e-30), jax.tree_util.keystr(path)
        diffs = jax.tree.leaves(jax.tree_util.tree_map_with_path(rel, grads, reference),
                                is_leaf=lambda x: isinstance(x, tuple))
        row["grad_rel_diff"], row["worst_leaf"] = max(d for d in diffs if d[1] != ZERO_GRADIENT)
    return row, grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--size", default="1024,16,2048,4", help="h,a,s,b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    size = tuple(int(x) for x in args.size.split(","))
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {device.platform} {device.device_kind}, L={args.layers}, h,a,s,b={size}",
          flush=True)
    rows = []
    for mode in ("none", "selective", "block"):
        plain = build(args.layers, size, mode, False)
        tokens = np.random.default_rng(0).integers(0, VOCAB, (size[3], size[2] + 1))
        batch = plain.put_batch(tokens)
        base, grads = measure(plain, args.steps, batch)
        offload = build(args.layers, size, mode, True)
        moved, _ = measure(offload, args.steps, offload.put_batch(tokens), grads)
        rows.append({"mode": mode, "plain": base, "offload": moved})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| recompute | temp MiB | temp MiB, offload | host temp MiB, offload | step s | step s, offload | "
          "grad rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    mib = lambda x: "n/a" if x is None else f"{x / 2**20:.1f}"  # noqa: E731
    for r in rows:
        p, o = r["plain"], r["offload"]
        print(f"| {r['mode']} | {mib(p['temp_bytes'])} | {mib(o['temp_bytes'])} | {mib(o['host_temp_bytes'])} | "
              f"{p['step_s']:.4f} | {o['step_s']:.4f} | {o['grad_rel_diff']:.2e} ({o['worst_leaf']}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

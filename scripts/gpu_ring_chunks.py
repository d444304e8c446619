"""`python scripts/gpu_ring_chunks.py [--small] [--json OUT]`: on one GPU, the matmuls of
`parallel.tensor_overlap`'s rings measured beside the H100 model's prediction for them.

One GPU cannot run a tensor-parallel step, but it can run what one rank computes. For each of a
layer's four tensor-parallel matmuls, at one rank's shapes of t = 8 (gpt1.3b b 8 and the
Llama-2-13B shape b 1), it times

    whole    Y = X A_r over the gathered sequence, X [b, s, in]: what a rank computes after
             today's all-gather (column) or before today's reduce-scatter (row);
    chunks   the same product as t matmuls over X_c [b, s/t, in], each step fenced by an
             `optimization_barrier` as `ring.fence` fences a ring step, the rows
             joined at the end: a ring's compute without its permutes.

Measured: median of 15 blocks of 10 calls (one `block_until_ready` a block), three input sets in
rotation, random normal bf16. Predicted: the same jitted function's optimized HLO read by
`hlo_report.gpu_model.kernel_times` with the H100 record. chunks / whole measured says what
splitting a matmul t ways costs on the card; the model's ratio says whether the floor
(`scripts/tp_overlap_bound.py`, C_op / t per step) prices it right.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from mtjax.hlo_report.gpu_model import kernel_times  # noqa: E402
from mtjax.hlo_report.hardware import H100  # noqa: E402

T = 8


def shapes(b: int, s: int, h: int, f: int, gated: bool) -> dict:
    """{matmul: (b, s, in, out)} for one rank of t = T."""
    out = {"qkv (column)": (b, s, h, 3 * h // T), "attention out (row)": (b, s, h // T, h),
           "fc1 (column)": (b, s, h, (2 if gated else 1) * f // T), "fc2 (row)": (b, s, f // T, h)}
    return out


CASES = {"gpt1.3b t8 b8": shapes(8, 2048, 2048, 8192, False),
         "13b t8 b1": shapes(1, 4096, 5120, 13824, True)}
SMALL = {"small": shapes(2, 256, 256, 1024, False)}


def whole(x, w):
    return jnp.einsum("bsi,io->bso", x, w)                              # [b, s, out]


def chunks(x, w):
    n = x.shape[1] // T
    out = []
    for c in range(T):
        y = jnp.einsum("bni,io->bno", lax.slice_in_dim(x, c * n, (c + 1) * n, axis=1), w)   # [b, s/t, out]
        if c < T - 1:
            y, x = lax.optimization_barrier((y, x))                     # one ring step at a time
        out.append(y)
    return jnp.concatenate(out, axis=1)                                 # [b, s, out]


def measure(fn, inputs, blocks: int = 15, calls: int = 10) -> float:
    for x, w in inputs:
        fn(x, w).block_until_ready()
    times = []
    for k in range(blocks):
        start = time.perf_counter()
        for i in range(calls):
            y = fn(*inputs[(k * calls + i) % len(inputs)])
        y.block_until_ready()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def predicted(fn, x, w) -> float:
    k = kernel_times(fn.lower(x, w).compile().as_text(), H100)
    return sum(r["time_s"] * r["executions"] for r in k["kernels"])


def run_case(dims) -> dict:
    b, s, d_in, d_out = dims
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    inputs = [(jax.random.normal(keys[2 * i], (b, s, d_in), jnp.bfloat16),
               jax.random.normal(keys[2 * i + 1], (d_in, d_out), jnp.bfloat16)) for i in range(3)]
    row = {"dims": dims, "flops": 2 * b * s * d_in * d_out}
    jw, jc = jax.jit(whole), jax.jit(chunks)
    err = jnp.linalg.norm((jc(*inputs[0]) - jw(*inputs[0])).astype(jnp.float32)) / jnp.linalg.norm(
        jw(*inputs[0]).astype(jnp.float32))
    row["chunks_vs_whole_rel_err"] = float(err)
    for name, fn in (("whole", jw), ("chunks", jc)):
        row[name] = {"measured_s": measure(fn, inputs), "predicted_s": predicted(fn, *inputs[0])}
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU check of the script)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cases = SMALL if args.small else CASES
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| case | matmul | whole µs meas / pred | chunks µs meas / pred | chunks/whole meas | pred | meas TFLOP/s whole |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rows = {}
    for case, ops in cases.items():
        for op, dims in ops.items():
            r = rows[f"{case} | {op}"] = run_case(dims)
            w, c = r["whole"], r["chunks"]
            print(f"| {case} | {op} | {w['measured_s'] * 1e6:.0f} / {w['predicted_s'] * 1e6:.0f} | "
                  f"{c['measured_s'] * 1e6:.0f} / {c['predicted_s'] * 1e6:.0f} | "
                  f"{c['measured_s'] / w['measured_s']:.3f} | {c['predicted_s'] / w['predicted_s']:.3f} | "
                  f"{r['flops'] / w['measured_s'] / 1e12:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

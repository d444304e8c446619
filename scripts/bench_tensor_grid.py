"""`python scripts/bench_tensor_grid.py [--sizes 4,16,64] [--json OUT]`

1d, 1d + sequence parallelism, 2d and 2.5d tensor parallelism compared at t in {4, 16, 64},
compile-only: each t runs in a subprocess with t simulated CPU devices, and every figure is read
from the compiled fp32 train step (`mtjax.inspect.compile_train_step` + `compiled_report`).
Shape legend: b micro-batch, s sequence, h hidden, a heads, f MLP hidden, t tensor size,
q grid side, d depth, l layers.

Model: GPT, h 256, a 64 (head dim 4, so that 1d at t = 64 splits the heads), f 1024, s 64,
b 16, one micro-batch, V 257. Per layer = (l = 3) - (l = 2) (at l = 1 XLA unrolls the layer loop and merges collectives).
  * comm: bytes each device sends per layer per micro-batch on the tensor axes, ring
    traffic: (g - 1)/g of the full tensor for an all-gather / reduce-scatter, 2 (g - 1)/g for an
    all-reduce (g the group size), forward and backward;
  * params: the parameter bytes per device (fp32), from each leaf's block shape;
  * act: XLA's temp bytes per layer (`temp_size_in_bytes`, recompute none), and the saved set per
    layer (what autodiff keeps for the backward, traced: `activations.saved_bytes_per_layer`)
    against its formula (`activations.korthikanti_bytes` for 1d, `grid_activation_bytes` for a grid);
  * time: comm / bandwidth at NVLink (450 GB/s per direction, H100) and InfiniBand (50 GB/s).
Formula for comm per layer per micro-batch (4-byte elements, see docs/design.md):
  1d:     4 all-reduces of b s h:                    8 (t-1)/t b s h
  1d+SP:  6 all-gathers + 4 reduce-scatters of b s h: 10 (t-1)/t b s h
  2d/2.5d: per linear Y = X A ([r, s, K] x [K, N/q], r = b/(d q)): 2 gathers of X along COL
          (shared by Q/K/V), 2 of A along ROW, one reduce-scatter of dX and one of dA, each
          (q-1)/q of its full tensor.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

H, A, F, S, B, VOCAB = 256, 64, 1024, 64, 16, 257
BANDWIDTHS = {"NVLink": 450e9, "InfiniBand": 50e9}


def variants(t: int) -> list[tuple[str, list[str]]]:
    """(name, overrides) of the layouts that exist at t."""
    out = [("1d", []), ("1d+SP", ["parallel.sequence_parallel=true"])]
    q = int(round(t ** 0.5))
    if q * q == t:
        out.append((f"2d (q={q})", ["parallel.tensor_grid=2d"]))
    for d in (4, 2):   # the deepest 2.5d with q >= 2
        q = int(round((t // d) ** 0.5))
        if t % d == 0 and q >= 2 and q * q * d == t:
            out.append((f"2.5d (q={q}, d={d})", ["parallel.tensor_grid=2.5d", f"parallel.tensor_depth={d}"]))
            break
    return out


def measure(t: int, overrides: list[str], layers: int) -> dict:
    from mtjax.activations import saved_bytes_per_layer
    from mtjax.config import load_config
    from mtjax.hlo_report import compiled_report
    from mtjax.inspect import compile_train_step
    from mtjax.mesh import make_mesh
    from mtjax.parallel.grid import GRID_AXES
    from mtjax.training.trainer import Trainer
    import jax
    import numpy as np

    cfg = load_config(None, [
        "model.arch=gpt", f"model.num_layers={layers}", f"model.hidden_size={H}", f"model.num_heads={A}",
        f"model.ffn_hidden_size={F}", f"model.seq_len={S}", f"parallel.tensor={t}", "parallel.data=1",
        f"train.global_batch={B}", f"train.micro_batch={B}", *overrides])
    tr = Trainer(cfg, make_mesh(1, 1, t, jax.devices()[:t]), VOCAB)
    rep = compiled_report(compile_train_step(tr), tr.mesh)
    tensor_axes = {"tensor", *GRID_AXES}
    sent = 0.0
    for op in rep["collectives"]["ops"]:
        if not op["axes"] or not set(op["axes"]) <= tensor_axes or op["group_size"] < 2:
            continue
        g = op["group_size"]
        share = 2 * (g - 1) / g if op["kind"] == "all-reduce" else (g - 1) / g
        sent += share * op["bytes"] * op["multiplicity"]
    shapes = jax.eval_shape(tr.init_state).params
    specs = jax.tree.leaves(tr.specs.params, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    params = 0
    for shape, spec in zip(jax.tree.leaves(shapes), specs):
        n = int(np.prod(shape.shape))
        for axis in spec:
            for name in (axis if isinstance(axis, tuple) else (axis,)):
                n //= tr.mesh.shape[name] if name else 1
        params += 4 * n
    return {"sent": sent, "params": params, "temp": rep["memory"]["temp_bytes"],
            "saved": saved_bytes_per_layer(tr)["total"]}


def summa_vs_gather(q: int, rows: int = 4096, k: int = 2048, n: int = 2048) -> list[dict]:
    """The forward Y = X A (X [rows, k], A [k, n], fp32) on a q x q grid, gathered once
    (`grid_ops.linear_forward`) and by SUMMA's q broadcast steps (`grid_ops.summa_forward`):
    collective count and bytes per device (the report's full-tensor bytes for all-gathers, the
    operand for each ppermute a device sends) and XLA's temp bytes, from the compiled programs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from mtjax.hlo_report import compiled_report
    from mtjax.parallel import grid_ops
    from mtjax.parallel.grid import COL, ROW

    mesh = Mesh(np.array(jax.devices()[: q * q]).reshape(q, q), (ROW, COL))
    out = []
    for name, fn in (("gather once", grid_ops.linear_forward), ("SUMMA", lambda x, a: grid_ops.summa_forward(x, a, q))):
        step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(ROW, COL), P(ROW, COL)), out_specs=P(ROW, COL),
                                     check_vma=False))
        compiled = step.lower(jax.ShapeDtypeStruct((rows, k), jnp.float32),
                              jax.ShapeDtypeStruct((k, n), jnp.float32)).compile()
        rep = compiled_report(compiled, mesh)
        ops = rep["collectives"]["ops"]
        count = sum(op["multiplicity"] for op in ops)
        sent = 0.0
        for op in ops:
            g = op["group_size"]
            if op["kind"] == "all-gather":
                sent += (g - 1) / g * op["bytes"] * op["multiplicity"]
            else:   # a broadcast's ppermute: one device of the q sends the block
                sent += op["bytes"] * op["multiplicity"] / q
        out.append({"q": q, "form": name, "collectives": count, "sent": sent, "temp": rep["memory"]["temp_bytes"]})
    return out


def worker(t: int) -> None:
    from mtjax.mesh import simulate_cpu_devices
    simulate_cpu_devices(t)
    rows = []
    for name, overrides in variants(t):
        one, two = measure(t, overrides, 2), measure(t, overrides, 3)
        rows.append({"t": t, "layout": name, "comm_per_layer": two["sent"] - one["sent"],
                     "params_per_device": two["params"], "act_per_layer": two["temp"] - one["temp"],
                     "saved_per_layer": two["saved"]})
        print(json.dumps(rows[-1]), flush=True)
    q = int(round(t ** 0.5))
    if q * q == t:
        for row in summa_vs_gather(q):
            print(json.dumps(row), flush=True)


def formula(t: int, layout: str) -> float:
    """Bytes each device sends per layer (one micro-batch, so the once-per-step sums count too)."""
    bsh = B * S * H
    if layout == "1d":
        return 4 * 8 * (t - 1) / t * bsh
    if layout == "1d+SP":   # + the 6h per-layer vectors' gradients, partial under SP, all-reduced
        return 4 * (10 * (t - 1) / t * bsh + 2 * (t - 1) / t * 6 * H)
    q, d = (int(x) for x in re.findall(r"[qd]=(\d+)", layout + ", d=1")[:2])
    r, ring = B // (d * q), (q - 1) / q
    x_gathers = 2 * r * S * (3 * H + F)                         # QKV, O (a d_h = h), fc1, fc2 inputs
    dx = r * S * (5 * H + F)                                    # q, k, v, o, fc1 | fc2
    weights = 3 * (4 * H * H + 2 * H * F) // q                  # gathered twice, reduce-scattered once
    norms = 8 * r * S * 2                                       # LayerNorm statistics, all-reduces
    vectors = (4 * H + 3 * H + H + F + H) // q * 2              # norms, biases: along ROW once per step
    depth = (4 * H * H + 2 * H * F) // (q * q) + vectors // 2   # every weight along DEPTH once per step
    return 4 * (ring * (x_gathers + dx + weights + norms + vectors) + 2 * (d - 1) / d * depth)


def param_formula(t: int, layout: str, layers: int = 3) -> float:
    """fp32 parameter bytes per device (the l = 3 program): 1d splits the kernels, the split biases and
    the table t ways and replicates the rest; a grid splits kernels and the table q^2 ways (replicated
    along depth) and every vector q ways."""
    from mtjax.parallel.vocab import padded_vocab_size
    kernels, split_vectors = 4 * H * H + 2 * H * F, 3 * H + F          # QKV biases, fc1 bias
    vectors = H + H + 4 * H                                            # o and fc2 biases, two LayerNorms
    if layout.startswith("1d"):
        v = padded_vocab_size(VOCAB, 128, t)
        per_layer = (kernels + split_vectors) / t + vectors
        return 4 * (layers * per_layer + v * H / t + S * H + 2 * H)
    q = int(re.findall(r"q=(\d+)", layout)[0])
    v = padded_vocab_size(VOCAB, 128, q)
    per_layer = kernels / q ** 2 + (split_vectors + vectors) / q
    return 4 * (layers * per_layer + v * H / q ** 2 + S * H / q + 2 * H / q)


def act_formula(t: int, layout: str) -> float:
    """Bytes of activations one layer keeps per device (fp32, no dropout, recompute none)."""
    from mtjax.activations import grid_activation_bytes, korthikanti_bytes
    if layout.startswith("1d"):
        return korthikanti_bytes(S, B, H, A, t, layout == "1d+SP", "none", 4, dropout=False)
    q, d = (int(x) for x in re.findall(r"[qd]=(\d+)", layout + ", d=1")[:2])
    return grid_activation_bytes(S, B, H, A, q, d, "none", 4, dropout=False)


def table(rows: list[dict]) -> str:
    mib = 2 ** 20
    head = ("| t | layout | comm / layer / micro-batch per device, MiB (formula) | params / device, MiB (formula) | "
            "activation temp / layer (MiB) | saved set / layer, MiB (formula) | NVLink (us) | InfiniBand (us) |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        times = [r["comm_per_layer"] / bw * 1e6 for bw in BANDWIDTHS.values()]
        lines.append(f"| {r['t']} | {r['layout']} | {r['comm_per_layer'] / mib:.3f} "
                     f"({formula(r['t'], r['layout']) / mib:.3f}) | {r['params_per_device'] / mib:.3f} "
                     f"({param_formula(r['t'], r['layout']) / mib:.3f}) | "
                     f"{r['act_per_layer'] / mib:.3f} | {r['saved_per_layer'] / mib:.3f} "
                     f"({act_formula(r['t'], r['layout']) / mib:.3f}) | {times[0]:.1f} | {times[1]:.1f} |")
    return "\n".join(lines)


def summa_table(rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| q | form | collectives | sent per device (MiB) | XLA temp (MiB) |", "|---|---|---|---|---|"]
    lines += [f"| {r['q']} | {r['form']} | {r['collectives']} | {r['sent'] / mib:.2f} | {r['temp'] / mib:.2f} |"
              for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4,16,64")
    ap.add_argument("--worker", type=int)
    ap.add_argument("--json")
    ap.add_argument("--rows", nargs="*", help="worker outputs (JSON lines) to tabulate instead of running")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    rows = []
    for path in args.rows or ():
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.startswith("{")]
    for t in () if args.rows else (int(x) for x in args.sizes.split(",")):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        out = subprocess.run([sys.executable, __file__, "--worker", str(t)], env=env, capture_output=True,
                             text=True, check=True)
        rows += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    print(table([r for r in rows if "layout" in r]))
    print()
    print(summa_table([r for r in rows if "form" in r]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Context parallelism on 8 H100s, predicted: a Llama-shaped model at long sequences, compiled
for the GPUs from this machine (`python -m mtjax.inspect --target h100 --gpus 8`, one process per
case, run one after another) and timed by the H100 model (`mtjax/hlo_report/gpu_model.py`).

    python scripts/bench_context.py [--cases NAME,...] [--json FILE] [--rows FILE ...]

The model: 16 layers, h 2048, 32 heads, 8 KV heads, f 5632 (SwiGLU), V 32000, bf16, one row per
micro-batch and step (b = 1, global batch 1), selective recomputation unless the case says full.
MFU = Megatron's model FLOPs (`mtjax/training/flops.py`: attention as the full s x s product,
not the causal half) / predicted step time / 989 TFLOP/s. Needs JAX's CUDA plugin
(docs/guide/inspect.md, "Compile-only GPU targets").
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODEL = ["model.arch=llama", "model.num_layers=16", "model.hidden_size=2048", "model.num_heads=32",
         "model.num_kv_heads=8", "model.ffn_hidden_size=5632", "model.vocab_size=32000",
         "train.global_batch=1", "train.micro_batch=1", "train.precision=bf16", "parallel.data=1"]


def context(c: int, kind: str, t: int = 1) -> list:
    return [f"parallel.context={c}", f"parallel.context_attention={kind}", f"parallel.tensor={t}",
            f"parallel.sequence_parallel={'true' if t > 1 else 'false'}"]


CASES = {   # name -> (s, overrides)
    **{f"s{s // 1024}k c8 {kind}": (s, context(8, kind))
       for s in (16384, 32768, 65536) for kind in ("all_gather", "ring")},
    **{f"s64k c4 t2 sp {kind}": (65536, context(4, kind, 2)) for kind in ("all_gather", "ring")},
    **{f"s{s // 1024}k t8 sp": (s, ["parallel.tensor=8", "parallel.sequence_parallel=true"]) for s in (32768, 65536)},
}


def run_case(name: str, recompute: str = "selective") -> dict:
    """One case compiled and predicted: its row of the table (or the error)."""
    s, overrides = CASES[name]
    cmd = [sys.executable, "-m", "mtjax.inspect", "--json", "--config", "configs/base.yaml", "--target", "h100",
           "--gpus", "8", *MODEL, f"model.seq_len={s}", f"train.recompute={recompute}", *overrides]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    wall = time.time() - start
    if proc.returncode != 0:
        return {"case": name, "recompute": recompute, "error": proc.stderr.strip().splitlines()[-1:], "wall_s": wall}
    rep = json.loads(proc.stdout)
    gpu, ctx = rep["gpu"], rep["collectives"]["by_axes"]
    return {"case": name, "s": s, "recompute": recompute, "wall_s": round(wall, 1),
            "step_ms": gpu["predicted_step_s"] * 1e3, "mfu": gpu["predicted_mfu"],
            "tokens_per_s": gpu["tokens_per_s"], "collective_ms": gpu["collective_s"] * 1e3,
            "exposed_ms": gpu["exposed_collective_s"] * 1e3,
            "peak_gib": rep["memory"]["peak_estimate_bytes"] / 2 ** 30,
            "upper_bound": gpu["conditionals_upper_bound"],
            "by_kind_ms": {kind: round(row["time_s"] * 1e3, 2) for kind, row in gpu["by_kind"].items()},
            "context_collectives": {k: v for k, v in ctx.items() if "context" in k}}


def table(rows: list) -> str:
    out = ["| case | recompute | step ms | MFU | tokens/s | collective ms | exposed ms (% of step) | peak GiB |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | {r['recompute']} | error: {' '.join(r['error'])} | | | | | |")
            continue
        out.append(f"| {r['case']} | {r['recompute']} | {r['step_ms']:.1f} | {100 * r['mfu']:.1f}% | "
                   f"{r['tokens_per_s']:,.0f} | {r['collective_ms']:.2f} | {r['exposed_ms']:.2f} "
                   f"({100 * r['exposed_ms'] / r['step_ms']:.1f}%) | {r['peak_gib']:.1f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--recompute", default="selective", choices=["selective", "full", "none"])
    parser.add_argument("--json", default=None, help="append each row to this JSON-lines file")
    parser.add_argument("--rows", nargs="*", default=None, help="print the table of these JSON-lines files")
    args = parser.parse_args()
    if args.rows is not None:
        rows = [json.loads(line) for f in args.rows for line in open(f, encoding="utf-8") if line.strip()]
        print(table(rows))
        return
    rows = []
    for name in args.cases.split(","):
        rows.append(run_case(name, args.recompute))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()

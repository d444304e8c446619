"""`python scripts/bench_gpu_compile.py [--quick] [--json OUT]`

The pipelined train step as XLA:GPU compiles it for H100s, on a machine without GPUs
(`mtjax.compile_only`: deviceless compilation; needs JAX's CUDA plugin). Nothing runs:
these are the compiler's own buffer assignment and program, the ones a GPU would execute.

For a bf16 GPT (l = 8, h = 1024, a = 16, s = 1024, V = 32000, b = 2, no dropout, einsum
attention) on (data 1, pipe p, tensor 1), for 1F1B and interleaved 1F1B (v = 2), p in {2, 4},
m in {4p, 16p}, train.recompute=none with and without train.offload_activations:
  - device temporaries (`temp_size_in_bytes`) and their ratio m = 16p over m = 4p (the
    issue's bound: at most 1.15);
  - pinned-host temporaries (`host_temp_size_in_bytes`): the stash ring when offloading;
  - bytes of the copies XLA inserted, per step (`hlo_report.copy_report`): those that run
    every time, and those in conditional branches counted as if every tick took them (an
    upper bound; here the zeros of the ticks without a forward). Before the executor wrote
    its carry outside the branches, XLA:GPU copied the stash and the gradient sums whole
    every tick (`pipeline.stash.Stash`);
  - host compute: instructions XLA's host offloader had to run on the host (must be 0).
--quick: 1F1B at p = 2 only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtjax import compile_only  # noqa: E402

compile_only.prepare_environment()

from mtjax.config import load_config  # noqa: E402
from mtjax.hlo_report import copy_report  # noqa: E402
from mtjax.inspect import compile_train_step  # noqa: E402
from mtjax.mesh import make_mesh  # noqa: E402
from mtjax.training.trainer import Trainer  # noqa: E402

MODEL = ["model.arch=gpt", "model.num_layers=8", "model.hidden_size=1024", "model.num_heads=16",
         "model.seq_len=1024", "model.dropout=0.0", "model.attention_dropout=0.0", "model.attention=xla",
         "train.precision=bf16", "train.micro_batch=2", "train.recompute=none"]
VOCAB = 32000
MIB = 2 ** 20


def compile_case(p: int, m: int, schedule: str, v: int, offload: bool) -> dict:
    overrides = MODEL + [f"parallel.pipe={p}", f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}",
                         f"train.global_batch={2 * m}", f"train.offload_activations={str(offload).lower()}"]
    trainer = Trainer(load_config(None, overrides), make_mesh(1, p, 1, compile_only.gpu_devices(p)), VOCAB)
    compiled = compile_train_step(trainer)
    mem, text = compiled.memory_analysis(), compiled.as_text()
    copies = copy_report(text)
    return {"p": p, "m": m, "schedule": schedule, "v": v, "offload": offload,
            "temp_MiB": mem.temp_size_in_bytes / MIB, "host_temp_MiB": mem.host_temp_size_in_bytes / MIB,
            "copy_MiB_per_step": copies["bytes_per_step"] / MIB,
            "conditional_copy_MiB_per_step": copies["conditional_bytes_per_step"] / MIB,
            "largest_copies": [(round(b / MIB, 1), n, name, branch) for b, n, name, branch in copies["largest"][:3]],
            "host_compute": text.count('_xla_compute_type="host"')}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    why = compile_only.why_unavailable()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    setups = [("1f1b", 1, 2)] if args.quick else [("1f1b", 1, 2), ("1f1b", 1, 4), ("interleaved", 2, 2),
                                                   ("interleaved", 2, 4)]
    rows = []
    print(f"{'schedule':>11} {'v':>2} {'p':>2} {'m':>3} {'offload':>7} {'temp MiB':>9} {'x(4p)':>6} "
          f"{'host MiB':>9} {'copies MiB/step':>15} {'in branches':>11} {'host ops':>8}")
    for schedule, v, p in setups:
        for offload in (False, True):
            first = None
            for m in (4 * p, 16 * p):
                r = compile_case(p, m, schedule, v, offload)
                first = first or r["temp_MiB"]
                r["temp_over_m4p"] = r["temp_MiB"] / first
                rows.append(r)
                print(f"{schedule:>11} {v:>2} {p:>2} {m:>3} {str(offload):>7} {r['temp_MiB']:9.1f} "
                      f"{r['temp_over_m4p']:6.3f} {r['host_temp_MiB']:9.1f} {r['copy_MiB_per_step']:15.1f} "
                      f"{r['conditional_copy_MiB_per_step']:11.1f} {r['host_compute']:8d}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python scripts/tp_overlap_table.py [--cases NAME,...]`: docs/benchmarks.md's
"Tensor-parallel overlap" table, predicted for 8 H100s (compile-only; needs JAX's CUDA plugin on
PYTHONPATH, as `mtjax.inspect --target h100`).

Each case is compiled plainly, with `parallel.tensor_overlap` and with `parallel.half_batch_overlap`
(halving the batch where its micro-batch is even, and the sequence) and read by the H100 model
(`hlo_report.gpu_report`): the step, MFU, exposed and total collective time, and per layer and
micro-batch (the layer scans' bodies, forward plus backward) the kernel time and the collective
time no kernel hides.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BF16_SP = ["parallel.sequence_parallel=true", "train.precision=bf16"]
L13B = ["model.arch=llama", "model.num_layers=40", "model.hidden_size=5120", "model.num_heads=40",
        "model.ffn_hidden_size=13824", "model.seq_len=4096", "train.global_batch=8", "train.micro_batch=1"]
CASES = {
    "13b-t8": ["parallel.tensor=8", *L13B],
    "13b-t8-b2": ["parallel.tensor=8", *L13B, "train.micro_batch=2"],
    "gpt1.3b-t8": ["parallel.tensor=8"],
    "gpt1.3b-222": ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "train.micro_batch=2"],
}


VARIANTS = {"": [], "tensor_overlap": ["parallel.tensor_overlap=true"],
            "half_batch_overlap, half_batch_group=1": ["parallel.half_batch_overlap=true", "parallel.half_batch_group=1"],
            "half_batch_overlap": ["parallel.half_batch_overlap=true"],     # 4 layers a unit (the default)
            "half_batch_overlap, half_batch_axis=sequence": ["parallel.half_batch_overlap=true",
                                                             "parallel.half_batch_axis=sequence"]}


def predict(overrides: list[str]) -> dict:
    """`mtjax.inspect --target h100`'s reading of the train step compiled for 8 H100s with `overrides`."""
    from mtjax.inspect import report
    from mtjax.inspect_target import target_setup
    from mtjax.training.data_setup import resolve_vocab, tokenizer_vocab
    from mtjax.training.trainer import Trainer
    ns = argparse.Namespace(cpu_devices=None, config="configs/gpt1.3b.yaml", overrides=overrides, gpus=8,
                            target="h100")
    cfg, mesh = target_setup(ns)
    g = report(Trainer(cfg, mesh, resolve_vocab(cfg, tokenizer_vocab(cfg))), "h100")["gpu"]
    return {"step_ms": g["predicted_step_s"] * 1e3, "mfu": g["predicted_mfu"],
            "exposed_ms": g["exposed_collective_s"] * 1e3, "collective_ms": g["collective_s"] * 1e3,
            "layer_kernels_us": g["per_layer"]["time_s"] * 1e6,
            "layer_exposed_us": g["per_layer"]["exposed_collective_s"] * 1e6}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args(argv)
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(CASES)})")
    from mtjax.compile_only import prepare_environment
    prepare_environment()       # before JAX starts: the CUDA plugin without a GPU, JAX on the CPU
    print("| case | step ms | MFU | exposed collective ms (share) | collective ms | per layer: kernels / exposed µs |")
    print("|---|---:|---:|---:|---:|---:|")
    from mtjax.config import ConfigError
    for name in args.cases.split(","):
        for variant, flags in VARIANTS.items():
            try:
                r = predict([*CASES[name], *BF16_SP, *flags])
            except ConfigError:         # half_batch_overlap at an odd micro-batch
                continue
            label = name + (f", `{variant}`" if variant else "")
            per_layer = (f"{r['layer_kernels_us']:.0f} / {r['layer_exposed_us']:.0f}" if r["layer_kernels_us"]
                         else "(no layer loop)")
            print(f"| {label} | {r['step_ms']:.2f} | {r['mfu']:.1%} | {r['exposed_ms']:.2f} "
                  f"({r['exposed_ms'] / r['step_ms']:.1%}) | {r['collective_ms']:.2f} | {per_layer} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

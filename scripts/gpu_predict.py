"""`python scripts/gpu_predict.py CONFIG [K=V ...] [--json OUT]`

The performance model's prediction for a step compiled on the GPU that is here (run it on a GPU
machine beside `scripts/bench_train.py`, which measures the same step): the step is compiled by
XLA:GPU for `jax.devices()[0]` and read by `hlo_report.gpu_report` with the H100 constants, and
with the H100 constants but an H200's sustained HBM bandwidth (4.3 TB/s, a device-to-device copy
measured on this workplace's H200s: .library/device/KINDS.md) when the card is an H200.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402

from mtjax.config import load_config, validate  # noqa: E402
from mtjax.hlo_report.gpu_report import gpu_report  # noqa: E402
from mtjax.hlo_report.hardware import H100  # noqa: E402
from mtjax.inspect import compile_train_step  # noqa: E402
from mtjax.mesh import make_mesh  # noqa: E402
from mtjax.training.data_setup import resolve_vocab, tokenizer_vocab  # noqa: E402
from mtjax.training.flops import flops_per_step  # noqa: E402
from mtjax.training.trainer import Trainer  # noqa: E402

H200_BANDWIDTH = dataclasses.replace(H100, name="h100 model, h200 bandwidth", memory_bandwidth=4.3e12)


def main(argv: list[str]) -> int:
    out_path = None
    if "--json" in argv:
        i = argv.index("--json")
        out_path, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    config, overrides = argv[0], argv[1:]
    cfg = load_config(config, overrides)
    validate(cfg, 1)
    trainer = Trainer(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), resolve_vocab(cfg, tokenizer_vocab(cfg)))
    plan = trainer.plan
    text = compile_train_step(trainer).as_text()
    model_flops = flops_per_step(cfg.model, plan.padded_vocab, plan.global_batch)
    specs = [H100] + ([H200_BANDWIDTH] if "H200" in jax.devices()[0].device_kind else [])
    rows = []
    for spec in specs:
        g = gpu_report(text, model_flops, spec, 1, plan.layers_per_chunk)
        rows.append({"model": spec.name, "predicted_step_s": g["predicted_step_s"],
                     "predicted_mfu": g.get("predicted_mfu"), "bound": g.get("bound")})
        print(f"{config} {' '.join(overrides)} | {spec.name}: predicted step {g['predicted_step_s'] * 1e3:.1f} ms, "
              f"MFU {g.get('predicted_mfu')}", flush=True)
    if out_path:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "config": config,
                       "overrides": overrides, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

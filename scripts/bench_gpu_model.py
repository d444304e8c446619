"""`python scripts/bench_gpu_model.py [--before CHECKOUT] [--quick] [--json OUT]`

The H100 performance model (`mtjax.hlo_report.gpu_report`) at work, on this machine without a
GPU (`mtjax.compile_only`; needs JAX's CUDA plugin, docs/guide/inspect.md, "Compile-only GPU targets"):

  1. calibration: the steps measured on an H100 (tests/fixtures/h100, commit 4dcf60d), predicted
     beside their measured times;
  2. this tree's train steps compiled for one H100: predicted step time, MFU, tokens/s, and
     where the time goes (matmul-, memory-, ALU-bound kernels, launches); with `--before`, the
     same cases compiled from another checkout (e.g. `git worktree add /tmp/before <commit>`)
     and predicted by this tree's model, so that a fix is recorded by its before and after;
  3. the plain-JAX GPT of scripts/bench_train.py compiled the same way, beside mtjax;
  4. eight compile-only H100s, tensor = 8 and (data 2, pipe 2, tensor 2): the collective time
     and what no kernel hides.
--quick: the calibration and the gpt100m cases only.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
from mtjax import compile_only  # noqa: E402

compile_only.prepare_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_train  # noqa: E402
from make_gpu_fixtures import compile_case  # noqa: E402
from mtjax.config import load_config, validate  # noqa: E402
from mtjax.hlo_report import memory_report  # noqa: E402
from mtjax.hlo_report.gpu_report import gpu_report  # noqa: E402
from mtjax.inspect import report  # noqa: E402
from mtjax.mesh import make_mesh  # noqa: E402
from mtjax.training.flops import flops_per_step  # noqa: E402
from mtjax.training.trainer import Trainer  # noqa: E402

VOCAB = 257
BF16 = ["train.precision=bf16"]
# name -> (config, overrides, with the plain baseline)
CASES = {
    "gpt100m B16 b8, xla attention": ("gpt100m", BF16 + ["train.global_batch=16", "train.micro_batch=8",
                                                        "model.attention=xla"], True),
    "gpt100m B16 b8": ("gpt100m", BF16 + ["train.global_batch=16", "train.micro_batch=8"], False),
    "gpt100m B16 b8, selective": ("gpt100m", BF16 + ["train.global_batch=16", "train.micro_batch=8",
                                                     "train.recompute=selective"], False),
    "gpt100m B16 b8, dropout 0.1": ("gpt100m", BF16 + ["train.global_batch=16", "train.micro_batch=8",
                                                       "model.dropout=0.1"], False),
    "gpt100m B64 b64": ("gpt100m", BF16 + ["train.global_batch=64", "train.micro_batch=64"], True),
    "gpt1.3b b8 (config)": ("gpt1.3b", ["train.micro_batch=8"], False),
    "gpt1.3b b8, selective": ("gpt1.3b", ["train.micro_batch=8", "train.recompute=selective"], False),
    "gpt1.3b b2": ("gpt1.3b", ["train.micro_batch=2"], False),
    "gpt1.3b b2, xla attention": ("gpt1.3b", ["train.micro_batch=2", "model.attention=xla"], True),
}
MULTI = {   # eight H100s of one node
    "gpt1.3b data 8": ["parallel.data=8", "train.global_batch=64"],
    "gpt1.3b data 8, distributed optimizer": ["parallel.data=8", "train.global_batch=64",
                                              "parallel.distributed_optimizer=true"],
    "gpt1.3b tensor 8": ["parallel.data=1", "parallel.tensor=8"],
    "gpt1.3b data 2 pipe 2 tensor 2": ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
                                       "train.micro_batch=2"],
}


def summary(report: dict, tokens: int, peak_bytes: int | None = None) -> dict:
    return {"peak_GiB": None if peak_bytes is None else peak_bytes / 2 ** 30, "step_ms": report["predicted_step_s"] * 1e3, "mfu": report["predicted_mfu"],
            "tokens_per_s": tokens / report["predicted_step_s"], "kernels": report["kernels_per_step"],
            "launch_ms": report["launch_s"] * 1e3,
            **{f"{k}_ms": v * 1e3 for k, v in report["bound"].items() if k != "pcie"},
            "collective_ms": report["collective_s"] * 1e3, "exposed_ms": report["exposed_collective_s"] * 1e3,
            "upper_bound": report["conditionals_upper_bound"]}


def this_tree(config: str, overrides: list[str], gpus: int = 1) -> tuple[dict, object]:
    """The case compiled from this tree for `gpus` H100s: `mtjax.inspect`'s report with its gpu section."""
    cfg = load_config(os.path.join(ROOT, "configs", f"{config}.yaml"), overrides)
    d, p, t = validate(cfg, gpus)
    trainer = Trainer(cfg, make_mesh(d, p, t, devices=compile_only.gpu_devices(gpus)), VOCAB)
    r = report(trainer, "h100")
    gpu = r["gpu"]
    return (summary(gpu, cfg.train.global_batch * cfg.model.seq_len, r["memory"]["peak_estimate_bytes"])
            | {"layer_kernels": gpu["per_layer"]["kernels"]}), trainer


def _peak(compiled) -> int:
    """XLA's estimate of the peak bytes per device: arguments + outputs + temporaries - aliased."""
    return memory_report(compiled)["peak_estimate_bytes"]


def other_tree(tree: str, config: str, overrides: list[str]) -> dict:
    """The case compiled from another checkout (a child process), predicted by this tree's model."""
    with tempfile.TemporaryDirectory() as tmp:
        meta = compile_case(tree, tmp, "case", config, overrides)
        with gzip.open(os.path.join(tmp, "case.hlo.gz"), "rt") as f:
            return summary(gpu_report(f.read(), meta["model_flops_per_step"]), meta["tokens_per_step"])


def plain(trainer) -> dict:
    """The plain-JAX GPT of scripts/bench_train.py for the trainer's config, compiled for one H100."""
    cfg = trainer.cfg
    g = bench_train.plain_spec(cfg, VOCAB)
    tx = bench_train.plain_optimizer(cfg)
    device = trainer.mesh.devices.flat[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def abstract(tree):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)
    params = jax.eval_shape(lambda: bench_train.plain_init(g, jax.random.key(0)))
    state = abstract(jax.eval_shape(lambda p: bench_train.PlainState(p, tx.init(p), jnp.int32(0)), params))
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, g.s + 1), jnp.int32, sharding=sharding)
    compiled = bench_train.plain_train_step(cfg, g, tx).lower(state, batch).compile()
    flops = flops_per_step(cfg.model, trainer.padded_vocab, cfg.train.global_batch)
    return summary(gpu_report(compiled.as_text(), flops), cfg.train.global_batch * cfg.model.seq_len, _peak(compiled))


def calibration() -> list[dict]:
    fixtures = os.path.join(ROOT, "tests", "fixtures", "h100")
    with open(os.path.join(fixtures, "cases.json")) as f:
        cases = json.load(f)
    rows = []
    for name, case in cases.items():
        with gzip.open(os.path.join(fixtures, f"{name}.hlo.gz"), "rt") as f:
            report = gpu_report(f.read(), case["model_flops_per_step"])
        rows.append({"case": name, "measured_ms": case["measured_step_s"] * 1e3,
                     "predicted_ms": report["predicted_step_s"] * 1e3,
                     "ratio": report["predicted_step_s"] / case["measured_step_s"],
                     "measured_mfu": case["model_flops_per_step"] / case["measured_step_s"] / 989e12,
                     "predicted_mfu": report["predicted_mfu"]})
    return rows


def tables(out: dict) -> str:
    lines = ["| case (commit 4dcf60d) | measured ms | predicted ms | predicted / measured | measured MFU | predicted MFU |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in out["calibration"]:
        lines.append(f"| {r['case']} | {r['measured_ms']:.2f} | {r['predicted_ms']:.2f} | {r['ratio']:.3f} | "
                     f"{r['measured_mfu']:.1%} | {r['predicted_mfu']:.1%} |")
    lines += ["", "| case (this tree, 1 H100) | step ms | MFU | tokens/s | peak GiB | kernels (per layer) | launch ms | "
              "matmul-bound ms | memory-bound ms | ALU-bound ms | before: MFU | plain-JAX MFU (peak GiB) | mtjax / plain |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in out["cases"].items():
        before, base = out["before"].get(name), out["plain"].get(name)
        before_mfu = f"{before['mfu']:.1%}" if before else "–"
        plain_mfu, ratio = ((f"{base['mfu']:.1%} ({base['peak_GiB']:.0f})", f"{base['step_ms'] / r['step_ms']:.2f}")
                            if base else ("–", "–"))
        lines.append(f"| {name} | {r['step_ms']:.1f} | {r['mfu']:.1%} | {r['tokens_per_s']:,.0f} | {r['peak_GiB']:.1f} | "
                     f"{r['kernels']} ({r['layer_kernels']}) | {r['launch_ms']:.1f} | {r['flops_ms']:.1f} | "
                     f"{r['memory_ms']:.1f} | {r['alu_ms']:.1f} | {before_mfu} | {plain_mfu} | {ratio} |")
    if out["multi"]:
        lines += ["", "| case (8 H100s) | step ms | MFU | collective ms | exposed ms | unscoped branches as taken |",
                  "|---|---:|---:|---:|---:|:--|"]
        for name, r in out["multi"].items():
            lines.append(f"| {name} | {r['step_ms']:.1f} | {r['mfu']:.1%} | {r['collective_ms']:.2f} | "
                         f"{r['exposed_ms']:.2f} | {'yes (upper bound)' if r['upper_bound'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", metavar="CHECKOUT", help="also compile the single-GPU cases from this checkout")
    p.add_argument("--quick", action="store_true", help="calibration and the gpt100m cases only")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    missing = compile_only.why_unavailable()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    out = {"jax": jax.__version__, "calibration": calibration(), "cases": {}, "before": {}, "plain": {}, "multi": {}}
    for name, (config, overrides, baseline) in CASES.items():
        if args.quick and config != "gpt100m":
            continue
        print(name, flush=True)
        out["cases"][name], trainer = this_tree(config, overrides)
        if args.before:
            out["before"][name] = other_tree(args.before, config, overrides)
        if baseline:
            out["plain"][name] = plain(trainer)
    for name, overrides in ({} if args.quick else MULTI).items():
        print(name, flush=True)
        out["multi"][name], _ = this_tree("gpt1.3b", overrides, gpus=8)
    print(tables(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

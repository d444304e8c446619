"""`python scripts/make_gpu_fixtures.py --tree CHECKOUT [--out tests/fixtures/h100]`

The calibration fixtures of the H100 performance model (`mtjax.hlo_report.gpu_model`): the
train steps whose step times were measured on an H100 (docs/benchmarks.md, "GPU: H100",
commit 4dcf60d), compiled again by XLA:GPU for an H100 on this machine (`mtjax.compile_only`),
from a checkout of the measured commit (`git worktree add /tmp/wt4dcf 4dcf60d`). Each case's
optimized HLO text is written gzipped as `<name>.hlo.gz`, and `cases.json` records, per case,
the config and overrides, the measured step time and what the model needs besides the HLO
(Megatron's FLOPs per step). Needs JAX's CUDA plugin (docs/guide/inspect.md, "Compile-only GPU targets").

Each case compiles in its own process, with the checkout's `mtjax` first on the path: the
compile-only devices come from this tree's `compile_only.py`, loaded by file path, because the
measured commit predates it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "4dcf60d"
VOCAB = 257                    # the byte tokenizer, as scripts/bench_train.py uses it
BF16 = ["train.precision=bf16"]
# name -> (config, overrides, measured step s): the rows of docs/benchmarks.md "Training step, bf16"
CASES = {
    "tiny_b8": ("tiny", BF16 + ["train.global_batch=16", "train.micro_batch=8"], 0.0021),
    "gpt100m_B16_b8": ("gpt100m", BF16 + ["train.global_batch=16", "train.micro_batch=8"], 0.1264),
    "gpt100m_B8_b8": ("gpt100m", BF16 + ["train.global_batch=8", "train.micro_batch=8"], 0.0630),
    "gpt100m_B32_b16": ("gpt100m", BF16 + ["train.global_batch=32", "train.micro_batch=16"], 0.2407),
    "gpt100m_B16_b8_selective": ("gpt100m", BF16 + ["train.global_batch=16", "train.micro_batch=8",
                                                     "train.recompute=selective"], 0.1093),
    "gpt100m_B16_b8_full": ("gpt100m", BF16 + ["train.global_batch=16", "train.micro_batch=8",
                                                "train.recompute=full"], 0.1111),
}

# Runs in the child process (`python -c`): argv = tree, config path, output file, overrides...
CHILD = r"""
import importlib.util, json, sys
tree, config, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
spec = importlib.util.spec_from_file_location("compile_only", sys.argv[0])
compile_only = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compile_only)
compile_only.prepare_environment()
sys.path.insert(0, tree)
import jax, jax.numpy as jnp
from mtjax.config import load_config, validate
from mtjax.inspect import abstract_state
from mtjax.mesh import make_mesh
from mtjax.training.flops import flops_per_step
from mtjax.training.step import batch_sharding
from mtjax.training.trainer import Trainer
cfg = load_config(config, overrides)
validate(cfg, 1)
trainer = Trainer(cfg, make_mesh(1, 1, 1, devices=compile_only.gpu_devices(1)), vocab=%d)
batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                             sharding=batch_sharding(trainer.mesh))
compiled = trainer.train_step.lower(abstract_state(trainer), batch).compile()
with gzip.open(out, "wt") as f:
    f.write(compiled.as_text())
print(json.dumps({"model_flops_per_step": flops_per_step(cfg.model, trainer.padded_vocab, cfg.train.global_batch),
                  "tokens_per_step": cfg.train.global_batch * cfg.model.seq_len, "jax": jax.__version__}))
""" % VOCAB


def compile_case(tree: str, out_dir: str, name: str, config: str, overrides: list[str]) -> dict:
    """Compile one case in a child process; its metadata (the HLO goes to out_dir/name.hlo.gz)."""
    child = CHILD.replace("sys.argv[0]", repr(os.path.join(ROOT, "mtjax", "compile_only.py")))
    done = subprocess.run([sys.executable, "-c", child, tree, os.path.join(tree, "configs", f"{config}.yaml"),
                           os.path.join(out_dir, f"{name}.hlo.gz"), *overrides], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: compile failed\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", required=True, help=f"a checkout of commit {COMMIT} (git worktree add)")
    p.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "h100"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cases = {}
    for name, (config, overrides, measured) in CASES.items():
        meta = compile_case(args.tree, args.out, name, config, overrides)
        cases[name] = {"config": config, "overrides": overrides, "commit": COMMIT,
                       "measured_step_s": measured, **meta}
        print(name, meta, flush=True)
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

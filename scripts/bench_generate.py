"""`python scripts/bench_generate.py [--layouts 1,1,1:2,1,1:1,2,1:1,2,2:2,2,2] [--batch 8] [--prompt 64]
[--new 16] [--repeats 2] [--json OUT] [KEY=VALUE ...]`

Generation against the mesh (data, pipe, tensor), random weights, one batch of `--batch` prompts
of `--prompt` tokens and `--new` new tokens each (`InferenceModel.generate`, `decode.py`).
Shape legend: b rows, p pipe, n devices, N new tokens.

Per layout:
  - tokens/s: b N / (median wall time of generate). On CPUs this is no speed: the simulated
    devices of one process run one after another, so n devices cost n times one. It is printed
    to show the loop runs, and measured for real where the devices are real;
  - work, from the compiled program's HLO (`mtjax.hlo_report`), which does not depend on how
    the devices are simulated: the matmul FLOPs of one decode tick per device, averaged over the
    stages (the decode loop is a while loop of unknown trip count, so its body is counted once;
    the head runs on the last of p stages, so its branch counts 1/p), the FLOPs per generated
    token over all devices, n x tick x p / b (p ticks give every row one token), and the prefill's;
    the collectives of the program (the prefill's 2p - 1 ticks and one decode tick), per kind;
  - the H100 prediction of the performance model (`hlo_report.gpu_report`) for one decode tick
    on n compile-only H100s, and the tokens/s it implies, b / (p x tick), where JAX's CUDA plugin
    can compile for them (`mtjax.compile_only`); otherwise the line says why not.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtjax import compile_only  # noqa: E402
from mtjax.mesh import simulate_cpu_devices  # noqa: E402

GPU_MISSING = compile_only.why_unavailable()
if GPU_MISSING is None:
    compile_only.prepare_environment()
simulate_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from mtjax.config import load_config  # noqa: E402
from mtjax.hlo_report import collective_report, executed_dot_flops  # noqa: E402
from mtjax.inference.decode import Decoder  # noqa: E402
from mtjax.inference.model import InferenceModel, inference_config, padded_batch  # noqa: E402
from mtjax.layout import compute_params, resolve_layout  # noqa: E402
from mtjax.mesh import DATA, make_mesh  # noqa: E402

VOCAB = 257                      # the byte tokenizer's
MODEL = ["model.arch=llama", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=8",
         "model.num_kv_heads=2", "model.seq_len=512", "model.init_std=0.2"]
SCOPES = {"prefill": 1.0, "decode": 1.0}


def build(overrides: list[str], d: int, p: int, t: int, devices) -> InferenceModel:
    """A model of random weights (canonical draw, stored in the layout's order) on (d, p, t)."""
    saved = load_config(None, MODEL + overrides).to_dict()
    cfg, mesh = inference_config(saved, [], make_mesh(d, p, t, devices[:d * p * t]))
    layout = resolve_layout(cfg, mesh, VOCAB)
    draw = lambda k: nn.unbox(layout.global_model().init(k, jnp.zeros((1, 8), jnp.int32))["params"])  # noqa: E731
    params = jax.jit(lambda k: layout.run_order(draw(k)), out_shardings=layout.param_shardings)(jax.random.key(0))
    return InferenceModel(cfg, layout, jax.jit(lambda w: compute_params(layout, w))(params), 0)


def arguments(model: InferenceModel, batch: int, prompt: int, new: int):
    """The decoder's arguments for `batch` random prompts (as `generate` pads them)."""
    rows = np.random.RandomState(0).randint(0, 256, (batch, prompt)).tolist()
    split = model.layout.data * model.layout.pipe
    return (model.params, *padded_batch(rows, model.seq_len, split), np.int32(batch), np.int32(new),
            jax.random.key_data(jax.random.key(0)), np.float32(0), np.int32(VOCAB), np.float32(1), np.int32(-1))


def work(model: InferenceModel, args, batch: int) -> dict:
    """FLOPs per decode tick and per generated token, prefill FLOPs, collectives (module doc)."""
    text = model.decoder.generate.lower(*args).compile().as_text()
    n, p = model.mesh.devices.size, model.layout.pipe

    def phase(scope):   # the head and sampling run on 1 stage of p: a cond's branch, weighted 1/p
        return sum(o["flops"] * o["multiplicity"] * (1 / p if o["in_conditional"] else 1)
                   for o in executed_dot_flops(text, SCOPES)["ops"] if o["scope"] == scope)
    rows, tick = args[1].shape[0], phase("decode")
    return {"decode_tick_flops_per_device": tick, "flops_per_token": n * tick * p / rows,
            "prefill_flops_per_device": phase("prefill"), "padded_rows": rows,
            "collectives": {k: v["count"] for k, v in collective_report(text, model.mesh)["by_kind"].items()}}


def h100(overrides: list[str], d: int, p: int, t: int, batch: int, prompt: int, new: int) -> dict | str:
    """One decode tick on d p t compile-only H100s, as the performance model predicts it."""
    if GPU_MISSING is not None:
        return f"unavailable: {GPU_MISSING}"
    from mtjax.hlo_report.gpu_report import gpu_report
    devices = compile_only.gpu_devices(d * p * t)
    saved = load_config(None, MODEL + overrides + ["train.precision=bf16"]).to_dict()
    cfg, mesh = inference_config(saved, [], make_mesh(d, p, t, devices))
    layout = resolve_layout(cfg, mesh, VOCAB)
    decoder = Decoder(layout)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, layout.compute_dtype, sharding=sh),
                          layout.params.shapes, layout.param_shardings)
    prompts, lengths, rows = padded_batch([[1] * prompt] * batch, cfg.model.seq_len, d * p)
    split = NamedSharding(mesh, P(DATA))
    abstract = [jax.ShapeDtypeStruct(prompts.shape, jnp.int32, sharding=NamedSharding(mesh, P(DATA, None))),
                jax.ShapeDtypeStruct(lengths.shape, jnp.int32, sharding=split),
                jax.ShapeDtypeStruct(rows.shape, jnp.int32, sharding=split)]
    scalars = (np.int32(batch), np.int32(new), jax.random.key_data(jax.random.key(0)), np.float32(0),
               np.int32(VOCAB), np.float32(1), np.int32(-1))
    text = decoder.generate.lower(params, *abstract, *scalars).compile().as_text()
    report = gpu_report(text, 0.0, "h100", d * p * t, rank_scope_weights=[{"prefill": 0.0, "decode": 1.0}])
    tick = report["predicted_step_s"]
    return {"decode_tick_s": tick, "tokens_per_s": prompts.shape[0] / (p * tick)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="1,1,1:2,1,1:1,2,1:1,2,2:2,2,2", help="data,pipe,tensor meshes, ':'-separated")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("overrides", nargs="*", help="config overrides of the benchmark's model")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x {jax.device_count()}; "
          f"{' '.join(MODEL + args.overrides)}; b={args.batch} P={args.prompt} N={args.new}")
    rows = []
    for text in args.layouts.split(":"):
        d, p, t = (int(x) for x in text.split(","))
        model = build(args.overrides, d, p, t, jax.devices())
        call = arguments(model, args.batch, args.prompt, args.new)
        jax.block_until_ready(model.decoder.generate(*call))                    # compile
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(model.decoder.generate(*call))
            times.append(time.perf_counter() - t0)
        rows.append({"data": d, "pipe": p, "tensor": t,
                     "wall_tokens_per_s": args.batch * args.new / statistics.median(times),
                     **work(model, call, args.batch),
                     "h100": h100(args.overrides, d, p, t, args.batch, args.prompt, args.new)})
    print("\n| d,p,t | CPU wall tok/s (not speed) | decode tick FLOPs/device | FLOPs/token (all devices) | "
          "prefill FLOPs/device | collectives (prefill + 1 tick) | H100 predicted tok/s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        h = f"{r['h100']['tokens_per_s']:.0f}" if isinstance(r["h100"], dict) else "-"
        collectives = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items())) or "none"
        print(f"| {r['data']},{r['pipe']},{r['tensor']} | {r['wall_tokens_per_s']:.1f} | "
              f"{r['decode_tick_flops_per_device']:.3g} | {r['flops_per_token']:.3g} | "
              f"{r['prefill_flops_per_device']:.3g} | {collectives} | {h} |")
    if GPU_MISSING is not None:
        print(f"\nH100 prediction: {GPU_MISSING}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

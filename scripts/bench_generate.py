"""`python scripts/bench_generate.py [--prompts 16,128,384] [--new 16] [--repeats 3] [--json OUT] [KEY=VALUE ...]`

Generation with and without the KV cache on one device, and the cache's size.
Shape legend: l layers, S = model.seq_len (the cache's length), k kv heads, d head dim, P prompt length,
N new tokens.

1. Tokens/s of greedy generation of N tokens after a P-token prompt (random weights), at a few P:
   - cache:    `InferenceModel.generate`: one prefill pass over the prompt (padded to a power of
               two), then one single-position pass per token reading the cache (one jitted loop);
   - no cache: each token the argmax of the trainer's `logits_fn` over the whole prefix at its exact
               length (every length compiled in a warm-up pass first, so compile time is left out).
   Both include the prompt's forward; "decode-only" is the cache's per-token rate after the prefill,
   (N - 1) / (time for N tokens - time for 1 token). Median of --repeats, the two taking turns.
2. The cache's bytes per sequence, measured from the arrays `Decoder.empty_cache` allocates (the
   ones the loop fills), against 2 l S k d (bytes per element) for fp32 and bf16, and per tensor rank
   at t = 1, 2, 4 (rank 0's shard; with k < t each rank holds the one kv head it uses).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from mtjax.mesh import simulate_cpu_devices

simulate_cpu_devices(4)          # only for the per-rank cache shapes; everything timed runs on device 0

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtjax.config import load_config  # noqa: E402
from mtjax.inference.decode import Decoder  # noqa: E402
from mtjax.inference.model import InferenceModel, inference_config  # noqa: E402
from mtjax.mesh import make_mesh  # noqa: E402
from mtjax.training.step import local_model  # noqa: E402
from mtjax.training.trainer import Trainer  # noqa: E402

VOCAB = 257                      # the byte tokenizer's
MODEL = ["model.arch=llama", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=8",
         "model.num_kv_heads=2", "model.seq_len=512", "model.init_std=0.2"]


def build(overrides: list[str], tensor: int = 1) -> Trainer:
    saved = load_config(None, MODEL + overrides).to_dict()
    mesh = make_mesh(1, 1, tensor, jax.devices()[:tensor])
    return Trainer(inference_config(saved, [], mesh), mesh, VOCAB)


def greedy_without_cache(model: InferenceModel, prompt: list[int], new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(np.argmax(model.logits(np.array([seq], np.int32))[0, -1])))
    return seq[len(prompt):]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def speed(model: InferenceModel, prompts: list[int], new: int, repeats: int) -> list[dict]:
    rows, rng = [], np.random.RandomState(0)
    for p in prompts:
        prompt = rng.randint(0, 256, p).tolist()
        model.generate(prompt, new), model.generate(prompt, 1)            # compile (one loop per prefill width)
        greedy_without_cache(model, prompt, new)                           # compile every prefix length
        cached, first, plain = [], [], []
        for _ in range(repeats):
            t, with_cache = timed(lambda: model.generate(prompt, new))
            cached.append(t)
            first.append(timed(lambda: model.generate(prompt, 1))[0])
            t, without = timed(lambda: greedy_without_cache(model, prompt, new))
            plain.append(t)
            assert with_cache == without, (p, with_cache, without)           # the same greedy tokens
        c, f, n = statistics.median(cached), statistics.median(first), statistics.median(plain)
        rows.append({"prompt": p, "new": new, "cache_tokens_per_s": new / c, "no_cache_tokens_per_s": new / n,
                     "speedup": n / c, "cache_decode_only_tokens_per_s": (new - 1) / (c - f), "prefill_s": f})
    return rows


def cache_bytes(overrides: list[str]) -> list[dict]:
    rows = []
    for precision, size in (("fp32", 4), ("bf16", 2)):
        for t in (1, 2, 4):
            trainer = build(overrides + [f"train.precision={precision}"], t)
            m = trainer.cfg.model
            decoder = Decoder(local_model(trainer.cfg.model, trainer.plan, stage=False, deterministic=True),
                              trainer.mesh, trainer.plan)
            cache = decoder.empty_cache(1)
            total = sum(x.nbytes for x in cache)
            rank0 = sum(x.addressable_shards[0].data.nbytes for x in cache)
            formula = 2 * m.num_layers * m.seq_len * m.kv_heads * m.head_dim * size
            rows.append({"precision": precision, "t": t, "shape": list(cache.k.shape), "bytes": total,
                         "formula_bytes": formula, "rank0_bytes": rank0,
                         "rank0_formula_bytes": formula // min(t, m.kv_heads)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="16,128,384", help="prompt lengths P")
    ap.add_argument("--new", type=int, default=16, help="new tokens N")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("overrides", nargs="*", help="config overrides of the benchmark's model")
    args = ap.parse_args()
    trainer = build(args.overrides)
    model = InferenceModel(trainer, trainer.init_state().params, 0)
    m = trainer.cfg.model
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; llama l={m.num_layers} h={m.hidden_size} "
          f"a={m.num_heads} k={m.kv_heads} d={m.head_dim} S={m.seq_len} V={VOCAB}, {trainer.plan.precision}, one device")
    out = {"model": dataclasses.asdict(m), "speed": speed(model, [int(p) for p in args.prompts.split(",")],
                                                          args.new, args.repeats),
           "cache": cache_bytes(args.overrides)}
    print("\n| P | N | cache tok/s | no-cache tok/s | cache / no-cache | cache decode-only tok/s | prefill s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["speed"]:
        print(f"| {r['prompt']} | {r['new']} | {r['cache_tokens_per_s']:.1f} | {r['no_cache_tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f} | {r['cache_decode_only_tokens_per_s']:.1f} | {r['prefill_s']:.3f} |")
    print("\n| precision | t | cache [l, b, S, k_g, d] | bytes per sequence | 2·l·S·k·d·bytes | rank 0 bytes | "
          "expected per rank |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in out["cache"]:
        print(f"| {r['precision']} | {r['t']} | {r['shape']} | {r['bytes']:,} | {r['formula_bytes']:,} | "
              f"{r['rank0_bytes']:,} | {r['rank0_formula_bytes']:,} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

"""Layouts with sizes of 3 and 6 against the single-device reference: `fuzz_layouts.py`'s checks on
meshes that are not powers of two (a tool for finding bugs, not a test: pytest does not collect it).

    python tests/fuzz_odd.py {dense,moe,packed,checkpoint,precision} [--seed N] [--seconds S]

Each draw is one of ODD (data, pipe, tensor, context) on at most 6 of the 8 simulated devices, 6
or 12 heads of h 48 (k 3 or 6 for llama), 6 layers on three stages, and for moe 3 or 6 experts with
top-k 1, 2 or E, expert ranks 1, 2, 3 or 6, capacities and sigmoid scores with the router bias.
The batch is 12 rows of 24 tokens (divisible by 3 data ranks and by 2c = 6 for context 3), set in
`layouts` before anything is built. Prints `OK`, `refused`, `FAIL` or `ERROR` per draw, as
`fuzz_layouts.py` does. Found with it: the router bias moved every expert at the mean load at E = 3
(test_moe.py, `one_device_three_experts_top3_router_bias`).
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: E402,F401  (8 CPU devices, fp32: before JAX starts)
import layouts  # noqa: E402

layouts.BATCH, layouts.SEQ = 12, 24
layouts.random_batch.__defaults__ = (0, layouts.BATCH)
import fuzz_layouts  # noqa: E402

ODD = [(3, 1, 2, 1), (1, 1, 3, 1), (1, 2, 3, 1), (2, 1, 3, 1), (3, 2, 1, 1), (1, 1, 1, 3), (2, 1, 1, 3),
       (1, 3, 2, 1), (1, 1, 3, 2), (3, 1, 1, 2), (6, 1, 1, 1), (1, 3, 1, 2)]


def draw(rng: random.Random, kind: str):
    """-> (arch, data, pipe, tensor, context, sp, micro_batch, overrides), as `fuzz_layouts.draw`."""
    arch = rng.choice(["gpt", "llama"])
    d, p, t, c = rng.choice(ODD)
    sp = t > 1 and rng.random() < 0.7
    extra = [f"parallel.context={c}", "train.recompute=" + rng.choice(["none", "selective", "full"]),
             f"model.num_heads={rng.choice([6, 12])}", "model.hidden_size=48", f"model.num_layers={6 if p == 3 else 2}",
             f"model.num_kv_heads={rng.choice([3, 6]) if arch == 'llama' else 0}"]
    extra += [f"model.ffn_hidden_size={rng.choice([36, 90])}"] if rng.random() < 0.7 else []
    extra += ["parallel.schedule=" + rng.choice(["1f1b", "gpipe", "zb"])] if p > 1 else []
    extra += ["parallel.context_attention=" + rng.choice(["ring", "all_gather"])] if c > 1 else []
    extra += ["parallel.tensor_overlap=true"] if sp and rng.random() < 0.5 else []
    micro_batch = rng.choice([1, 2])
    if d > 1 and rng.random() < 0.35:
        extra.append("parallel.fsdp=true")
    elif d > 1 and rng.random() < 0.4:
        extra.append("parallel.distributed_optimizer=true")
    if kind == "moe":
        extra += moe_settings(rng, d * c)
    if kind == "packed":   # (its check builds the config from the overrides alone)
        extra += ["data.document_masking=true", "model.attention=" + rng.choice(["xla", "dot_product"])]
        extra += ["parallel.sequence_parallel=true"] if sp else []
        micro_batch = 2
    return arch, d, p, t, c, sp, micro_batch, extra


def moe_settings(rng: random.Random, ranks: int) -> list:
    """3 or 6 experts, top-k 1, 2 or all of them, over the expert ranks that divide both."""
    experts = rng.choice([3, 6])
    e = rng.choice([x for x in (1, 2, 3, 6) if ranks % x == 0 and experts % x == 0])
    extra = [f"model.num_experts={experts}", f"model.moe_top_k={rng.choice([1, 2, experts])}",
             "model.moe_ffn_hidden_size=24", "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001",
             f"parallel.expert={e}"]
    extra += ["model.moe_capacity_factor=" + rng.choice(["0.5", "1.0", "1.3"])] if rng.random() < 0.4 else []
    extra += ["model.moe_score=sigmoid", "model.moe_router_bias=true"] if rng.random() < 0.3 else []
    return extra


def draw_pair(rng: random.Random):
    """Two layouts of one 6-layer model (the same experts, each side its own expert ranks)."""
    kind = rng.choice(["dense", "moe"])
    src, dst = list(draw(rng, kind)), list(draw(rng, kind))
    model = [o for o in src[7] if o.startswith("model.") and not o.startswith("model.num_layers=")]
    model.append("model.num_layers=6")
    experts = [int(o.split("=")[1]) for o in model if o.startswith("model.num_experts=")]
    for side in (src, dst):
        kept = [o for o in side[7] if not o.startswith(("model.", "parallel.expert="))]
        if experts:
            ranks = side[1] * side[4]
            fits = [e for e in (1, 2, 3, 6) if ranks % e == 0 and experts[0] % e == 0]
            kept.append(f"parallel.expert={rng.choice(fits)}")
        side[0], side[7] = src[0], kept + model
    return tuple(src), tuple(dst)


if __name__ == "__main__":
    sys.exit(fuzz_layouts.main(sys.argv[1:], draw, draw_pair))

"""`python scripts/tp_overlap_bound.py --config FILE [K=V ...]`

The least time a layer's forward leaves the matmul units idle under `parallel.tensor_overlap`
(docs/design.md, "Tensor-parallel overlap", "What bounds it"), from the config's shapes and the
H100 model's constants (`mtjax/hlo_report/hardware.py`); nothing is compiled.

Shape legend: b micro-batch, s sequence, h hidden, f ffn, t tensor size, e bytes per element.
Each ring step moves one chunk, c = b (s/t) h e bytes, in a permute of p = L + c/B, and hides it
behind its own step's matmul, C_op/t, so an operator's t - 1 permutes leave

    I_op = (t - 1) max(0, L + c/B - C_op/t)

of idle matmul time; C_op = 2 b s k_op m_op / F for the operator's matmul [b s, k_op] x [k_op, m_op]
on one rank. Printed per operator (QKV, attention output, fc1, fc2), per layer and micro-batch,
and summed over the step's layer executions (layers x micro-batches), with and without L.

Then the passes a ring adds to the backward ("What bounds it at t = 2"): the four operands the
weight gradients read whole (X of QKV and fc1, dY of the attention output and fc2, b s h e bytes
each) and the row layers' dX put in sequence order (b s k_op e for the attention output and fc2),
each written and read once, P = 2 e b s (4h + k_out + k_fc2), at the HBM bandwidth: the least
kernel time a ring adds per layer, to set beside the plain step's exposed collective time per
layer (`mtjax.inspect --target h100`, `gpu.per_layer.exposed_collective_s`).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtjax import cli  # noqa: E402
from mtjax.config import load_config, validate  # noqa: E402
from mtjax.config.errors import ConfigError  # noqa: E402
from mtjax.hlo_report.hardware import H100  # noqa: E402

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def operator_widths(m, t: int) -> dict:
    """{operator: (k, m)}: the contracted width and one rank's output width of its matmul (d the
    head dimension; a rank's k/t kv heads, or the one it uses when k < t replicates them)."""
    d, kv = m.head_dim, m.kv_heads
    kv_rank = kv // t if kv % t == 0 else 1
    glu = m.arch == "llama"
    return {"qkv": (m.hidden_size, (m.num_heads // t + 2 * kv_rank) * d),
            "out": (m.num_heads * d // t, m.hidden_size),
            "fc1": (m.hidden_size, (2 if glu else 1) * m.ffn_size // t),
            "fc2": (m.ffn_size // t, m.hidden_size)}


def bound(cfg, gpus: int, spec=H100) -> dict:
    """{'permute_s', 'matmul_s': {op: C_op}, 'idle_s': {op: I_op}, 'idle_no_latency_s', 'executions'}."""
    m, t, b = cfg.model, cfg.parallel.tensor, cfg.train.micro_batch
    s, e = m.seq_len, BYTES[cfg.train.precision]
    c = b * (s // t) * m.hidden_size * e
    p = spec.collective_latency_s + c / spec.nvlink_bandwidth
    matmul = {op: 2 * b * s * k * w / spec.matmul_flops for op, (k, w) in operator_widths(m, t).items()}
    idle = {op: (t - 1) * max(0.0, p - v / t) for op, v in matmul.items()}
    no_latency = sum((t - 1) * max(0.0, c / spec.nvlink_bandwidth - v / t) for v in matmul.values())
    par = cfg.parallel
    d = par.data if par.data > 0 else gpus // (par.pipe * t * par.context)
    executions = m.num_layers * (cfg.train.global_batch // (b * d)) // par.pipe   # one rank's layers
    widths = operator_widths(m, t)
    passes = 2 * e * b * s * (4 * m.hidden_size + widths["out"][0] + widths["fc2"][0])   # P bytes
    return {"permute_s": p, "matmul_s": matmul, "idle_s": idle, "idle_no_latency_s": no_latency,
            "executions": executions, "ring_pass_bytes": passes, "ring_pass_s": passes / spec.memory_bandwidth}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, default=8, help="devices, for parallel.data=-1 (default 8)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    validate(cfg, args.gpus)
    if cfg.parallel.tensor < 2:
        raise ConfigError("parallel.tensor", "the bound needs tensor > 1 (it is about the tensor ranks' rings)")
    r = bound(cfg, args.gpus)
    us = lambda d: " / ".join(f"{k} {v * 1e6:.1f}" for k, v in d.items())  # noqa: E731
    total, n = sum(r["idle_s"].values()), r["executions"]
    print(f"permute p = {r['permute_s'] * 1e6:.2f} us; matmul C_op us: {us(r['matmul_s'])}")
    print(f"idle I_op us per layer forward: {us(r['idle_s'])}; sum {total * 1e6:.1f}")
    print(f"per step ({n} layer executions): {total * n * 1e3:.1f} ms; with L = 0: "
          f"{r['idle_no_latency_s'] * n * 1e3:.1f} ms")
    print(f"the ring's passes per layer backward: {r['ring_pass_bytes'] / 1e6:.1f} MB, at least "
          f"{r['ring_pass_s'] * 1e6:.1f} us of kernels ({r['ring_pass_s'] * n * 1e3:.1f} ms per step)")
    return 0


if __name__ == "__main__":
    sys.exit(cli.report(main))

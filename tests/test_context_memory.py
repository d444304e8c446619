"""Context parallelism from the compiled program: activation bytes, matmul FLOPs and collectives
per device against c = 1's and against the formulas of docs/design.md ("Context parallelism").

A model of S = 64 tokens (2c chunks of 8 at c = 4), b = 2, h = 64, a = 8, two layers, no dropout
(the ring's core has none). Activations are traced (`mtjax.activations.saved_bytes_per_layer`,
nothing compiled, as tests/test_activation_memory.py measures Korthikanti's count); FLOPs and
collectives are read from the compiled gradient (`compile_grad`: one micro-batch, the reduction
over data x context included), compiled once per (c, kind) and shared by a module fixture.
"""
import functools

import pytest

from mtjax.activations import compile_grad, saved_bytes_per_layer
from mtjax.config import load_config, validate
from mtjax.hlo_report import collective_report, executed_dot_flops
from tests.layouts import build

S, B, H, A, L = 64, 2, 64, 8, 2
KV = {"gpt": A, "llama": 2}


def trainer(arch: str, c: int, kind: str, mode: str, precision: str = "bf16"):
    cfg = load_config(None, [
        f"model.arch={arch}", f"model.num_layers={L}", f"model.hidden_size={H}", f"model.num_heads={A}",
        f"model.num_kv_heads={KV[arch]}", f"model.seq_len={S}", "model.dropout=0.0",
        "model.attention_dropout=0.0", "model.attention=xla", f"parallel.context={c}",
        *([f"parallel.context_attention={kind}"] if c > 1 else []),
        f"train.global_batch={B}", f"train.micro_batch={B}", f"train.precision={precision}",
        f"train.recompute={mode}"])
    validate(cfg, c)
    return build(cfg, 1, 1, 1, c)


@functools.lru_cache(maxsize=None)
def saved(arch: str, c: int, kind: str, mode: str) -> dict:
    return saved_bytes_per_layer(trainer(arch, c, kind, mode))


def ring_extra(c: int, w: int = 2) -> float:
    """What the ring keeps beyond selective's Q, K, V per layer and device: its own copy of the
    core's output O [b, s/c, a, d] (w bytes) and the log-sum-exp [b, s/c, a] (fp32)."""
    return (w * B * S * H + 4 * B * S * A) / c


@pytest.mark.parametrize("kind", ["all_gather", "ring"])
@pytest.mark.parametrize("arch,mode", [("gpt", "none"), ("llama", "selective")])
def test_activation_bytes_divide_by_c(arch, mode, kind):
    """bytes(c) per layer and device, bf16:
      all_gather, every mode:  bytes(1) / c  (the gathered K, V are not kept: the backward gathers
                               again; P is [b, a, s/c, s], s^2/c)
      ring, none | selective:  (selective's bytes(1) + w b s h + 4 b s a) / c  (the ring keeps no
                               s x s term at all, under none too, but O and the fp32 lse)
      (full keeps the layer's input, bytes(1) / c for both: not repeated here)
    each within 10% (they come out exact)."""
    for c in (2, 4):
        got = saved(arch, c, kind, mode)["total"]
        if kind == "ring":
            want = saved(arch, 1, "", "selective")["total"] / c + ring_extra(c)
        else:
            want = saved(arch, 1, "", mode)["total"] / c
        assert abs(got / want - 1) < 0.10, (c, got, want)

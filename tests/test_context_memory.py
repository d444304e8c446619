"""Context parallelism from the compiled program: activation bytes, matmul FLOPs and collectives
per device against c = 1's and against the formulas of docs/design.md ("Context parallelism").

A model of S = 64 tokens (2c chunks of 8 at c = 4), b = 2, h = 64, a = 8, two layers, no dropout
(the ring's core has none). Activations are traced (`mtjax.activations.saved_bytes_per_layer`,
nothing compiled, as tests/test_activation_memory.py measures Korthikanti's count); FLOPs and
collectives are read from the compiled gradient (`compile_grad`: one micro-batch, the reduction
over data x context included), compiled once per (c, kind) and shared by a module fixture.
"""
import functools

import jax

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


# ---- conditionals of equal cost count once (`hlo_report.flops.equal_branches_once`) ----------------
def test_equal_cost_branches_count_once():
    """A scan of 4 steps, each a lax.cond between two products of equal FLOPs (the ring's
    `_earlier` / `_later`: [2n, k] x [k, n] or [n, k] x [k, 2n]): the count is one branch a step,
    and exact; branches of unequal cost still count as if taken (an upper bound)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    n, k, steps = 8, 16, 4

    def step(pick, x, w):
        def equal(c):
            return lax.cond(c, lambda: jnp.sum(x @ w), lambda: jnp.sum(x[:n] @ jnp.concatenate([w, w], 1)))
        return lax.scan(lambda acc, c: (acc + equal(c), None), 0.0, pick)[0]

    def unequal(pick, x, w):
        return lax.scan(lambda acc, c: (acc + lax.cond(c, lambda: jnp.sum(x @ w), lambda: jnp.sum(x)), None),
                        0.0, pick)[0]

    args = jnp.arange(steps) % 2 == 0, jnp.ones((2 * n, k)), jnp.ones((k, n))
    one = executed_dot_flops(jax.jit(step).lower(*args).compile().as_text())
    assert one["flops"] == steps * 2 * (2 * n) * k * n and not one["conditionals_upper_bound"]
    both = executed_dot_flops(jax.jit(unequal).lower(*args).compile().as_text())
    assert both["flops"] == steps * 2 * (2 * n) * k * n and both["conditionals_upper_bound"]


# ---- the compiled gradient: matmul FLOPs and collectives per device --------------------------------
# GPT (k = a heads of d = h/a), recompute none, fp32 (w = 4): c = 1, all_gather at c = 2, ring at
# c = 4 (both kinds at both c give the same agreement; three compiles keep this file cheap).
COMPILED = [(1, ""), (2, "all_gather"), (4, "ring")]


@pytest.fixture(scope="module")
def compiled():
    from mtjax.inspect import abstract_state
    out = {}
    for c, kind in COMPILED:
        tr = trainer("gpt", c, kind, "none", "fp32")
        text = compile_grad(tr).as_text()
        params = sum(x.size for x in jax.tree.leaves(abstract_state(tr).params))
        out[c, kind] = (text, collective_report(text, tr.mesh), params)
    return out


def attention_flops(c: int, kind: str) -> float:
    """Matmul FLOPs per device and step of the attention cores, recompute none (2 b a d = 2 b h per
    score): c = 1 and all_gather compute every s/c x s block, 2 products forward (Q K^T, P V) and
    4 backward; the ring only the 2c + 1 blocks of L x L (L = s/2c) the causal mask leaves, 2
    forward and 5 backward (P recomputed from the lse)."""
    if kind == "ring":
        return L * 7 * 2 * B * H * (2 * c + 1) * (S // (2 * c)) ** 2
    return L * 6 * 2 * B * H * S * S / c


@pytest.mark.parametrize("c,kind", COMPILED[1:], ids=[k for _, k in COMPILED[1:]])
def test_executed_flops_balance_and_sum(compiled, c, kind):
    """Every context rank executes the same matmul FLOPs: the program is one, with no conditional
    (the ring picks which query and key chunks a step's two blocks take by selects), so the count
    is no upper bound. Summed
    over the c ranks: c = 1's with its attention replaced by this kind's, within 3%: all_gather
    c = 1's itself; the ring less the blocks the causal mask empties (it comes out exact)."""
    from mtjax.hlo_report.flops import branch_flops
    from mtjax.hlo_report.parse import parse_program
    text = compiled[c, kind][0]
    per_device = executed_dot_flops(text)
    assert not per_device["conditionals_upper_bound"]
    branches = branch_flops(parse_program(text))
    assert not branches, branches      # the ring picks its step's blocks by selects: no conditional
    assert all(max(b) <= 1.02 * min(b) for b in branches.values()), branches
    one = executed_dot_flops(compiled[1, ""][0])["flops"]
    want = one - attention_flops(1, "") + c * attention_flops(c, kind)
    assert abs(c * per_device["flops"] / want - 1) < 0.03, (per_device["flops"], want)
    if kind == "all_gather":
        assert abs(c * per_device["flops"] / one - 1) < 0.03


def context_collectives(report) -> dict:
    """{kind: (count, bytes)} per step of the collectives over `context` alone."""
    return {k: (v["count"], v["bytes"]) for k, v in report["by_axes"].get("context", {}).items()}


@pytest.mark.parametrize("c,kind", COMPILED[1:], ids=[k for _, k in COMPILED[1:]])
def test_context_collectives_are_the_formula(compiled, c, kind):
    """Per step over `context` (docs/design.md, "Context parallelism"), l layers, n = b s k d, w = 4:
      all_gather: 4 l all-gathers of n w (K, V; the backward gathers again: recompute none keeps
                  no gathered output) and 2 l reduce-scatters of n w (dK, dV; full size)
      ring:       (c - 1) + (c - 1) + c permutes a layer, K and V stacked (2n/c, w bytes) forward
                  and backward, dK, dV accumulators (2n/c, fp32) in the backward: l (3c - 2) of 8n/c
      both:       the gradients' all-reduce once a step: 4 bytes a parameter, and the loss."""
    _, report, params = compiled[c, kind]
    n, w = B * S * H, 4
    got = context_collectives(report)
    if kind == "all_gather":
        want = {"all-gather": (4 * L, 4 * L * n * w), "reduce-scatter": (2 * L, 2 * L * n * w)}
    else:
        want = {"collective-permute": (L * (3 * c - 2), L * (3 * c - 2) * 2 * n * w // c)}
    assert {k: v for k, v in got.items() if k != "all-reduce"} == want, got
    assert got["all-reduce"][1] == 4 * params + 4, (got, params)

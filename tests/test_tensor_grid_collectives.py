"""The tensor grid's communication, read from the compiled train step through `mtjax.inspect`,
against the formula of `grid_ops` / `grid_model` (docs/design.md, "2D and 2.5D tensor parallelism").

Per micro-batch and layer, with r = b/(d q) rows of a block and every linear layer Y = X A
(X [r, s, K/q], A [K/q, N/q]):
  forward   all-gather of X along COL ([r, s, K]; Q, K and V share theirs, as gate and up do)
            all-gather of A along ROW ([K, N/q]) for each linear
  backward  the same gathers again (the layer keeps blocks), a reduce-scatter along COL of each
            linear's dX ([r, s, K]) and along ROW of each dA ([K, N/q])
  norms     all-reduces of [r, s, 1] along COL: LayerNorm 2 forward + 2 backward, RMSNorm 1 + 1.
Per micro-batch outside the layers: the embedding's reduce-scatter along ROW (its transpose an
all-gather), the head (tied: an all-gather along ROW and a reduce-scatter along COL; untied: one
more linear, whose backward reuses the forward's gathered X, and whose weight gather XLA hoists
out of the micro-batch loop: once per step), the final norm, and 3 all-reduces of [r, s] along the axis splitting V.
Collectives are counted per tensor; bytes follow from the fp32 elements.
"""
import collections
import math

import pytest

from layouts import SEQ, build, step_report, tiny_config
from mtjax.parallel.grid import COL, DEPTH, ROW
from test_tensor_collectives import local_sizes, members

B_MICRO, LAYERS, H, HEADS = 4, 2, 48, 4


def expected(cfg, q, depth, m):
    """Counter of (kind, axis, elements of the full tensor) the formula predicts."""
    c = cfg.model
    r, s, dh = B_MICRO // (q * depth), SEQ, c.head_dim
    ad, kd, f = c.num_heads * dh, c.kv_heads * dh, c.ffn_size
    linears = [(H, ad), (H, kd), (H, kd), (ad, H)] + ([(H, f), (H, f)] if c.arch == "llama" else [(H, f)]) + [(f, H)]
    x_gathers = [H, ad, H, f]                           # inputs: QKV, O, fc1 (gate/up), fc2
    per_layer = collections.Counter()
    for k in x_gathers:
        per_layer[("all-gather", COL, r * s * k)] += 2                # forward and dA's
    for k, n in linears:
        per_layer[("all-gather", ROW, k * n // q)] += 2               # forward and dX's
        per_layer[("reduce-scatter", COL, r * s * k)] += 1            # dX
        per_layer[("reduce-scatter", ROW, k * n // q)] += 1           # dA
    stats = 2 if c.arch == "gpt" else 1
    per_layer[("all-reduce", COL, r * s)] += 2 * 2 * stats            # two norms, forward and backward
    total = collections.Counter({k: v * LAYERS * m for k, v in per_layer.items()})
    rows = r * q                                                      # b/d: one depth layer's rows
    outside = collections.Counter()
    outside[("reduce-scatter", ROW, rows * s * H // q)] += 1          # embedding exit
    outside[("all-gather", ROW, rows * s * H // q)] += 1              # ... its transpose
    outside[("all-reduce", COL, r * s)] += 2 * stats                  # final norm
    if c.tied:
        outside[("all-gather", ROW, rows * s * H // q)] += 1          # x gathered along ROW
        outside[("reduce-scatter", ROW, rows * s * H // q)] += 1      # ... its transpose
        outside[("reduce-scatter", COL, rows * s * cfg_vocab(cfg, q) // q)] += 1
        outside[("all-gather", COL, rows * s * cfg_vocab(cfg, q) // q)] += 1
        outside[("all-reduce", ROW, r * s)] += 3                      # loss, V along ROW
    else:
        v = cfg_vocab(cfg, q)
        outside[("all-gather", COL, r * s * H)] += 1                  # the backward reuses the forward's
        outside[("reduce-scatter", COL, r * s * H)] += 1
        outside[("reduce-scatter", ROW, H * v // q)] += 1
        outside[("all-reduce", COL, r * s)] += 3                      # loss, V along COL
    once = collections.Counter()
    if not c.tied:   # the head's weight gather does not depend on the micro-batch: XLA hoists it
        once[("all-gather", ROW, H * cfg_vocab(cfg, q) // q)] += 1
    return total + collections.Counter({k: v * m for k, v in outside.items()}) + once


def cfg_vocab(cfg, q):
    from layouts import VOCAB
    from mtjax.parallel.vocab import padded_vocab_size
    return padded_vocab_size(VOCAB, cfg.model.vocab_multiple, q)


@pytest.mark.parametrize("arch,grid,depth", [("gpt", "2d", 1), ("llama", "2.5d", 2)])
def test_grid_collectives_follow_the_formula(arch, grid, depth):
    q, t = 2, 4 * depth
    cfg = tiny_config(arch, t, micro_batch=B_MICRO, extra=[
        f"parallel.tensor_grid={grid}", f"parallel.tensor_depth={depth}", f"model.num_layers={LAYERS}",
        f"model.hidden_size={H}", f"model.num_heads={HEADS}"])
    trainer = build(cfg, 1, 1, t)
    rep = step_report(trainer)
    m = trainer.plan.micro_batches
    want = expected(cfg, q, depth, m)
    r_s = B_MICRO // (q * depth) * SEQ
    found = collections.Counter()
    for axis in (ROW, COL):
        for (kind, n), count in members(rep, (axis,)).items():
            if kind != "all-reduce" or n == r_s:       # the per-step gradient sums and scalars aside
                found[(kind, axis, n)] += count
    assert found == want, (found - want, want - found)
    for op in rep["collectives"]["ops"]:               # bytes: each gather / scatter's full fp32 tensor
        if op["kind"] in ("all-gather", "reduce-scatter") and tuple(op["axes"]) in ((ROW,), (COL,)):
            (shape,) = op["shapes"]
            n = math.prod(int(x) for x in shape[shape.index("[") + 1:-1].split(","))
            assert op["bytes"] == 4 * n * (op["group_size"] if op["kind"] == "reduce-scatter" else 1)
    # once per step: every weight's gradient summed along DEPTH (2.5d), the vectors' along ROW too
    sums = collections.Counter()
    for axes in ((DEPTH,), (DEPTH, ROW), (ROW,)):
        sums.update({n: c for (kind, n), c in members(rep, axes).items() if kind == "all-reduce" and n > 1
                     and n != r_s})
    assert sorted(sums.elements()) == local_sizes(trainer, mask_only=True)

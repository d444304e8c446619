"""scripts/bench_train.py's plain-JAX baseline is the same model as mtjax: from mtjax's initial
weights, on the same batches, both give the same losses and gradient norms step after step, and
the same matmul FLOPs."""
import math
import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_train  # noqa: E402

SMALL = ["model.hidden_size=64", "model.seq_len=32", "train.global_batch=4", "train.micro_batch=2",
         "optim.warmup_steps=1"]   # m = 2 micro-batches; lr(0) = 0, so steps 2 and 3 see updated weights


def test_plain_baseline_matches_mtjax_in_fp32():
    row = bench_train.bench_config("tiny", SMALL, steps=2)
    c = row["baseline"]
    assert c["same_model"] and c["tolerance"] == 1e-5
    assert c["max_loss_rel_diff"] < 1e-5, c["loss"]
    assert max(abs(a - b) / b for a, b in zip(*c["grad_norm"].values())) < 1e-4, c["grad_norm"]
    assert c["matmul_flops_ratio"] == 1.0


def test_plain_init_starts_near_ln_v():
    cfg = bench_train.build("tiny", SMALL).cfg
    g = bench_train.plain_spec(cfg, bench_train.VOCAB)
    params = bench_train.plain_init(g, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, g.s + 1), 0, g.V)
    loss = bench_train.plain_loss_sum(bench_train.plain_logits(params, tokens[:, :-1], g), tokens[:, 1:], g.V)
    assert float(loss) / (2 * g.s) == pytest.approx(math.log(g.V), rel=2e-2)

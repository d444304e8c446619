"""The pipeline executor computes what one device computes, and its stash is bounded by the schedule.

Loss and every gradient leaf against tests/reference.py (fp32, relative error < 1e-5) for
pipe in {2, 4}, micro-batches in {p, 2p}, GPipe, 1F1B and interleaved 1F1B (v = 2), with tensor and data parallelism
(and sequence parallelism) mixed in across the cases.
"""
import jax
import pytest

import reference
from layouts import VOCAB, ZERO_GRADIENT, build, leaf_errors, random_batch, tiny_config
from mtjax.inspect import report

TOL = 1e-5

CASES = [  # (data, pipe, tensor, micro-batches, schedule, arch, sequence_parallel); v = 2 when interleaved
    (2, 2, 2, 2, "1f1b", "llama", True),
    (1, 2, 2, 4, "1f1b", "gpt", False),
    (2, 2, 1, 4, "gpipe", "llama", False),
    (1, 2, 1, 2, "gpipe", "gpt", False),
    (2, 4, 1, 4, "1f1b", "gpt", False),
    (1, 4, 2, 8, "1f1b", "llama", True),
    (1, 4, 1, 4, "gpipe", "llama", False),
    (1, 4, 2, 8, "gpipe", "gpt", True),
    (1, 2, 2, 4, "interleaved", "gpt", True),
    (2, 2, 1, 2, "interleaved", "gpt", False),
    (2, 4, 1, 4, "interleaved", "llama", False),
    (1, 4, 2, 8, "interleaved", "llama", True),
]


@pytest.mark.parametrize("data,pipe,tensor,m,schedule,arch,sp", CASES)
def test_pipeline_matches_reference(data, pipe, tensor, m, schedule, arch, sp):
    v = 2 if schedule == "interleaved" else 1
    cfg = tiny_config(arch, tensor, pipe, data, sp,
                      extra=[f"train.micro_batches={m}", f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}",
                             f"model.num_layers={4 * v}"])
    trainer = build(cfg, data, pipe, tensor)
    assert trainer.layout.micro_batches == m
    state = trainer.init_state()
    batch = random_batch()
    grads, loss = trainer.grad_fn(state.params, trainer.put_batch(batch), state.rng)
    params = jax.device_get(state.params)
    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)
    assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < TOL
    errs = leaf_errors(jax.device_get(grads), ref_grads, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}


H, S = 64, 64


def _temp_bytes(m, schedule):
    cfg = tiny_config("gpt", 1, 2, 1, micro_batch=1,
                      extra=[f"parallel.schedule={schedule}", f"train.global_batch={m}", f"model.hidden_size={H}",
                             f"model.seq_len={S}", "model.num_layers=4"])
    return report(build(cfg, 1, 2, 1))["memory"]["temp_bytes"]


def test_1f1b_memory_does_not_grow_with_micro_batches():
    """Per-device temporaries at m = 16 are at most 1.15x those at m = 4 (1F1B). GPipe's grow by
    at least the 12 extra stashed stage inputs of b*s*h fp32 values each."""
    small, large = _temp_bytes(4, "1f1b"), _temp_bytes(16, "1f1b")
    assert large <= 1.15 * small, (small, large)
    stash = 1 * S * H * 4
    assert _temp_bytes(16, "gpipe") - _temp_bytes(4, "gpipe") >= 12 * stash

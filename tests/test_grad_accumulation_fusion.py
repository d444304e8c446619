"""Megatron's gradient accumulation fusion: the layer stack's weight gradients are added into the
fp32 sums inside the layers' backward (`stash_scan`'s `main_grad`), not written as a fresh stack
per micro-batch and summed after (`training/computed_weights.py`). The gradients are the unfused
step's, bit for bit, and the reference's; the program adds no [l, ...] stack."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import lax
from jax.extend import core    # jaxprs_in_params

import mtjax.training.step as step
from layouts import build, random_batch, tiny_config
from test_equivalence import assert_matches_reference

CASES = {  # name: (arch, data, tensor, sp, extra)
    "one_device_m4": ("llama", 1, 1, False, ["train.micro_batches=4"]),
    # the last micro-batch's data reduction in its backward: the first m - 1 are fused
    "data2_overlapped_zero": ("gpt", 2, 1, False, ["train.micro_batches=4", "parallel.distributed_optimizer=true"]),
    # two halves of 2-layer units: the rows put as g-tuples
    "tensor2_half_batches_group2": ("llama", 1, 2, True, ["train.micro_batch=2", "parallel.half_batch_overlap=true",
                                                          "parallel.half_batch_group=2"]),
}


def _cfg(name):
    arch, data, tensor, sp, extra = CASES[name]
    return tiny_config(arch, tensor, 1, data, sp, micro_batch=None, extra=extra), data, tensor


@pytest.mark.parametrize("name", list(CASES))
def test_fused_accumulation_matches_reference(name):
    """Logits, loss, every gradient leaf and an AdamW step against the reference."""
    cfg, data, tensor = _cfg(name)
    assert_matches_reference(build(cfg, data, 1, tensor), cfg)


def test_fused_equals_unfused_bitwise(monkeypatch):
    """The sums are the same additions in the same order: main_grad[k] + dW_k per micro-batch."""
    cfg, data, tensor = _cfg("one_device_m4")
    fused = build(cfg, data, 1, tensor)
    state, batch = fused.init_state(), random_batch(1)
    got, _ = jax.jit(fused.grad_fn)(state.params, fused.put_batch(batch), state.rng)
    monkeypatch.setattr(step, "fuses_accumulation", lambda model, plan: False)
    plain = build(cfg, data, 1, tensor)
    want, _ = jax.jit(plain.grad_fn)(state.params, plain.put_batch(batch), state.rng)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), jax.device_get(want))


def _adds(jaxpr, loops: int = 0):
    """(output shape, dtype, enclosing scan/while count) of every add, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is lax.add_p:
            aval = eqn.outvars[0].aval
            out.append((tuple(aval.shape), str(aval.dtype), loops))
        inner = loops + (eqn.primitive.name in ("scan", "while"))
        for sub in core.jaxprs_in_params(eqn.params):
            out.extend(_adds(sub, inner))
    return out


def test_no_stack_is_added_per_micro_batch(monkeypatch):
    """The step's program adds no layer-stack-shaped [l, ...] array (the unfused step adds one per
    leaf in its micro-batch loop); the fp32 rows are added inside the layers' backward loop
    (`stash_scan.add_rows`: blocks of g rows, g = 1 here)."""
    cfg, data, tensor = _cfg("one_device_m4")

    def stacks_added(trainer):
        state = trainer.init_state()
        stacks = {tuple(a.shape) for a in jax.tree.leaves(state.params["layers"])}
        rows = {(1, *s[1:]) for s in stacks}       # a block of g = 1 rows
        jaxpr = jax.make_jaxpr(trainer.grad_fn)(state.params, trainer.put_batch(random_batch()), state.rng).jaxpr
        adds = _adds(jaxpr)
        return ([a for a in adds if a[0] in stacks],
                {a[0] for a in adds if a[0] in rows and a[1] == "float32" and a[2] >= 2})
    added, rows_in_loops = stacks_added(build(cfg, data, 1, tensor))
    assert not added, added
    assert rows_in_loops, "no fp32 row of the stack is added inside the layers' backward"
    monkeypatch.setattr(step, "fuses_accumulation", lambda model, plan: False)
    unfused, _ = stacks_added(build(cfg, data, 1, tensor))
    assert unfused     # the check sees what the fusion removes

"""Activation offload under context parallelism: the CUDA lowering of a c = 2 step sends the
layers' residuals to pinned host memory and back, and on CPU (where the moves are no-ops) its
gradients are plain c = 2's (which tests/test_context_parallel.py holds to one device's)."""
import dataclasses

import jax
import jax.numpy as jnp

from layouts import build, leaf_errors, random_batch, tiny_config, ZERO_GRADIENT
from test_precision_recompute import host_placements


def test_offload_under_context_parallelism():
    base = tiny_config("llama", extra=["parallel.context=2", "parallel.context_attention=all_gather",
                                       "train.recompute=none"])
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, offload_activations=True))
    offload, plain = build(cfg, 1, 1, 1, 2), build(base, 1, 1, 1, 2)
    moved = host_placements(offload)
    assert moved["pinned_host"] > 0 and moved["device"] >= moved["pinned_host"], moved
    params, rng, batch = plain.init_state().params, jnp.zeros(2, jnp.uint32), random_batch(3)
    got, _ = jax.jit(offload.grad_fn)(params, offload.put_batch(batch), rng)
    want, _ = jax.jit(plain.grad_fn)(params, plain.put_batch(batch), rng)
    errs = leaf_errors(jax.device_get(got), jax.device_get(want), skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < 1e-6, errs

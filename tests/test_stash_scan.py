"""The training layer scan (`model/stash_scan.py`): the values and gradients of `lax.scan` over the
same layer function, under a checkpoint policy and with per-layer dropout keys; its stash and its
stacked weight gradients allocated by `lax.empty` (uninitialised on GPU), not by zeros. The whole
model under it is held to tests/reference.py by every equality test; on XLA:GPU the step runs no
zero-fill or copy of a stacked stash (`test_gpu_compile.py`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax.model.stash_scan import stash_scan

N, B, H = 3, 4, 8


def layer(x, w, key, rope, segments):
    """A layer with a matmul, a nonlinearity, a dropout mask from its key and a side input."""
    keep = jax.random.bernoulli(key, 0.75, x.shape)
    y = jnp.tanh(x @ w["kernel"] + w["bias"][None]) * rope
    return x + jnp.where(keep, y / 0.75, 0.0) + 0.0 * segments.sum()


def _inputs():
    rng = np.random.RandomState(0)
    params = {"kernel": jnp.asarray(rng.randn(N, H, H) / np.sqrt(H), jnp.float32),
              "bias": jnp.asarray(rng.randn(N, H), jnp.float32)}
    x = jnp.asarray(rng.randn(B, H), jnp.float32)
    keys = jax.random.split(jax.random.key(1), N)
    rope, segments = jnp.asarray(rng.rand(B, H), jnp.float32), jnp.zeros((B,), jnp.int32)
    return params, x, keys, rope, segments


def _with_scan(run, params, keys, x, rope, segments):
    def body(x, xs):
        w, key = xs
        return run(x, w, key, rope, segments), None
    return jax.lax.scan(body, x, (params, keys))[0]


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable,
                                    jax.checkpoint_policies.everything_saveable])
def test_values_and_gradients_are_the_scans(policy):
    run = layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=False)
    params, x, keys, rope, segments = _inputs()
    weights = jnp.cos(jnp.arange(B * H, dtype=jnp.float32)).reshape(B, H)

    def loss(scan, params, x):
        return jnp.sum(scan(run, params, keys, x, rope, segments) * weights)
    ours = jax.jit(jax.value_and_grad(lambda p, x: loss(stash_scan, p, x), argnums=(0, 1)))(params, x)
    theirs = jax.jit(jax.value_and_grad(lambda p, x: loss(_with_scan, p, x), argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_stash_and_weight_gradients_come_from_empty_buffers():
    """In the gradient's program every [n, ...] buffer the two loops fill is a `lax.empty`: the
    stash (here the layers' inputs and pre-activations) and each weight's gradient stack."""
    params, x, keys, rope, segments = _inputs()
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(stash_scan(layer, p, keys, x, rope, segments))))(params)
    empties = [e.params["shape"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "empty"]
    assert (N, H, H) in empties and (N, H) in empties                  # dW stacks of kernel and bias
    assert sum(shape[0] == N for shape in empties) >= 3                # and the stash
    loops = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(loops) == 2                                             # the forward and the backward
    for loop in loops:     # every output is carried: no stacked ys, which scan starts from zeros
        if "num_carry" in loop.params:                                 # jax 0.10
            assert loop.params["num_carry"] == len(loop.outvars), loop.params["num_carry"]
        else:                   # jax 0.11: ft_out holds the (carry, ys) parts of the outputs
            assert not loop.params["ft_out"][1], loop.params["ft_out"]

"""The split backward's hook in the linear layers: taps that hand out each matmul's X and dY.

Shape legend: n layers of a run, b micro-batch, s sequence; a linear layer computes
Y [b, s, *out] = X [b, s, *in] . A [*in, *out] (contracting `in`; its kernel is [*in, *out]).

Zero-bubble pipelining (Qi et al., ICLR 2024) splits a stage's backward in two: B, the gradient
of the stage's input dX (sent upstream at once), and W, the weight gradients dA = X^T dY, which
may wait. B must not compute dA, and W must not redo B: it needs, per matmul, its input X and the
gradient at its output dY. A *tap* is an extra input of each matmul, a pair of zero arrays shaped
like (X, Y), whose cotangent is defined to be (X, dY): B differentiates the stage with respect
to its input, its taps and the non-matmul weights (norms, biases), with the matmul weights held
constant, so autodiff leaves out every X^T dY and pulls dY back through A only; W is then
`weight_gradients`, one batched contraction over (b, s) per matmul. X comes from the matmul's
residuals in B (saved by the forward or recomputed, as `train.recompute` says), so the W-pending
state is one (X, dY) pair per matmul, and the norms' and biases' gradients are B's.

The tap enters a layer as the flax collection `taps` (`io` in the linear module's scope): a model
applied without that collection runs the plain einsum.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

COLLECTION, NAME = "taps", "io"


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def tapped_einsum(spec: str, x, w, tap):
    """einsum(spec, x, w); the backward returns dX = dY A^T, zero for A, and (X, dY) as `tap`'s
    cotangent (its forward keeps x and w, the plain einsum's residuals)."""
    del tap
    return jnp.einsum(spec, x, w)


def _forward(spec, x, w, tap):
    del tap
    return jnp.einsum(spec, x, w), (x, w)


def _backward(spec, residuals, dy):
    x, w = residuals
    _, pullback = jax.vjp(lambda x: jnp.einsum(spec, x, w), x)   # dY A^T only: w is a constant here
    return pullback(dy)[0], jnp.zeros_like(w), (x, dy.astype(x.dtype))


tapped_einsum.defvjp(_forward, _backward)


def linear(module, spec: str, x, w):
    """The one matmul of a linear layer `module`: einsum(spec, x, w), tapped when the model runs
    with a `taps` collection (then made here, zeros, if it is mutable: `zero_taps`)."""
    making = module.is_mutable_collection(COLLECTION) and not module.is_initializing()   # init makes all mutable
    if not (module.has_variable(COLLECTION, NAME) or making):
        return jnp.einsum(spec, x, w)
    y = jax.eval_shape(partial(jnp.einsum, spec), x, w)
    tap = module.variable(COLLECTION, NAME, lambda: (jnp.zeros_like(x), jnp.zeros(y.shape, y.dtype)))
    return tapped_einsum(spec, x, w, tap.value)


def split_weights(params) -> tuple[dict, dict]:
    """A layer tree -> (its matmul kernels, the rest), flat {path: leaf} dicts; `join_weights` inverts."""
    flat = flatten_dict(params)
    kernels = {k: w for k, w in flat.items() if k[-1] == "kernel"}
    return kernels, {k: w for k, w in flat.items() if k[-1] != "kernel"}


def join_weights(kernels: dict, rest: dict) -> dict:
    return unflatten_dict({**kernels, **rest})


def weight_gradients(tap_cotangents) -> dict:
    """W: {kernel path: dA [n, *in, *out]} from the taps' cotangents (X [n, b, s, *in], dY [n, b, s, *out])
    of a run of n layers: dA = sum over (b, s) of X^T dY, a layer's contraction batched over n."""
    grads = {}
    for path, (x, dy) in flatten_dict(tap_cotangents).items():
        assert path[-1] == NAME, path
        grads[path[:-1] + ("kernel",)] = jax.vmap(lambda x, dy: jnp.tensordot(x, dy, axes=([0, 1], [0, 1])))(x, dy)
    return grads

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
`weight_gradients`, one batched contraction over (b, s) per matmul (on the 2D grid, each
block's X and dY, and W gathers and reduce-scatters as `grid_ops.linear_dA`). X comes from the matmul's
residuals in B (saved by the forward or recomputed, as `train.recompute` says), so the W-pending
state is one (X, dY) pair per matmul, and the norms' and biases' gradients are B's.

The tap enters a layer as the flax collection `taps` (`io` in the linear module's scope): a model
applied without that collection runs the plain product (`tap`).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

COLLECTION, NAME = "taps", "io"


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def tapped(product, grad_x, x, w, tap):
    """product(x, w); the backward returns dX = grad_x(dY, X, A), zero for A, and (X, dY) as `tap`'s
    cotangent (its forward keeps x and w, the plain product's residuals)."""
    del tap
    return product(x, w)


def _forward(product, grad_x, x, w, tap):
    del tap
    return product(x, w), (x, w)


def _backward(product, grad_x, residuals, dy):
    x, w = residuals
    return grad_x(dy, x, w).astype(x.dtype), jnp.zeros_like(w), (x, dy.astype(x.dtype))


tapped.defvjp(_forward, _backward)


def einsum_dx(spec: str, dy, x, w):
    """dX = dY A^T of einsum(spec, x, w): its pullback in x alone (w is a constant here)."""
    _, pullback = jax.vjp(lambda x: jnp.einsum(spec, x, w), x)
    return pullback(dy)[0]


def linear(module, spec: str, x, w):
    """The one matmul of a 1d linear layer `module`: einsum(spec, x, w), tapped (`tap`)."""
    return tap(module, x, w, partial(jnp.einsum, spec), partial(jnp.einsum, spec), partial(einsum_dx, spec))


def tap(module, x, w, plain, product, grad_x):
    """A linear layer's product of `module`: plain(x, w) when the model runs without a `taps`
    collection; with one (made here, zeros, if it is mutable: `zero_taps`), `tapped`: product(x, w)
    forward, grad_x(dY, X, A) its input gradient, and (X, dY) the tap's cotangent. `plain` has the
    whole backward (`product` and the W of `weight_gradients` together)."""
    if not tapping(module):
        return plain(x, w)
    return tapped(product, grad_x, x, w, tap_value(module, x, jax.eval_shape(product, x, w)))


def tapping(module) -> bool:
    """Whether `module` runs with a `taps` collection (or is making one: `zero_taps`)."""
    making = module.is_mutable_collection(COLLECTION) and not module.is_initializing()   # init makes all mutable
    return module.has_variable(COLLECTION, NAME) or making


def tap_value(module, x, y):
    """`module`'s tap: the (X, Y)-shaped pair of zeros `x`, `y` (arrays or shapes) give, made if absent."""
    return module.variable(COLLECTION, NAME, lambda: (jnp.zeros(x.shape, x.dtype), jnp.zeros(y.shape, y.dtype))).value


def split_weights(params) -> tuple[dict, dict]:
    """A layer tree -> (its matmul kernels, the rest), flat {path: leaf} dicts; `join_weights` inverts."""
    flat = flatten_dict(params)
    kernels = {k: w for k, w in flat.items() if k[-1] == "kernel"}
    return kernels, {k: w for k, w in flat.items() if k[-1] != "kernel"}


def join_weights(kernels: dict, rest: dict) -> dict:
    return unflatten_dict({**kernels, **rest})


def local_weight_gradient(x, dy):
    """dA [*in, *out] = sum over (b, s) of X^T dY, X [b, s, *in] and dY [b, s, *out] whole on the device (1d)."""
    return jnp.tensordot(x, dy, axes=([0, 1], [0, 1]))


def weight_gradients(tap_cotangents, weight_gradient=local_weight_gradient) -> dict:
    """W: {kernel path: dA [n, *in, *out]} from the taps' cotangents (X [n, b, s, *in], dY [n, b, s, *out])
    of a run of n layers: a layer's `weight_gradient` (X, dY) -> dA, batched over n (the 2D grid's,
    `grid_ops.block_dA`, communicates)."""
    grads = {}
    for path, (x, dy) in flatten_dict(tap_cotangents).items():
        assert path[-1] == NAME, path
        grads[path[:-1] + ("kernel",)] = jax.vmap(weight_gradient)(x, dy)
    return grads

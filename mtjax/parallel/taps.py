"""The split backward's hook in the linear layers: taps that hand out each matmul's X and dY.

Shape legend: n layers of a run, b micro-batch, s sequence, E_r this rank's experts, R an expert's
rows, G the blocks of E_r experts a grouped weight is stored as; a linear layer computes
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

Grouped products (a mixture of experts, `model/moe.py`): Y [E_r, R, out] = X [E_r, R, in] .
A [E_r, in, out], one matrix per expert, contracting `in` batched over the experts. Their tap is
(X, Y, P) with P [G] a one-hot of where this rank's E_r experts sit among the G E_r the weight is
stored with (G = 1 when stored split: P = [1]); its cotangent (X, dY, P) lets W,
`grouped_weight_gradient`, place dA = X_j^T dY_j (expert j, over its R rows) in the stored
shape, zero outside this rank's experts, without knowing the mesh. A linear layer whose product
uses one entry j of its stored weight along one axis (k < t replicated kv heads: head j of [h, k,
d], the kernel sliced before the product) is tapped the same way, (X, Y, P) with P a one-hot mask
[1, k, 1] of the kernel's rank, and W puts X^T dY [h, 1, d] at j (`placed_weight_gradient`).

A tap lives in the flax collection `taps` at its weight's own path (the module's scope, the
parameter's name: `kernel` for a linear layer), so the tapped weights are the paths the taps tree
has (`split_weights`): a model applied without that collection runs the plain product (`tap`).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

COLLECTION, NAME = "taps", "kernel"   # NAME: a linear layer's weight (and so its tap)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def tapped(product, grad_x, x, w, tap, place):
    """product(x, w); the backward returns dX = grad_x(dY, X, A), zero for A and `place`, and
    (X, dY, *place) as `tap`'s cotangent (its forward keeps x, w and place: the plain product's
    residuals, and the grouped products' one-hot, `()` for a linear layer)."""
    del tap, place
    return product(x, w)


def _forward(product, grad_x, x, w, tap, place):
    del tap
    return product(x, w), (x, w, place)


def _backward(product, grad_x, residuals, dy):
    x, w, place = residuals
    return (grad_x(dy, x, w).astype(x.dtype), jnp.zeros_like(w), (x, dy.astype(x.dtype), *place),
            jax.tree.map(jnp.zeros_like, place))


tapped.defvjp(_forward, _backward)


def einsum_dx(spec: str, dy, x, w):
    """dX = dY A^T of einsum(spec, x, w): its pullback in x alone (w is a constant here)."""
    _, pullback = jax.vjp(lambda x: jnp.einsum(spec, x, w), x)
    return pullback(dy)[0]


def linear(module, spec: str, x, w, name: str = NAME, place=()):
    """The one matmul of a 1d linear layer `module`: einsum(spec, x, w), tapped (`tap`) at the weight
    `name`; `place` (a one-hot mask, module docstring) when w is one entry of the stored weight."""
    return tap(module, x, w, partial(jnp.einsum, spec), partial(jnp.einsum, spec), partial(einsum_dx, spec), name,
               place)


@jax.custom_vjp
def with_place(tap, place):
    """The (X, Y) zeros of a tap (X, Y, P), for a product that hands its tap the cotangent (X, dY)
    (the sequence-parallel column products, `layers.column_parallel`); that cotangent comes back
    as (X, dY, place), as `tapped` makes it."""
    return tap[:2]


def _with_place_forward(tap, place):
    return tap[:2], place


def _with_place_backward(place, cotangent):
    return (*cotangent, place), jnp.zeros_like(place)


with_place.defvjp(_with_place_forward, _with_place_backward)


GROUPED = "eni,eio->eno"


def grouped(module, name: str, x, w, place):
    """Y [E_r, R, out] = X_j A_j per expert j: x [E_r, R, in], w [E_r, in, out] (this rank's experts of
    the weight `name`), place [G] (one-hot, module docstring); tapped (`tap`) with (X, Y, P)."""
    return tap(module, x, w, partial(jnp.einsum, GROUPED), partial(jnp.einsum, GROUPED),
               partial(einsum_dx, GROUPED), name, (place,))


def tap(module, x, w, plain, product, grad_x, name: str = NAME, place=()):
    """A linear layer's product of `module`: plain(x, w) when the model runs without a `taps`
    collection; with one (made here, zeros, if it is mutable: `zero_taps`), `tapped`: product(x, w)
    forward, grad_x(dY, X, A) its input gradient, and (X, dY, *place) the tap `name`'s cotangent.
    `plain` has the whole backward (`product` and the W of `weight_gradients` together)."""
    if not tapping(module, name):
        return plain(x, w)
    return tapped(product, grad_x, x, w, tap_value(module, x, jax.eval_shape(product, x, w), name, place), place)


def tapping(module, name: str = NAME) -> bool:
    """Whether `module` runs with a `taps` collection (or is making one: `zero_taps`)."""
    making = module.is_mutable_collection(COLLECTION) and not module.is_initializing()   # init makes all mutable
    return module.has_variable(COLLECTION, name) or making


def tap_value(module, x, y, name: str = NAME, place=()):
    """`module`'s tap `name`: the (X, Y, *place)-shaped zeros `x`, `y` and `place` (arrays or shapes)
    give, made if absent."""
    return module.variable(COLLECTION, name, lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in (x, y, *place))).value


def split_weights(params, taps) -> tuple[dict, dict]:
    """A layer tree and its taps -> (its tapped matmul weights, the rest), flat {path: leaf} dicts;
    `join_weights` inverts."""
    flat, tapped_paths = flatten_dict(params), flatten_dict(taps)
    kernels = {k: w for k, w in flat.items() if k in tapped_paths}
    assert len(kernels) == len(tapped_paths), set(tapped_paths) - set(kernels)
    return kernels, {k: w for k, w in flat.items() if k not in tapped_paths}


def join_weights(kernels: dict, rest: dict) -> dict:
    return unflatten_dict({**kernels, **rest})


def local_weight_gradient(x, dy):
    """dA [*in, *out] = sum over (b, s) of X^T dY, X [b, s, *in] and dY [b, s, *out] whole on the device (1d)."""
    return jnp.tensordot(x, dy, axes=([0, 1], [0, 1]))


def grouped_weight_gradient(x, dy, place):
    """dA [G E_r, in, out] of a grouped product: X_j^T dY_j per expert j, summed over its R rows
    (x [E_r, R, in], dy [E_r, R, out]), in block `place` [G] (one-hot) of the G, zero elsewhere."""
    local = jnp.einsum("eni,eno->eio", x, dy)
    if place.shape[0] == 1:     # stored split: the rank's own experts are the whole leaf
        return local
    return (place.astype(local.dtype)[:, None, None, None] * local[None]).reshape((-1,) + local.shape[1:])


def placed_weight_gradient(x, dy, place, weight_gradient=local_weight_gradient):
    """dA of a linear layer whose product used one entry j of its stored kernel along one axis
    (k < t replicated kv heads, `layers.ColumnParallelLinear.pick_t`): X^T dY [*in, .., 1, ..]
    times `place` [1, .., n, .., 1] (one-hot at j): the stored shape, zero outside entry j."""
    local = weight_gradient(x, dy)
    return place.astype(local.dtype) * local


def weight_gradients(tap_cotangents, weight_gradient=local_weight_gradient) -> dict:
    """W: {weight path: dA [n, ...]} from the taps' cotangents of a run of n layers, each batched
    over n: a linear layer's (X [n, b, s, *in], dY [n, b, s, *out]) by `weight_gradient` (the 2D
    grid's, `grid_ops.block_dA`, communicates); a grouped product's (X, dY, P [n, G]) by
    `grouped_weight_gradient`; a linear layer's with a place (X, dY, P [n, 1, .., k, .., 1]: the
    kernel's rank, at least 2) by `placed_weight_gradient`."""
    grads = {}
    for path, cotangent in flatten_dict(tap_cotangents).items():
        if len(cotangent) == 2:
            gradient = weight_gradient
        elif cotangent[2].ndim == 2:
            gradient = grouped_weight_gradient
        else:
            gradient = partial(placed_weight_gradient, weight_gradient=weight_gradient)
        grads[path] = jax.vmap(gradient)(*cotangent)
    return grads

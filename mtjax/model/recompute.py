"""Recomputing a part of a layer in its backward, whatever the layer's own checkpoint policy says.

`jax.checkpoint(fn, policy=nothing_saveable)` nested inside the layer's checkpoint does not do
this: the enclosing policy decides what the nested one saves (measured: an exact GeLU under
`recompute=none`'s save-all policy kept four [b, s, f/t] tensors, not its one input). A
`custom_vjp` states its residuals itself, so no enclosing policy can add to them.
"""
from __future__ import annotations

import jax


def saving_inputs_only(fn):
    """`fn` whose backward keeps only its (array) inputs: the forward runs `fn`, the backward runs
    it again under `jax.vjp` and pulls the cotangent through, so the gradients are autodiff's own.
    `fn` takes positional array arguments (pytrees, PRNG keys and None included) and closes over
    nothing traced."""
    @jax.custom_vjp
    def run(*args):
        return fn(*args)

    def forward(*args):
        return fn(*args), args

    def backward(args, cotangent):
        return jax.vjp(fn, *args)[1](cotangent)

    run.defvjp(forward, backward)
    return run

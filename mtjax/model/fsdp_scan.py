"""The layer scan under FSDP: each layer's weights gathered just before it runs, the next layer's
gather issued one layer ahead, and each layer's gradient reduce-scattered in the backward
(`parallel/fsdp.py` states the layout and the collectives).

Shape legend: n layers of the run, S_i layer i's shard (leaves [..., size_k / r, ...]), W_i its
gathered weights, x the residual stream [b, s(/t), h].

A `jax.custom_vjp` over the whole run, because plain autodiff of a scan that carries W_{i+1}
(the prefetch) saves every carried W_i for the backward: n gathered layers, the memory FSDP
exists to avoid. Here the forward and the backward are two scans written out:

    forward  i = 0 .. n-1:  carry (x, W_i);  W_{i+1} = gather(S_{i+1})   (issued first: prefetch)
                            x, pullback_i = vjp(layer, x, W_i)   (under the recompute policy)
                            stash_i = pullback_i's residuals less W_i (they are W_i's identities)
    backward i = n-1 .. 0:  carry (dx, W_i, dW_{i+1});  W_{i-1} = gather(S_{i-1})   (prefetch)
                            dS_{i+1} = psum_scatter(dW_{i+1})   (overlaps layer i's backward)
                            dx, dW_i = pullback_i(dx), rebuilt from stash_i and W_i

so at any time a device holds W_i and W_{i±1} gathered and one layer's unreduced gradient. Each
scan gathers one layer more than it runs (the prefetch of its last iteration, index clamped: a
collective under a `lax.cond` could not overlap the layer), and the backward's first
reduce-scatter is of zeros; `docs/design.md` ("FSDP") counts them. Under `full` recomputation
the stash is the layer's input only and pullback_i recomputes the layer from the W_i gathered
for it: one gather serves the recompute and the backward. With `keep_gathered` the stash keeps
W_i too and the backward gathers nothing. A pipelined step that gathers each stage's layers once
(`Fsdp.per_step`) does not run this scan: its layers arrive gathered (`fsdp.scan_fsdp`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.parallel.fsdp import Fsdp
from mtjax.parallel.taps import COLLECTION as TAPS


def _layer(tree, i):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _shapes(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _zeros(shapes):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def fsdp_scan(block, fsdp: Fsdp, shards, keys, x, rope, policy, taps=None):
    """x through the n layers whose shards are `shards` (leaves [n, ...]) -> x; as `scan_layers`
    (keys[i] layer i's dropout key or None, `policy` its checkpoint policy, taps[i] its taps), with
    the weights gathered and the gradients reduce-scattered per layer (module docstring)."""
    scan = _Scan(block, fsdp, policy, jax.tree.leaves(shards)[0].shape[0], _shapes(x), _shapes(taps))

    @jax.custom_vjp
    def stack(shards, x, taps, keys, rope):
        return scan.forward(shards, x, taps, keys, rope, residuals=False)[0]

    def stack_fwd(shards, x, taps, keys, rope):
        y, stash = scan.forward(shards, x, taps, keys, rope, residuals=True)
        return y, (shards, stash, keys, rope)

    stack.defvjp(stack_fwd, scan.backward)
    return stack(shards, x, taps, keys, rope)


class _Scan:
    """The two scans of one run (static: the block, the layout, the policy, n and the shapes)."""

    def __init__(self, block, fsdp: Fsdp, policy, n: int, x_shape, tap_shapes):
        self.fsdp, self.n, self.x_shape, self.tap_shapes = fsdp, n, x_shape, tap_shapes

        def run(x, w, tap, key, rope):
            rngs = {} if key is None else {"dropout": key}
            variables = {"params": w} if tap is None else {"params": w, TAPS: tap}
            return block.apply(variables, x, rope, None, None, rngs=rngs)[0]
        self.run = run if policy is None else jax.checkpoint(run, policy=policy, prevent_cse=False)

    def vjp(self, x, w, tap, key, rope):
        return jax.vjp(lambda x, w, tap: self.run(x, w, tap, key, rope), x, w, tap)

    def kept(self, pullback, w, rope) -> list[int]:
        """Indices of the pullback's residuals to stash: all but W_i's (and rope's) own leaves."""
        known = [] if self.fsdp.keep_gathered else jax.tree.leaves((w, rope))
        return [k for k, leaf in enumerate(jax.tree.leaves(pullback)) if not any(leaf is a for a in known)]

    def forward(self, shards, x, taps, keys, rope, residuals: bool):
        """-> (y, the stacked stash [n, ...] or None)."""
        fsdp, n = self.fsdp, self.n

        def body(carry, xs):
            x, w = carry
            i, tap, key = xs
            w_next = fsdp.gather(_layer(shards, jnp.minimum(i + 1, n - 1)))     # prefetch W_{i+1}
            if not residuals:
                return (self.run(x, w, tap, key, rope), w_next), None
            y, pullback = self.vjp(x, w, tap, key, rope)
            leaves = jax.tree.leaves(pullback)
            return (y, w_next), [leaves[k] for k in self.kept(pullback, w, rope)]
        (y, _), stash = lax.scan(body, (x, fsdp.gather(_layer(shards, 0))), (jnp.arange(n), taps, keys))
        return y, stash

    def backward(self, res, dy):
        """-> cotangents of (shards, x, taps, keys, rope): the reduce-scattered dS, dx, the taps'."""
        shards, stash, keys, rope = res
        fsdp, n, keep = self.fsdp, self.n, self.fsdp.keep_gathered
        like = _layer(shards, 0)
        dw_zero = _zeros(jax.eval_shape(lambda s: fsdp.gather(s), like))

        def body(carry, xs):
            dy, w, pending = carry
            i, stashed, tap, key = xs
            w_prev = None if keep else fsdp.gather(_layer(shards, jnp.maximum(i - 1, 0)))   # prefetch W_{i-1}
            d_next = fsdp.scatter(pending, like)                                  # dS_{i+1}
            w_trace = dw_zero if keep else w
            _, pullback = self.vjp(_zeros(self.x_shape), w_trace, tap, key, rope)
            leaves, treedef = jax.tree.flatten(pullback)
            for k, r in zip(self.kept(pullback, w_trace, rope), stashed, strict=True):
                leaves[k] = r
            dx, dw, dtap = jax.tree.unflatten(treedef, leaves)(dy)
            return (dx, w_prev, dw), (d_next, dtap)
        w_last = None if keep else fsdp.gather(_layer(shards, n - 1))
        (dx, _, first), (d_rest, dtaps) = lax.scan(body, (dy, w_last, dw_zero),
                                                   (jnp.arange(n), stash, _zeros(self.tap_shapes), keys),
                                                   reverse=True)
        d_first = fsdp.scatter(first, like)                                       # dS_0
        d_shards = jax.tree.map(lambda a, r: jnp.concatenate([a[None], r[:-1]]), d_first, d_rest)
        return d_shards, dx, dtaps, None, None

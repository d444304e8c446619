"""The layer scan under FSDP: each layer's weights gathered just before it runs, the next layer's
gather issued one layer ahead, and each layer's gradient reduce-scattered in the backward
(`parallel/fsdp.py` states the layout and the collectives).

Shape legend: n layers of the run, S_i layer i's shard (leaves [..., size_k / r, ...]), W_i its
gathered weights, x the residual stream [b, s(/t), h].

A `jax.custom_vjp` over the whole run, because plain autodiff of a scan that carries W_{i+1}
(the prefetch) saves every carried W_i for the backward: n gathered layers, the memory FSDP
exists to avoid. Here the forward and the backward are two loops written out, their stacks (the
stash, dS, the taps' cotangents) written a row per layer into `lax.empty` buffers, as
`stash_scan`'s (a scan's stacked outputs start from zeros):

    forward  i = 0 .. n-1:  carry (x, W_i);  W_{i+1} = gather(S_{i+1})   (issued first: prefetch)
                            x, pullback_i = vjp(layer, x, W_i)   (under the recompute policy)
                            stash_i = pullback_i's residuals less W_i (they are W_i's identities)
    backward i = n-1 .. 0:  carry (dx, W_i, dW_{i+1});  W_{i-1} = gather(S_{i-1})   (prefetch)
                            dS_{i+1} = psum_scatter(dW_{i+1})   (overlaps layer i's backward)
                            dx, dW_i = pullback_i(dx), rebuilt from stash_i and W_i

so at any time a device holds W_i and W_{i±1} gathered and one layer's unreduced gradient. Each
loop's first gather (W_0, and the backward's W_{n-1}) reads the micro-batch's x or dy (`_after`):
XLA neither hoists it out of the micro-batch loop nor runs the backward's during the forward. With
half batches (`block.halved`) an iteration runs a unit of g layers, W_i and dS_i its g layers',
and the extra gather and the zeros' reduce-scatter below are a unit's (g layers) each. Each
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

from mtjax.model.block import halved
from mtjax.model.stash_scan import empty_stack, layer_rows, put_row, put_rows
from mtjax.parallel.fsdp import Fsdp
from mtjax.parallel.taps import COLLECTION as TAPS


def _layer(tree, i):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _shapes(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _zeros(shapes):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _row(tree, i):
    """Row i of a stacked tree, or None for none (no taps, no keys)."""
    return None if tree is None else _layer(tree, i)


def _after(anchor):
    """0, as an int32 that XLA cannot compute before `anchor` (the micro-batch's x, or dy): the
    index of a loop's first gather, made to read the micro-batch. Read off the shards alone, that
    gather is the same in every micro-batch, and XLA hoists it out of the micro-batch loop, where
    the gathered layer lives for the whole step and the layer loop's carry starts from a copy of
    it; and the backward's first gather, free to run early, was scheduled before the forward and
    held through it (compiled data-4 step, XLA:CPU, l = 4, m = 2: 10.19 MB, 7.83 MB with this).
    The clamp of a bit pattern to [0, 0] is 0 whatever the value; XLA does not fold it."""
    probe = lax.bitcast_convert_type(anchor.reshape(-1)[0].astype(jnp.float32), jnp.int32)
    return jnp.clip(probe, 0, 0)


def fsdp_scan(block, fsdp: Fsdp, shards, keys, x, rope, policy, taps=None, segments=None, halves: int = 0):
    """x through the n layers whose shards are `shards` (leaves [n, ...]) -> x; as `scan_layers`
    (keys[i] layer i's dropout key or None, `policy` its checkpoint policy, taps[i] its taps,
    `segments` packed rows' document ids [b, s_row] or None), with the weights gathered and the
    gradients reduce-scattered per layer (module docstring). `halves` g > 0: each micro-batch as
    two halves interleaved (`block.halved`), g layers a unit: an iteration gathers the next unit's
    g layers and runs this one's (no taps: half batches are refused with the split backward)."""
    n = jax.tree.leaves(shards)[0].shape[0]
    scan = _Scan(block, fsdp, policy, n, _shapes(x), _shapes(taps), halves)

    @jax.custom_vjp
    def stack(shards, x, taps, keys, rope, segments):
        return scan.forward(shards, x, taps, keys, (rope, segments), residuals=False)[0]

    def stack_fwd(shards, x, taps, keys, rope, segments):
        y, stash = scan.forward(shards, x, taps, keys, (rope, segments), residuals=True)
        return y, (shards, stash, keys, (rope, segments))

    stack.defvjp(stack_fwd, scan.backward)
    return stack(shards, x, taps, keys, rope, segments)


class _Scan:
    """The two loops of one run (static: the block, the layout, the policy, the shapes): n/g
    iterations of a unit of g layers (g = 1 but with half batches), whose weights, keys and
    gradients are g-tuples of layer rows at g > 1 (`stash_scan.layer_rows`)."""

    def __init__(self, block, fsdp: Fsdp, policy, layers: int, x_shape, tap_shapes, halves: int = 0):
        self.fsdp, self.x_shape, self.g = fsdp, x_shape, max(halves, 1)
        self.layers, self.n = layers, layers // self.g
        self.tap_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tap_shapes)  # one layer's

        sequence = bool(halves) and block.ctx.sequence_halves

        def layer(x, w, tap, key, shared, prefix=None):  # shared: (rope, segments), what every layer reads alike
            rngs = {} if key is None else {"dropout": key}
            variables = {"params": w} if tap is None else {"params": w, TAPS: tap}
            if sequence:                              # (sequence halves: with its K, V, `block.halved`)
                return block.apply(variables, x, shared[0], None, None, shared[1], prefix, True, rngs=rngs)
            return block.apply(variables, x, shared[0], None, None, shared[1], rngs=rngs)[0]
        layer = layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=False)
        self.run = layer
        if halves:      # each half's backward keeps what the policy saves
            unit = halved(lambda x, w, key, rope, segments, *prefix: layer(x, w, None, key, (rope, segments), *prefix),
                          self.g, sequence)
            self.run = lambda x, w, tap, key, shared: unit(x, w, key, *shared)

    def unit(self, tree, u):
        """Iteration u's rows of a stacked tree: row u, or a g-tuple of layer rows; None stays None."""
        return layer_rows(tree, u, self.g)

    def gather(self, rows):
        return self.fsdp.gather(rows) if self.g == 1 else tuple(self.fsdp.gather(r) for r in rows)

    def scatter(self, grads, like):
        return self.fsdp.scatter(grads, like) if self.g == 1 else tuple(self.fsdp.scatter(d, like) for d in grads)

    def vjp(self, x, w, tap, key, shared):
        return jax.vjp(lambda x, w, tap: self.run(x, w, tap, key, shared), x, w, tap)

    def kept(self, pullback, w, shared) -> list[int]:
        """Indices of the pullback's residuals to stash: all but W_i's (and the shared inputs') own leaves."""
        known = [] if self.fsdp.keep_gathered else jax.tree.leaves((w, shared))
        return [k for k, leaf in enumerate(jax.tree.leaves(pullback)) if not any(leaf is a for a in known)]

    def residuals(self, x, w, tap, key, shared):
        """-> (y, the pullback's leaves to stash)."""
        y, pullback = self.vjp(x, w, tap, key, shared)
        leaves = jax.tree.leaves(pullback)
        return y, [leaves[k] for k in self.kept(pullback, w, shared)]

    def forward(self, shards, x, taps, keys, shared, residuals: bool):
        """-> (y, the stacked stash [n, ...] or None). The stash is written row by row into
        uninitialised buffers (`lax.empty`), as `stash_scan`'s: a scan's stacked outputs start
        from zeros, a pass over the whole stash per micro-batch."""
        n = self.n
        w0 = self.gather(self.unit(shards, _after(x)))        # S_0 -> W_0, per micro-batch (`_after`)
        shapes = None
        if residuals:
            shapes = jax.eval_shape(lambda x, w, tap, key: self.residuals(x, w, tap, key, shared)[1],
                                    x, w0, _row(taps, 0), self.unit(keys, 0))

        def body(i, carry):
            x, w, stash = carry
            tap, key = _row(taps, i), self.unit(keys, i)
            w_next = self.gather(self.unit(shards, jnp.minimum(i + 1, n - 1)))     # prefetch: S_{i+1} -> W_{i+1}
            if not residuals:
                return self.run(x, w, tap, key, shared), w_next, stash
            y, rows = self.residuals(x, w, tap, key, shared)
            return y, w_next, put_row(stash, i, rows)
        stash = None if shapes is None else empty_stack(n, shapes)
        y, _, stash = lax.fori_loop(0, n, body, (x, w0, stash))
        return y, stash

    def backward(self, res, dy):
        """-> cotangents of (shards, x, taps, keys, rope, segments): the reduce-scattered dS, dx,
        the taps'."""
        shards, stash, keys, shared = res
        n, keep = self.n, self.fsdp.keep_gathered
        like = _layer(shards, 0)                                                 # one layer's shard
        dw_zero = _zeros(jax.eval_shape(lambda s: self.gather(s), self.unit(shards, 0)))
        tap_like = None if self.tap_shapes is None else _zeros(self.tap_shapes)

        def body(j, carry):
            i = n - 1 - j
            dy, w, pending, d_shards, dtaps = carry
            w_prev = None if keep else self.gather(self.unit(shards, jnp.maximum(i - 1, 0)))   # S_{i-1} -> W_{i-1}
            # dW_{i+1} -> dS_{i+1}, into rows i + 1 (at i = n - 1 the zeros' scatter lands on rows n - 1, which
            # the next iteration overwrites with dS_{n-1}; dS_0 is written after the loop)
            d_shards = put_rows(d_shards, jnp.minimum(i + 1, n - 1), (self.scatter(pending, like),), self.g)
            w_trace = dw_zero if keep else w
            key = self.unit(keys, i)
            _, pullback = self.vjp(_zeros(self.x_shape), w_trace, tap_like, key, shared)
            leaves, treedef = jax.tree.flatten(pullback)
            for k, r in zip(self.kept(pullback, w_trace, shared), _layer(stash, i), strict=True):
                leaves[k] = r
            dx, dw, dtap = jax.tree.unflatten(treedef, leaves)(dy)
            dtaps = dtaps if dtap is None else put_row(dtaps, i, dtap)
            return dx, w_prev, dw, d_shards, dtaps
        w_last = None if keep else self.gather(self.unit(shards, n - 1 + _after(dy)))   # once dy exists
        dtaps = None if self.tap_shapes is None else empty_stack(n, self.tap_shapes)
        dx, _, first, d_shards, dtaps = lax.fori_loop(
            0, n, body, (dy, w_last, dw_zero, empty_stack(self.layers, (like,)), dtaps))
        d_shards, = put_rows(d_shards, 0, (self.scatter(first, like),), self.g)   # dW_0 -> dS_0
        return d_shards, dx, dtaps, None, None, None

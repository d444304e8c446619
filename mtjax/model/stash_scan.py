"""The training layer scan with its stash in uninitialised buffers.

Shape legend: n layers of the run, W_k layer k's weights (leaves [...]; stacked [n, ...]), x the
residual stream [b, s(/t), h], r_k layer k's residuals (what its recompute policy saves).

Differentiating `lax.scan` over the layers makes JAX stack two things per step: the forward's
residuals r_k into [n, ...] arrays, and the backward's weight gradients dW_k into [n, ...]. JAX
starts every such stack from zeros (`lax.empty2`: jax 0.10's scan does not allocate without
initialising), and XLA merges equal zero-broadcasts into one and copies it per stack, so each
stack is written in full, and often read and written again, before the loop fills it row by
row: at gpt1.3b, b 8, one H100, 30 of 589 predicted ms (the stash is 11 GB per micro-batch).
Here the two loops are written out as one `jax.custom_vjp`:

    forward  k = 0 .. n-1:   x, pullback_k = vjp(layer, x, W_k)   (under the recompute policy)
                             R[k] = pullback_k's residuals less W_k and the rotary tables
    backward k = n-1 .. 0:   dx, dW[k] = pullback_k(dx), rebuilt from R[k] and W_k

with R and dW allocated by `lax.empty` (XLA's AllocateBuffer on GPU: no pass at all; zeros on
the CPU) and written one row per iteration, in place. The values are the scan's: the same layer
function on the same inputs. The run's weights are its `params`, read again in the backward, so
a caller's `jax.vjp` (a pipeline stage) sees them among the residuals as the parameters.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.interpreters.partial_eval import dce_jaxpr   # jax has no public name for it

MAIN_GRAD = "main_grad"     # the variables collection of the fp32 weight-gradient sums (Megatron's main_grad)


def layer_row(tree, k):
    """Row k of every leaf of a stacked tree ([n, ...] -> [...]), k traced."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, k, keepdims=False), tree)


def layer_rows(tree, k, group: int):
    """Iteration k's layers of a stacked tree: row k (group 1), or the tuple of rows
    k g .. k g + g - 1 (a group of g layers run as one, `block.halved`); None stays None."""
    if tree is None or group == 1:
        return None if tree is None else layer_row(tree, k)
    return tuple(layer_row(tree, k * group + j) for j in range(group))


def put_rows(buffers, k, rows: tuple, group: int):
    """`put_row` for iteration k's layers: `rows` a tuple of trees each in `layer_rows`' form."""
    if group == 1:
        return put_row(buffers, k, rows)
    for j in range(group):
        buffers = put_row(buffers, k * group + j, tuple(None if r is None else r[j] for r in rows))
    return buffers


def put_row(buffers, k, rows):
    """Row k of every leaf of a stacked tree set to `rows` (in place), k traced."""
    return jax.tree.map(lambda a, r: lax.dynamic_update_index_in_dim(a, r.astype(a.dtype), k, 0), buffers, rows)


def add_rows(sums, k, rows, group: int):
    """sums[k g : k g + g] += rows (iteration k's `layer_rows` form), in place: one read and one
    write of the g rows per leaf. (Read row by row, a row's read could follow another row's
    write, and XLA copies the whole stack to keep the read's value.)"""
    rows = rows if group > 1 else (rows,)

    def add(total, *new):                   # total [n g, ...], new g x [...]
        block = lax.dynamic_slice_in_dim(total, k * group, group)
        return lax.dynamic_update_slice_in_dim(total, block + jnp.stack(new).astype(total.dtype), k * group, 0)
    return jax.tree.map(add, sums, *rows)


def empty_stack(n: int, shapes):
    """[n, ...] uninitialised buffers shaped as `shapes`' leaves (`lax.empty`)."""
    return jax.tree.map(lambda a: lax.empty((n, *a.shape), a.dtype), shapes)


def _invariant(fn, *args) -> list[bool]:
    """Per output leaf of fn(*args): True if it depends on none of `args` (only on what fn closes
    over), by dead-code elimination of fn's jaxpr for that output alone (JAX's rules see inside
    checkpoints and jitted calls)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [not any(dce_jaxpr(jaxpr, [j == i for j in range(len(jaxpr.outvars))])[1])
            for i in range(len(jaxpr.outvars))]


def stash_scan(run, params, keys, x, rope, segments=None, sink=None, group: int = 1, main_grad=None):
    """x through the n layers whose stacked weights are `params` (leaves [n, ...]) -> x, as
    `lax.scan` over run(x, W_k, keys[k], rope, segments) (keys None when deterministic), with
    the backward described in the module docstring. `sink` = (fn, slots stacked [n, ...]): layer
    k runs with weights fn(W_k, slots[k]) (`scan_layers`' data-reduction sink); the slots'
    cotangents come back stacked. `group` g > 1 (dividing n): n/g iterations, `run` called on g
    consecutive layers at once, their weights and keys as g-tuples (`layer_rows`).

    `main_grad` (fp32, shaped as `params`; not with a sink): Megatron's gradient accumulation
    fusion. The backward adds each layer's weight gradient into row k of `main_grad` where it
    would write row k of a fresh dW stack, and returns the sums as `main_grad`'s cotangent and
    none for `params`: main_grad + sum over the micro-batch's dW_k, one pass per row instead of a
    written stack and a separate sum over it (`training/computed_weights.py`)."""
    assert main_grad is None or sink is None, "the data-reduction sink takes the weight gradients itself"
    assert main_grad is None or jax.tree.map(jnp.shape, main_grad) == jax.tree.map(jnp.shape, params), \
        "main_grad is shaped as this run's weights"
    fn, slots = sink if sink is not None else (None, None)
    loops = _Loops(run, fn, jax.tree.leaves(params)[0].shape[0] // group, jax.ShapeDtypeStruct(x.shape, x.dtype),
                   group)

    @jax.custom_vjp
    def stack(params, slots, x, keys, rope, segments, main_grad):
        def body(k, x):
            return loops.layer(x, *loops.rows(params, slots, keys, k), rope, segments)
        return lax.fori_loop(0, loops.n, body, x)

    stack.defvjp(loops.forward, loops.backward)
    return stack(params, slots, x, keys, rope, segments, main_grad)


class _Loops:
    """The forward and backward loops of one run of n layers in n/g iterations of g layers each
    (static: the layer, the sink, the iteration count `self.n` = n/g, g and x's shape)."""

    def __init__(self, run, sink, n: int, x_shape, group: int = 1):
        self.run, self.sink, self.n, self.x_shape, self.group = run, sink, n, x_shape, group
        self.invariant: list[bool] = []     # per stashed leaf: kept once, not per layer (set by `forward`)

    def rows(self, params, slots, keys, k):
        """Iteration k's (weights, slots, keys), each a row or a g-tuple of rows (`layer_rows`)."""
        return tuple(layer_rows(tree, k, self.group) for tree in (params, slots, keys))

    def layer(self, x, w, slot, key, rope, segments):
        if self.sink is not None:        # outside the checkpoint, as `scan_layers`
            w = self.sink(w, slot) if self.group == 1 else tuple(map(self.sink, w, slot))
        return self.run(x, w, key, rope, segments)

    def vjp(self, x, w, slot, key, rope, segments):
        return jax.vjp(lambda x, w, slot: self.layer(x, w, slot, key, rope, segments), x, w, slot)

    @staticmethod
    def kept(pullback, known) -> list[int]:
        """The pullback's leaves to stash: all but those of `known` (W_k, its slots, the rotary
        tables), which the backward has at hand."""
        known = jax.tree.leaves(known)
        return [i for i, leaf in enumerate(jax.tree.leaves(pullback)) if not any(leaf is a for a in known)]

    def residuals(self, x, w, slot, key, rope, segments) -> tuple:
        y, pullback = self.vjp(x, w, slot, key, rope, segments)
        leaves = jax.tree.leaves(pullback)
        return y, [leaves[i] for i in self.kept(pullback, (w, slot, rope))]

    def forward(self, params, slots, x, keys, rope, segments, main_grad):
        """-> (y, residuals). Residuals that depend on no layer's input (masks and tables made from
        rope, segments or constants) are kept once, from layer 0's trace, as `lax.scan` hoists
        them; the rest go row by row into the [n, ...] stash."""
        w0, s0, key0 = self.rows(params, slots, keys, 0)
        fixed = _invariant(lambda x, w, s, key: self.residuals(x, w, s, key, rope, segments)[1], x, w0, s0, key0)
        self.invariant[:] = fixed
        first = self.residuals(x, w0, s0, key0, rope, segments)[1]     # dead but for its fixed leaves
        moving = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r, f in zip(first, fixed) if not f]

        def body(k, carry):
            x, stash = carry
            y, rows = self.residuals(x, *self.rows(params, slots, keys, k), rope, segments)
            return y, put_row(stash, k, [r for r, f in zip(rows, fixed) if not f])
        y, stash = lax.fori_loop(0, self.n, body, (x, empty_stack(self.n, moving)))
        return y, (params, slots, stash, [r for r, f in zip(first, fixed) if f], keys, rope, segments, main_grad)

    def backward(self, res, dy):
        """-> cotangents of (params, slots, x, keys, rope, segments, main_grad): dW and the slots'
        stacked, dx; with `main_grad`, main_grad + dW for it and none for params."""
        params, slots, stash, once, keys, rope, segments, main_grad = res

        def body(j, carry):
            dy, grads = carry
            k = self.n - 1 - j
            (w, slot, key) = self.rows(params, slots, keys, k)
            x_like = jnp.zeros(self.x_shape.shape, self.x_shape.dtype)
            _, pullback = self.vjp(x_like, w, slot, key, rope, segments)   # its structure only
            leaves, treedef = jax.tree.flatten(pullback)
            rows, fixed = iter(layer_row(stash, k)), iter(once)
            for i, is_fixed in zip(self.kept(pullback, (w, slot, rope)), self.invariant, strict=True):
                leaves[i] = next(fixed) if is_fixed else next(rows)
            dx, dw, d_slot = jax.tree.unflatten(treedef, leaves)(dy)
            if main_grad is not None:       # (no sink: no slots)
                return dx, (add_rows(grads[0], k, dw, self.group), grads[1])
            return dx, put_rows(grads, k, (dw, d_slot), self.group)
        like = (layer_row(params, 0), layer_row(slots, 0))
        stacks = empty_stack(self.n * self.group, like) if main_grad is None else (main_grad, None)   # (no slots)
        dx, (grads, d_slots) = lax.fori_loop(0, self.n, body, (dy, stacks))
        if main_grad is not None:
            return None, d_slots, dx, None, None, None, grads
        return grads, d_slots, dx, None, None, None, None

"""The work of one chunk on a stage: its forward under `jax.vjp`, its backward from the stash,
the embedding's backward, and where a chunk's gradients land in the stage's sums.

A stage's `layers` leaves hold its v chunks of L layers ([v L, ...], `layer_order.py`); chunk c
is rows [c L, (c+1) L), cut into the row runs the model scans (`layer_runs`, sum L).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict
from jax import lax

# the embedding's work (and a dense prefix's, `Transformer.embed_and_prefix`) on virtual stage 0, a
# scope inside the tick's forward and backward scopes (`scopes.scope_weights`)
EMBED_SCOPE = "pipeline_embed"


def shared(params):
    """The parameters outside the layer stack (embedding, positions, final norm, head)."""
    return {k: w for k, w in params.items() if k != "layers"}


def run_starts(layer_runs) -> list[int]:
    return [sum(layer_runs[:k]) for k in range(len(layer_runs))]


def chunk_runs(params, c, layer_runs) -> tuple:
    """Chunk c's rows [c L, (c+1) L) of every `layers` leaf, cut into runs of `layer_runs` rows
    (L = their sum). Cut here, outside the forward's `jax.vjp`, so that each run's weights are
    the pullback's inputs and `Residuals` can leave them out of the stash."""
    return rows(params["layers"], c, layer_runs)


def rows(stack, c, layer_runs) -> tuple:
    """Chunk c's rows of every leaf of a stacked tree ([v L, ...]), cut into `layer_runs`."""
    size = sum(layer_runs)
    return tuple(jax.tree.map(lambda w, a=a, n=n: lax.dynamic_slice_in_dim(w, c * size + a, n), stack)
                 for a, n in zip(run_starts(layer_runs), layer_runs))


def add_shared(grads, dshared):
    """grads + dshared (in fp32) on the leaves outside the layer stack."""
    return {**grads, **{k: jax.tree.map(lambda a, d: a + d.astype(a.dtype), grads[k], dshared[k])
                        for k in dshared}}


def add_chunk(grads, druns, c, layer_runs):
    """grads + druns (in fp32), run k landing on its rows of chunk c. A run's gradients are a tree
    shaped like the run, or a flat {path: leaf} dict of some of its leaves (split schedules)."""
    size = sum(layer_runs)

    def add_rows(acc, d, a):
        rows = lax.dynamic_slice_in_dim(acc, c * size + a, d.shape[0])
        return lax.dynamic_update_slice_in_dim(acc, rows + d.astype(acc.dtype), c * size + a, 0)
    layers = flatten_dict(grads["layers"])
    for a, d in zip(run_starts(layer_runs), druns):
        for path, g in _flat(d).items():
            layers[path] = add_rows(layers[path], g, a)
    return {**grads, "layers": unflatten_dict(layers)}


def _flat(tree) -> dict:
    """{path: leaf} of a nested dict; a dict already flat (tuple keys) as it is."""
    return tree if all(isinstance(k, tuple) for k in tree) else flatten_dict(tree)


def dropout_key(keys, mb, j):
    """Micro-batch mb's key for virtual stage j, whose layers draw its splits: one per virtual stage,
    so no two stages draw the same masks, and a layer's masks follow (p v, its place), not the schedule."""
    return None if keys is None else jax.random.fold_in(keys[mb], j)


def traced_virtual_stage(layout: str, p: int, rank, c):
    """`table.virtual_stage` of a traced stage `rank` and chunk `c`."""
    return jnp.where(c == 0, rank, 2 * p - 1 - rank) if layout == "v" else c * p + rank


def zeros_like_shapes(shapes):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


class Residuals:
    """Turns `jax.vjp`'s pullback into stash leaves and back.

    A pullback is a pytree whose leaves are its residuals. The leaves that are the
    parameters themselves (the weights every matmul's backward reads) are not stashed:
    they are taken again from the parameters in the backward slot. The rest are this
    micro-batch's activations, dropout masks and the like, the stash proper."""

    def __init__(self):
        self.treedef = None
        self.from_params = None   # per leaf: index into the parameter leaves, or None (stashed)

    def split(self, pullback, params) -> list:
        leaves, self.treedef = jax.tree.flatten(pullback)
        plist = jax.tree.leaves(params)
        self.from_params = [next((k for k, w in enumerate(plist) if leaf is w), None) for leaf in leaves]
        return [leaf for leaf, k in zip(leaves, self.from_params) if k is None]

    def join(self, stashed: list, params):
        plist, it = jax.tree.leaves(params), iter(stashed)
        leaves = [next(it) if k is None else plist[k] for k in self.from_params]
        return jax.tree.unflatten(self.treedef, leaves)


class StageWork:
    """One stage's chunk work for `pipeline_grads`: the model (`StageFns`), this stage's
    parameters (v chunks of L = sum(layer_runs) layers), the micro-batches mbs [m, b, s+1] and
    their dropout keys; `split` (`SplitFns`) when the schedule splits each backward into B and W."""

    def __init__(self, fns, params, mbs, keys, act_dtype, layer_runs, split, rank, layout: tuple[str, int]):
        self.fns, self.params, self.mbs, self.keys = fns, params, mbs, keys
        self.act_dtype, self.layer_runs, self.split = act_dtype, layer_runs, split
        self.rank = rank          # this stage's index on `pipe`
        self.layout = layout      # (the schedule's layout, p): where chunk c sits in the model
        self.residuals = Residuals()
        self.prefix_residuals = Residuals()   # of virtual stage 0's embedding and dense prefix
        self.prefix_shapes = None             # their stash leaves' shapes (`fns.prefix`), set by `forward`

    def key(self, mb, c):
        """The dropout key of chunk c's layers (and of the embedding, on virtual stage 0)."""
        return dropout_key(self.keys, mb, traced_virtual_stage(*self.layout, self.rank, c))

    def embed(self, tokens, key):
        with jax.named_scope(EMBED_SCOPE):
            return self.fns.embed(shared(self.params), tokens, key).astype(self.act_dtype)

    def chunk_vjp(self, runs, x, key, tokens):
        """(y, pullback) of one chunk: unsplit, the pullback of (runs, x); split, of (the runs'
        weights other than matmul kernels, x, zero taps), the kernels held constant, so that
        autodiff leaves out their gradients (W's work) and returns the taps' (X, dY). `tokens`:
        the micro-batch's rows, for what the layers read off them (packed rows' documents)."""
        fns, split, common = self.fns, self.split, shared(self.params)
        if split is None:
            return jax.vjp(lambda runs, x: fns.layers(common, runs, x, key, tokens=tokens), runs, x)
        taps = split.taps(common, runs, x)
        kernels, rest = zip(*map(split.weights, runs, taps))

        def run(rest, x, taps):
            return fns.layers(common, tuple(map(split.join, kernels, rest)), x, key, taps, tokens=tokens)
        return jax.vjp(run, tuple(rest), x, taps)

    def embed_vjp(self, common, tokens, key):
        """(x, stash leaves) of virtual stage 0's embedding and dense prefix under `jax.vjp` in the
        shared parameters `common` (a branch's operands, so that `Residuals` knows them): what
        `train.recompute` saves of the prefix's layers (none: all of it; full: each layer's input),
        weights excluded, as for a chunk's layers."""
        with jax.named_scope(EMBED_SCOPE):
            x, pullback = jax.vjp(lambda q: self.fns.embed(q, tokens, key).astype(self.act_dtype), common)
            return x, self.prefix_residuals.split(pullback, common)

    def embed_input(self, x_in, tokens, key, first):
        """(the chunk's input, the prefix stash's leaves): on virtual stage 0 (`first`) the embedded
        micro-batch, else the arrived x_in. Without a prefix (`fns.prefix`) the embedding runs
        outside any vjp and its backward recomputes the lookup (no leaves: a lookup is cheaper
        to repeat than to keep); with one, its residuals go to a ring of their own (`Tick`), so
        that the chunk's stash slots, on every stage, do not carry them."""
        if not self.fns.prefix:
            return lax.cond(first, lambda: self.embed(tokens, key), lambda: x_in), []
        if self.prefix_shapes is None:
            self.prefix_shapes = jax.eval_shape(lambda q: self.embed_vjp(q, tokens, key)[1], shared(self.params))
        return lax.cond(first, lambda q: self.embed_vjp(q, tokens, key),
                        lambda q: (x_in, zeros_like_shapes(self.prefix_shapes)), shared(self.params))

    def forward(self, x_in, tokens, mb, c):
        """(y, stash leaves, prefix stash leaves) of chunk c: the residuals its backward needs,
        weights excluded; virtual stage 0 embeds `tokens` first (`embed_input`)."""
        runs, key = chunk_runs(self.params, c, self.layer_runs), self.key(mb, c)
        x, prefix = self.embed_input(x_in, tokens, key, (self.rank == 0) & (c == 0))
        y, pullback = self.chunk_vjp(runs, x, key, tokens)
        return y.astype(self.act_dtype), self.residuals.split(pullback, runs), prefix

    def backward(self, dy, stashed, c):
        """(gradients of the chunk's runs (split: the non-kernel leaves), dx, the taps' cotangents
        as W-stash leaves (split; else none))."""
        runs = chunk_runs(self.params, c, self.layer_runs)
        grads = self.residuals.join(stashed, runs)(dy)
        return grads[0], grads[1].astype(self.act_dtype), jax.tree.leaves(grads[2:])

    def embed_backward(self, dx, mb, prefix: list):
        """The embedding's (and dense prefix's) gradient from dx [b, s(/t), h], virtual stage 0's
        input gradient: from the prefix stash's leaves, or (no prefix) the lookup recomputed."""
        with jax.named_scope(EMBED_SCOPE):
            if self.fns.prefix:
                return self.prefix_residuals.join(prefix, shared(self.params))(dx)[0]
            _, pullback = jax.vjp(lambda q: self.fns.embed(q, self.mbs[mb], self.key(mb, 0))
                                  .astype(self.act_dtype), shared(self.params))
            return pullback(dx)[0]

    def zeros_shared(self):   # made inside each branch: a branch that returns a value from outside copies it
        return jax.tree.map(jnp.zeros_like, shared(self.params))

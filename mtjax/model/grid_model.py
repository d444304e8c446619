"""The Transformer on the 2D / 2.5D tensor grid (`parallel/grid.py`, `parallel/grid_ops.py`).

Shape legend: q grid side, d depth, b micro-batch, s sequence, h hidden, a heads, k kv heads,
d_h head dim, f MLP hidden, V padded vocabulary; r = b/(d q) rows of one activation block.
Device (k, i, j) (DEPTH, ROW, COL) holds the residual stream block [r, s, h/q]: rows of batch
block k q + i, columns j of h. Every activation inside a layer keeps this layout:

    tokens [b, s] -> depth block [b/d, s] -> embedding lookup on V rows i: partial [b/d, s, h/q]
      -> reduce-scatter along ROW -> [r, s, h/q] (+ positions [s, h/q]) -> dropout (its block of
      the global mask)
    packed rows: segment ids and positions [b, s] (the whole micro-batch's, `model/documents.py`)
      -> the block's rows [r, s], as the stream's: learned positions [r, s, h/q], RoPE [r, s, d_h/2],
      attention cut to one document; loss weights [b, s] -> the logits' rows
    layer: norm (statistics all-reduced along COL) -> Q, K, V = grid_linear -> [r, s, a/q, d_h]
      (heads along COL, batch along ROW: attention is local) -> O = grid_linear -> [r, s, h/q]
      -> + residual; norm -> fc1 (gate, up) = grid_linear -> [r, s, f/q] -> GeLU | SwiGLU
      -> fc2 = grid_linear -> [r, s, h/q] -> + residual
    head, untied: norm -> grid_linear(W [h, V]) -> logits [r, s, V/q], batch along ROW, V along COL
    head, tied:   norm -> all-gather along ROW [b/d, s, h/q] -> X E_ij^T partial [b/d, s, V/q]
                  -> reduce-scatter along COL -> [r, s, V/q], batch along COL, V along ROW

The layers are in `grid_layers.py`; this module holds the embedding, the head and the loss.
Parameters are declared with their local (block) shapes under the same names as the 1D model's
(`transformer.py`), so checkpoints, the optimizer and the reference read one tree.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from mtjax.model.documents import Documents
from mtjax.model.grid_layers import GridBlock, GridLinear, batch_block, grid_dropout, make_grid_norm
from mtjax.model.rotary import rope_tables
from mtjax.model.transformer import Transformer
from mtjax.parallel import grid_ops as ops
from mtjax.parallel.grid import COL, DEPTH, ROW, Grid
from mtjax.parallel.layers import declare, local


def logits_axes(tied: bool) -> tuple[str, str]:
    """(axis splitting V, axis splitting the batch) of the head's logits (module docstring)."""
    return (ROW, COL) if tied else (COL, ROW)


class GridTransformer(Transformer):
    """`Transformer` with the grid's embedding, blocks and head (module docstring); the layer
    scan, recomputation and pipeline methods are the 1D model's."""

    def setup(self):
        c, g = self.cfg, self.ctx.grid
        self.embed = GridEmbedding(self.vocab, c.hidden_size, g, c.init_std)
        if c.arch == "gpt":
            self.pos_embedding = declare(self, "pos_embedding", (c.seq_len, local(c.hidden_size, g.q)),
                                         ("seq", "embed"), nn.initializers.normal(c.init_std))
        self.ln_final = make_grid_norm(c.arch, c.norm_eps, g.q)
        if not c.tied:
            self.lm_head = GridLinear((c.hidden_size,), (self.vocab,), g.q, False, c.init_std, self.dtype)

    def make_block(self):
        return GridBlock(self.cfg, self.ctx.grid, self.dtype, self.deterministic, self.attention,
                         self.recompute.core_attention, parent=None)

    def embed_tokens_to_stream(self, tokens, positions=None, docs: Documents | None = None):
        """tokens [b, s] (every device of the grid holds them) -> residual stream [r, s, h/q].
        Packed rows (`docs`, the whole micro-batch's): GPT's positions are each token's position in
        its document, taken for this block's rows."""
        c, g = self.cfg, self.ctx.grid
        s = tokens.shape[1]
        if s > c.seq_len:
            raise ValueError(f"an input of {s} tokens is longer than model.seq_len {c.seq_len}")
        if positions is not None:
            raise ValueError("decoding does not run on a 2d/2.5d tensor grid")
        mine = ops.block(tokens, DEPTH, 0, g.depth)                            # [b/d, s]
        x = ops.reduce_scatter(self.embed(mine).astype(self.dtype), ROW, 0)    # partial [b/d, s, h/q] -> [r, s, h/q]
        if c.arch == "gpt" and docs is not None:
            ids = batch_block(docs.positions, g, ROW)                          # [r, s]
            x = x + jnp.take(self.pos_embedding, ids, axis=0).astype(self.dtype)
        elif c.arch == "gpt":
            x = x + self.pos_embedding[None, :s].astype(self.dtype)
        return grid_dropout(self, x, c.dropout, self.deterministic, g)

    def _block_and_rope(self, x, docs: Documents | None = None):
        """The grid's block and Llama's rotary tables: [s, d/2], or [r, s, d/2] at the positions
        inside each packed document of this block's rows (the layers take the whole rows' segment
        ids and cut them the same way: `GridBlock`)."""
        if docs is None:
            return super()._block_and_rope(x)
        positions = batch_block(docs.positions, self.ctx.grid, ROW)            # [r, s]
        rope = rope_tables(positions, self.cfg) if self.cfg.arch == "llama" else None
        return self.make_block(), rope

    def head(self, x):
        """[r, s, h/q] -> logits [r, s, V/q] laid out as `logits_axes(tied)` says."""
        x = self.ln_final(x)
        if self.cfg.tied:
            return self.embed.attend(x)
        return self.lm_head(x)


class GridEmbedding(nn.Module):
    """E [V, h] in blocks E_ij [V/q, h/q]: rows i of V along ROW, columns j of h along COL."""

    vocab: int
    features: int
    grid: Grid
    std: float = 0.02

    def setup(self):
        q = self.grid.q
        self.embedding = declare(self, "embedding", (local(self.vocab, q), local(self.features, q)),
                                 ("vocab", "embed"), nn.initializers.normal(self.std))

    def __call__(self, tokens):
        """tokens [b/d, s] -> partial [b/d, s, h/q]: the rows of E_ij this device owns (sum along ROW)."""
        rows = self.embedding.shape[0]
        ids = tokens - ops.rank(ROW) * rows
        mine = (ids >= 0) & (ids < rows)
        out = jnp.take(self.embedding, jnp.where(mine, ids, 0), axis=0)
        return jnp.where(mine[..., None], out, 0.0)

    def attend(self, x):
        """Tied head: x [r, s, h/q] -> all-gather along ROW [b/d, s, h/q] -> x E_ij^T partial
        [b/d, s, V/q] (over the h columns, COL) -> reduce-scatter along COL -> [r, s, V/q]."""
        xg = ops.gather(x, ROW, 0)                                            # [r, s, h/q] -> [b/d, s, h/q]
        partial_logits = jnp.einsum("bsh,vh->bsv", xg, self.embedding.astype(x.dtype))
        return ops.reduce_scatter(partial_logits, COL, 0)                     # [b/d, s, V/q] -> [r, s, V/q]


NEG_INF = -1e30


def grid_cross_entropy(logits, labels, vocab: int, tied: bool, grid: Grid):
    """Per-token loss of this block: logits [r, s, V/q], labels [b, s] (the micro-batch's) ->
    loss [r, s]. The max, the sum of exponentials and the target logit are all-reduced along the
    axis that splits V, as in `vocab.vocab_parallel_cross_entropy`."""
    v_axis, b_axis = logits_axes(tied)
    labels = batch_block(labels, grid, b_axis)                                # [r, s]
    z = logits.astype(jnp.float32)
    cols = z.shape[-1]
    start = ops.rank(v_axis) * cols
    z = jnp.where(start + jnp.arange(cols) < vocab, z, NEG_INF)
    m = lax.pmax(lax.stop_gradient(jnp.max(z, axis=-1)), v_axis)            # all-reduce(max) [r, s]
    z = z - m[..., None]
    sum_exp = ops.reduce(jnp.sum(jnp.exp(z), -1), v_axis)                    # all-reduce [r, s]
    ids = labels - start
    mine = (ids >= 0) & (ids < cols)
    picked = jnp.take_along_axis(z, jnp.where(mine, ids, 0)[..., None], axis=-1)[..., 0]
    target = ops.reduce(jnp.where(mine, picked, 0.0), v_axis)                # all-reduce [r, s]
    return jnp.log(sum_exp) - target


def grid_loss_sum(logits, labels, vocab: int, tied: bool, grid: Grid, weights=None):
    """The micro-batch's loss sum, the same on every device of the grid: this block's sum
    all-reduced along the batch axis and DEPTH (identity backward: each block's rows).
    `weights` [b, s] (the micro-batch's, 0 or 1 per label; None: all 1) multiply the losses,
    taken for the block's rows as the labels are (`training/packing.py`)."""
    _, b_axis = logits_axes(tied)
    losses = grid_cross_entropy(logits, labels, vocab, tied, grid)              # [r, s]
    if weights is not None:
        losses = losses * batch_block(weights, grid, b_axis)
    return ops.reduce(jnp.sum(losses), (b_axis, DEPTH))                       # scalar, this block's -> all


def gather_grid_logits(logits, vocab: int, tied: bool):
    """The full logits [b, s, V_unpadded] from the blocks (evaluation and tests only)."""
    v_axis, b_axis = logits_axes(tied)
    full = lax.all_gather(logits, v_axis, axis=2, tiled=True)                 # [r, s, V/q] -> [r, s, V]
    full = lax.all_gather(full, b_axis, axis=0, tiled=True)                   # -> [b/d, s, V]
    full = lax.all_gather(full, DEPTH, axis=0, tiled=True)                    # -> [b, s, V]
    return full[..., :vocab]

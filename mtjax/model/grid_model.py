"""The Transformer on the 2D / 2.5D tensor grid (`parallel/grid.py`, `parallel/grid_ops.py`).

Shape legend: q grid side, d depth, b micro-batch, s sequence, h hidden, a heads, k kv heads,
d_h head dim, f MLP hidden, V padded vocabulary; r = b/(d q) rows of one activation block.
Device (k, i, j) (DEPTH, ROW, COL) holds the residual stream block [r, s, h/q]: rows of batch
block k q + i, columns j of h. Every activation inside a layer keeps this layout:

    tokens [b, s] -> depth block [b/d, s] -> embedding lookup on V rows i: partial [b/d, s, h/q]
      -> reduce-scatter along ROW -> [r, s, h/q] (+ positions [s, h/q]) -> dropout (its block of
      the global mask)
    layer: norm (statistics all-reduced along COL) -> Q, K, V = grid_linear -> [r, s, a/q, d_h]
      (heads along COL, batch along ROW: attention is local) -> O = grid_linear -> [r, s, h/q]
      -> + residual; norm -> fc1 (gate, up) = grid_linear -> [r, s, f/q] -> GeLU | SwiGLU
      -> fc2 = grid_linear -> [r, s, h/q] -> + residual
    head, untied: norm -> grid_linear(W [h, V]) -> logits [r, s, V/q], batch along ROW, V along COL
    head, tied:   norm -> all-gather along ROW [b/d, s, h/q] -> X E_ij^T partial [b/d, s, V/q]
                  -> reduce-scatter along COL -> [r, s, V/q], batch along COL, V along ROW

Parameters are declared with their local (block) shapes under the same names as the 1D model's
(`transformer.py`), so checkpoints, the optimizer and the reference read one tree.
"""
from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mtjax.model.core_attention import einsum_attention, fused_attention
from mtjax.model.dropout import keep_mask
from mtjax.model.mlp import GELUS, _swiglu
from mtjax.model.recompute import saving_inputs_only
from mtjax.model.rotary import apply_rope
from mtjax.model.transformer import Transformer
from mtjax.parallel import grid_ops as ops
from mtjax.parallel import taps
from mtjax.parallel.grid import COL, DEPTH, ROW, Grid
from mtjax.parallel.layers import declare, lead, local


def logits_axes(tied: bool) -> tuple[str, str]:
    """(axis splitting V, axis splitting the batch) of the head's logits (module docstring)."""
    return (ROW, COL) if tied else (COL, ROW)


def batch_block(x, grid: Grid, batch_axis: str):
    """Rows [b, ...] -> this device's [b/(d q), ...]: depth block k, then block `batch_axis` rank."""
    size = x.shape[0] // grid.batch_blocks
    index = ops.rank(DEPTH) * grid.q + ops.rank(batch_axis)
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=0)


def grid_dropout(module: nn.Module, x, rate: float, deterministic: bool, grid: Grid):
    """Dropout of the residual stream with the 1D rule's mask (one key, the mask of the whole
    [b, s, h], as every tensor rank draws it without sequence parallelism): each device draws the
    global mask and keeps its block [r, s, h/q]."""
    if deterministic or rate == 0.0:
        return x
    r, s, hq = x.shape
    full = keep_mask(module.make_rng("dropout"), (r * grid.batch_blocks, s, hq * grid.q), 1.0 - rate)
    keep = ops.block(batch_block(full, grid, ROW), COL, 2, grid.q)   # [r, s, h/q]
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


# ---- norms: statistics over the h columns split along COL ----------------------------------
def _stats(x32, centre: bool, h: int, eps: float):
    mean = lax.psum(jnp.sum(x32, -1, keepdims=True), COL) / h if centre else None   # all-reduce [r, s, 1]
    xc = x32 - mean if centre else x32
    var = lax.psum(jnp.sum(jnp.square(xc), -1, keepdims=True), COL) / h               # all-reduce [r, s, 1]
    return xc, mean, lax.rsqrt(var + eps)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grid_norm(x, scale, bias, centre: bool, h: int, eps: float):
    return _grid_norm_fwd(x, scale, bias, centre, h, eps)[0]


def _grid_norm_fwd(x, scale, bias, centre, h, eps):
    xc, mean, rstd = _stats(x.astype(jnp.float32), centre, h, eps)
    y = xc * rstd * lead(scale, x.ndim)
    y = (y if bias is None else y + lead(bias, x.ndim)).astype(x.dtype)
    return y, (x, mean, rstd, scale, bias)


def _grid_norm_bwd(centre, h, eps, res, g):
    """dx = rstd (gγ - mean_h(gγ) - x̂ mean_h(gγ x̂)), the means all-reduced along COL; dscale and
    dbias are this block's partial sums (over ROW and DEPTH: summed once per step)."""
    x, mean, rstd, scale, bias = res
    x32 = x.astype(jnp.float32)
    xhat = ((x32 - mean) if centre else x32) * rstd
    g32 = g.astype(jnp.float32)
    gs = g32 * lead(scale, x.ndim)
    proj = lax.psum(jnp.sum(gs * xhat, -1, keepdims=True), COL) / h                    # all-reduce [r, s, 1]
    if centre:
        gs = gs - lax.psum(jnp.sum(gs, -1, keepdims=True), COL) / h                    # all-reduce [r, s, 1]
    dx = rstd * (gs - xhat * proj)
    rows = tuple(range(x.ndim - 1))
    dbias = None if bias is None else jnp.sum(g32, rows).astype(bias.dtype)
    return dx.astype(x.dtype), jnp.sum(g32 * xhat, rows).astype(scale.dtype), dbias


_grid_norm.defvjp(_grid_norm_fwd, _grid_norm_bwd)


class GridNorm(nn.Module):
    """LayerNorm (centre) or RMSNorm over h, on blocks [r, s, h/q]; scale (and bias) [h/q]."""

    centre: bool
    eps: float
    q: int

    @nn.compact
    def __call__(self, x):
        hq = x.shape[-1]
        scale = declare(self, "scale", (hq,), ("norm",), nn.initializers.ones)
        bias = declare(self, "bias", (hq,), ("norm",), nn.initializers.zeros) if self.centre else None
        return _grid_norm(x, scale, bias, self.centre, hq * self.q, self.eps)


def make_grid_norm(arch: str, eps: float, q: int, name: str | None = None):
    return GridNorm(arch != "llama", eps, q, name=name)


# ---- the linear layer ----------------------------------------------------------------------
class GridLinear(nn.Module):
    """Y = X A (+ b) on the grid: X [..., *in/q] -> Y [..., *out/q] (first dims split), by
    `grid_ops.grid_linear` over the flattened [..., K/q] x [K/q, N/q] (`block_linear`; tapped for
    the split backward: `parallel/taps.py`)."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    q: int
    use_bias: bool = True
    std: float = 0.02
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        inp = (local(self.in_shape[0], self.q),) + tuple(self.in_shape[1:])
        out = (local(self.out_shape[0], self.q),) + tuple(self.out_shape[1:])
        w = declare(self, "kernel", inp + out, (None,) * (len(inp) + len(out)), nn.initializers.normal(self.std))
        n_out = len(out)
        y = taps.tap(self, x.astype(self.dtype), w.astype(self.dtype), partial(ops.block_linear, n_out),
                     partial(ops.block_forward, n_out), partial(ops.block_dX, n_out))
        if self.use_bias:   # its gradient is partial over ROW (this row's batch): summed once per step
            b = declare(self, "bias", out, (None,) * len(out), nn.initializers.zeros)
            y = y + lead(b, y.ndim).astype(self.dtype)
        return y


# ---- attention and MLP ------------------------------------------------------------------------
class GridAttention(nn.Module):
    """Heads along COL, batch along ROW: Q, K, V [r, s, a/q | k/q, d_h], attention local."""

    cfg: object
    grid: Grid
    dtype: jnp.dtype = jnp.float32
    kernel: str = "xla"
    recompute_core: bool = False

    @nn.compact
    def __call__(self, x, rope):
        c, q = self.cfg, self.grid.q
        bias = c.arch == "gpt" or c.qkv_bias
        lin = partial(GridLinear, (c.hidden_size,), q=q, use_bias=bias, std=c.init_std, dtype=self.dtype)
        qh = lin((c.num_heads, c.head_dim), name="q")(x)                      # [r, s, a/q, d_h]
        kh = lin((c.kv_heads, c.head_dim), name="k")(x)                       # [r, s, k/q, d_h]
        vh = lin((c.kv_heads, c.head_dim), name="v")(x)
        if rope is not None:
            qh, kh = apply_rope(qh, *rope), apply_rope(kh, *rope)
        r, s, heads, d = qh.shape
        kv = kh.shape[2]
        core = einsum_attention if self.kernel == "xla" else partial(_fused, kernel=self.kernel)
        if self.recompute_core:
            core = saving_inputs_only(core)
        out = core(qh.reshape(r, s, kv, heads // kv, d), kh, vh).reshape(r, s, heads, d)   # [r, s, a/q, d_h]
        out_std = c.init_std / jnp.sqrt(2.0 * c.num_layers)
        return GridLinear((c.num_heads, c.head_dim), (c.hidden_size,), q, c.arch == "gpt", out_std,
                          self.dtype, name="o")(out)                           # [r, s, h/q]


def _fused(q, k, v, kernel):
    return fused_attention(q, k, v, kernel)


class GridMLP(nn.Module):
    """fc1 (or gate and up) [r, s, h/q] -> [r, s, f/q], the activation on the block, fc2 -> [r, s, h/q]."""

    cfg: object
    grid: Grid
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c, q = self.cfg, self.grid.q
        f, h, bias = c.ffn_size, c.hidden_size, c.arch == "gpt"
        if c.mlp_activation == "swiglu":
            gate = GridLinear((h,), (f,), q, False, c.init_std, self.dtype, name="gate")(x)
            up = GridLinear((h,), (f,), q, False, c.init_std, self.dtype, name="up")(x)
            hidden = saving_inputs_only(_swiglu)(gate, up)                     # [r, s, f/q]
        else:
            hidden = GridLinear((h,), (f,), q, bias, c.init_std, self.dtype, name="fc1")(x)
            hidden = saving_inputs_only(GELUS[c.mlp_activation])(hidden)        # [r, s, f/q]
        out_std = c.init_std / jnp.sqrt(2.0 * c.num_layers)
        return GridLinear((f,), (h,), q, bias, out_std, self.dtype, name="fc2")(hidden)


class GridBlock(nn.Module):
    """x + Attn(Norm(x)), then x + MLP(Norm(x)), on blocks [r, s, h/q]."""

    cfg: object
    grid: Grid
    dtype: jnp.dtype = jnp.float32
    deterministic: bool = True
    attention: str = "xla"
    recompute_core: bool = False

    @nn.compact
    def __call__(self, x, rope, cache=None, positions=None):
        c, g = self.cfg, self.grid
        y = make_grid_norm(c.arch, c.norm_eps, g.q, "ln_attn")(x)
        y = GridAttention(c, g, self.dtype, self.attention, self.recompute_core, name="attn")(y, rope)
        x = x + grid_dropout(self, y, c.dropout, self.deterministic, g)
        y = make_grid_norm(c.arch, c.norm_eps, g.q, "ln_mlp")(x)
        y = GridMLP(c, g, self.dtype, name="mlp")(y)
        return x + grid_dropout(self, y, c.dropout, self.deterministic, g), cache


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

    def embed_tokens_to_stream(self, tokens, positions=None):
        """tokens [b, s] (every device of the grid holds them) -> residual stream [r, s, h/q]."""
        c, g = self.cfg, self.ctx.grid
        s = tokens.shape[1]
        if s > c.seq_len:
            raise ValueError(f"an input of {s} tokens is longer than model.seq_len {c.seq_len}")
        if positions is not None:
            raise ValueError("decoding does not run on a 2d/2.5d tensor grid")
        mine = ops.block(tokens, DEPTH, 0, g.depth)                            # [b/d, s]
        x = ops.reduce_scatter(self.embed(mine).astype(self.dtype), ROW, 0)    # [r, s, h/q] along ROW
        if c.arch == "gpt":
            x = x + self.pos_embedding[None, :s].astype(self.dtype)
        return grid_dropout(self, x, c.dropout, self.deterministic, g)

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
        xg = ops.gather(x, ROW, 0)                                            # [b/d, s, h/q] along ROW
        partial_logits = jnp.einsum("bsh,vh->bsv", xg, self.embedding.astype(x.dtype))
        return ops.reduce_scatter(partial_logits, COL, 0)                     # [r, s, V/q] along COL


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


def grid_loss_sum(logits, labels, vocab: int, tied: bool, grid: Grid):
    """The micro-batch's loss sum, the same on every device of the grid: this block's sum
    all-reduced along the batch axis and DEPTH (identity backward: each block's rows)."""
    _, b_axis = logits_axes(tied)
    return ops.reduce(jnp.sum(grid_cross_entropy(logits, labels, vocab, tied, grid)), (b_axis, DEPTH))


def gather_grid_logits(logits, vocab: int, tied: bool):
    """The full logits [b, s, V_unpadded] from the blocks (evaluation and tests only)."""
    v_axis, b_axis = logits_axes(tied)
    full = lax.all_gather(logits, v_axis, axis=2, tiled=True)                 # [r, s, V]
    full = lax.all_gather(full, b_axis, axis=0, tiled=True)                   # [b/d, s, V]
    full = lax.all_gather(full, DEPTH, axis=0, tiled=True)                    # [b, s, V]
    return full[..., :vocab]

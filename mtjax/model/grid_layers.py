"""The layers of the 2D / 2.5D tensor grid: norm, linear, attention, MLP and the block, each on
the residual stream's blocks [r, s, h/q] (the layout is drawn in `grid_model.py`).

Shape legend: q grid side, d depth, b micro-batch, s sequence, h hidden, a heads, f MLP hidden;
r = b/(d q) rows of one activation block. Parameters are declared with their local (block)
shapes under the 1D model's names, so checkpoints, the optimizer and the reference read one tree.
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
from mtjax.parallel import grid_ops as ops
from mtjax.parallel import taps
from mtjax.parallel.grid import COL, DEPTH, ROW, Grid
from mtjax.parallel.layers import declare, lead, local


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
    """dx = rstd (gγ - mean_h(gγ) - x̂ mean_h(gγ x̂)) (RMSNorm: no mean_h(gγ)), the means all-reduced
    along COL; dscale and dbias are this block's partial sums (over ROW and DEPTH: summed once per step)."""
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
    def __call__(self, x, rope, segments=None):
        """x [r, s, h/q] -> [r, s, h/q]; packed rows: `segments` [r, s], this block's rows' document
        ids (`model/documents.py`), cut the causal mask to one document."""
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
        core = _einsum if self.kernel == "xla" else partial(_fused, kernel=self.kernel)
        if self.recompute_core:     # keeps Q, K, V and the segment ids
            core = saving_inputs_only(core)
        out = core(qh.reshape(r, s, kv, heads // kv, d), kh, vh, segments).reshape(r, s, heads, d)   # [r, s, a/q, d_h]
        out_std = c.init_std / jnp.sqrt(2.0 * c.num_layers)
        return GridLinear((c.num_heads, c.head_dim), (c.hidden_size,), q, c.arch == "gpt", out_std,
                          self.dtype, name="o")(out)                           # [r, s, h/q]


def _einsum(q, k, v, segments):
    return einsum_attention(q, k, v, segments=segments)


def _fused(q, k, v, segments, kernel):
    return fused_attention(q, k, v, kernel, segments)


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
    def __call__(self, x, rope, cache=None, positions=None, segments=None):
        """-> (x, cache), the `Block` signature; no cache on the grid. `segments` [b, s]: packed rows'
        document ids, the whole micro-batch's; attention takes this block's rows of them."""
        c, g = self.cfg, self.grid
        rows = None if segments is None else batch_block(segments, g, ROW)       # [r, s]
        y = make_grid_norm(c.arch, c.norm_eps, g.q, "ln_attn")(x)
        y = GridAttention(c, g, self.dtype, self.attention, self.recompute_core, name="attn")(y, rope, rows)
        x = x + grid_dropout(self, y, c.dropout, self.deterministic, g)
        y = make_grid_norm(c.arch, c.norm_eps, g.q, "ln_mlp")(x)
        y = GridMLP(c, g, self.dtype, name="mlp")(y)
        return x + grid_dropout(self, y, c.dropout, self.deterministic, g), cache

"""Head-sharded causal self-attention (MHA and grouped-query attention).

Shape legend: b micro-batch, s sequence, h hidden, a heads, k kv heads,
d head dim (`model.kv_channels`, h/a by default), t tensor size, g = a/k query heads per kv head.
Projections: Q h -> a d, K and V h -> k d, O a d -> h; Q, K, V carry biases for gpt, and for
llama with `model.qkv_bias` (Qwen2); O's bias is gpt's only.

Q, K, V are column-parallel (rank r owns heads [r a/t, (r+1) a/t)), the
output projection is row-parallel; the block's input has already entered
the tensor region (f or all-gather), and the output projection ends it.
With k < t kv heads are replicated: every rank holds all k and uses the one
its a/t query heads share, head r k / t (t is a multiple of k, so the a/t
heads of a rank never straddle two groups).

Decoding (generation) passes a `KVCache` of the keys and values of earlier positions, split
over `tensor` as the heads are ([b, S, k_r, d] per rank, S = model.seq_len; with k < t the one
replicated head the rank uses): the n new tokens' keys and values are written at their
positions, and their queries attend to the cache instead of to themselves.
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from mtjax.config.schema import ModelConfig
from mtjax.model.dropout import dropout
from mtjax.model.rotary import apply_rope
from mtjax.parallel.context import ParallelContext
from mtjax.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mtjax.parallel.tensor_ops import tensor_rank


class KVCache(NamedTuple):
    """Keys and values of the positions decoded so far, this rank's kv heads: [b, S, k_r, d] in
    one layer, [l, b, S, k_r, d] stacked over the layers (S = model.seq_len). Entries at or beyond
    a row's next position are never read (the mask hides them until they are written)."""
    k: jax.Array
    v: jax.Array


def write_cache(cache: KVCache, k, v, start) -> KVCache:
    """The n new keys and values k, v [b, n, k_r, d] written at positions start[r] .. start[r] + n - 1
    of each row r (start [b]); start + n <= S (`dynamic_update_slice` would move a write that
    overflows)."""
    def put(rows, new):
        return jax.vmap(lambda row, x, p: lax.dynamic_update_slice_in_dim(row, x.astype(row.dtype), p, 0))(
            rows, new, start)
    return KVCache(put(cache.k, k), put(cache.v, v))


def causal_attention_core(q, k, v, module, rate: float, deterministic: bool, t: int, positions=None):
    """softmax(Q K^T / sqrt(d) + causal mask) V, scores and softmax in fp32.

    q [b, s, k_r, g, d], k/v [b, s, k_r, d] -> [b, s, k_r, g, d]
    (k_r = kv heads on this rank). This is the part selective recomputation recomputes.
    Decoding: q [b, n, k_r, g, d] at `positions` [b, n] and k/v the cache [b, S, k_r, d]; a query
    at position p sees the keys at 0 .. p.
    """
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    if positions is None:
        s = q.shape[1]
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))                        # [q, s]
    else:
        keys = jnp.arange(k.shape[1], dtype=positions.dtype)
        causal = (keys[None, None, :] <= positions[:, :, None])[:, None, None]  # [b, 1, 1, n, S]
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = checkpoint_name(probs, "attention_probs")
    probs = dropout(module, probs, rate, deterministic, t, split=True)   # heads differ per rank
    return jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v)


class SelfAttention(nn.Module):
    """Y = softmax(causal(Q K^T / sqrt(d))) V W_o with heads split over `tensor`."""

    cfg: ModelConfig
    ctx: ParallelContext
    dtype: jnp.dtype = jnp.float32

    @property
    def qkv_bias(self) -> bool:
        return self.cfg.arch == "gpt" or self.cfg.qkv_bias

    def _kv_projection(self, x, name: str):
        """x [b, s, h] -> this rank's kv heads [b, s, k_r, d]."""
        c, t, bias = self.cfg, self.ctx.tensor, self.qkv_bias
        if c.kv_heads % t == 0:
            return ColumnParallelLinear((c.kv_heads, c.head_dim), ("kv_heads", "head_dim"), t, bias,
                                        c.init_std, self.dtype, name=name)(x)
        # k < t: replicated kv heads; each rank keeps the one its query heads use.
        full = ColumnParallelLinear((c.kv_heads, c.head_dim), ("kv_heads", "head_dim"), 1, bias,
                                    c.init_std, self.dtype, name=name)(x)   # [b, s, k, d]
        return lax.dynamic_slice_in_dim(full, tensor_rank(t) * c.kv_heads // t, 1, axis=2)

    @nn.compact
    def __call__(self, x, rope, deterministic: bool, cache: KVCache | None = None, positions=None):
        """x [b, s, h] (inside the tensor region) -> ([b, s, h] or [b, s/t, h] (after the exit), cache).

        Without a cache the s tokens attend to each other (the returned cache is None). With one,
        they sit at `positions` [b, s] (consecutive in each row), their keys and values are written
        there, and they attend to the whole cache (`causal_attention_core`)."""
        c, t = self.cfg, self.ctx.tensor
        q = ColumnParallelLinear((c.num_heads, c.head_dim), ("heads", "head_dim"), t, self.qkv_bias,
                                 c.init_std, self.dtype, name="q")(x)          # [b, s, a/t, d]
        k = self._kv_projection(x, "k")                                          # [b, s, k_r, d]
        v = self._kv_projection(x, "v")
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            cache = write_cache(cache, k, v, positions[:, 0])
            k, v = cache.k, cache.v                                              # [b, S, k_r, d]
        b, s, heads, d = q.shape
        kv = k.shape[2]
        q = q.reshape(b, s, kv, heads // kv, d)                                  # [b, s, k_r, g, d]
        out = causal_attention_core(q, k, v, self, c.attention_dropout, deterministic, t, positions)
        out = out.reshape(b, s, heads, d)                                        # [b, s, a/t, d]
        out_std = c.init_std / jnp.sqrt(2.0 * c.num_layers)
        y = RowParallelLinear((c.num_heads, c.head_dim), ("heads", "head_dim"), c.hidden_size, t,
                              self.ctx.sp, c.arch == "gpt", out_std, self.dtype, name="o")(out)
        return y, cache

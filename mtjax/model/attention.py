"""Head-sharded causal self-attention (MHA and grouped-query attention).

Shape legend: b micro-batch, s sequence, h hidden, a heads, k kv heads,
d head dim (`model.kv_channels`, h/a by default), t tensor size, g = a/k query heads per kv head.
Projections: Q h -> a d, K and V h -> k d, O a d -> h; Q, K, V carry biases for gpt, and for
llama with `model.qkv_bias` (Qwen2); O's bias is gpt's only.

With `model.qk_norm` (Qwen3) each head of Q and K is RMS-normalised over its d values before
RoPE, by a scale [d] shared by the heads (`norms.HeadRMSNorm`): local to the head, no communication.

Q, K, V are column-parallel (rank r owns heads [r a/t, (r+1) a/t)), the
output projection is row-parallel; the block's input has already entered
the tensor region (f or all-gather), and the output projection ends it.
With k < t kv heads are replicated: every rank holds all k and uses the one
its a/t query heads share, head r k / t (t is a multiple of k, so the a/t
heads of a rank never straddle two groups); it slices that head's kernel and
bias before the product, so it projects one head, not k (`ColumnParallelLinear.pick_t`).

The core, softmax(Q K^T / sqrt(d) + causal mask) V on this rank's heads, is one of the kernels of
`core_attention.py` (`model.attention`): the einsums, or `jax.nn.dot_product_attention` (cuDNN's
flash attention on GPUs). It needs no communication: heads are independent.

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

from mtjax.config.schema import ModelConfig
from mtjax.model.attention_blocks import cudnn_blocks
from mtjax.model.context_attention import all_gather_attention, ring_attention
from mtjax.model.core_attention import einsum_attention, fused_attention
from mtjax.model.joined_columns import COLLECTION as JOINED
from mtjax.model.joined_columns import joined_kernel
from mtjax.model.dropout import dropout_key
from mtjax.model.norms import HeadRMSNorm
from mtjax.model.prefix_attention import prefixed_attention
from mtjax.model.recompute import saving_inputs_only
from mtjax.model.rotary import apply_rope
from mtjax.parallel.context import ParallelContext
from mtjax.parallel.layers import ColumnParallelLinear, RowParallelLinear, batch_major, column_parallel


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


class SelfAttention(nn.Module):
    """Y = softmax(causal(Q K^T / sqrt(d))) V W_o with heads split over `tensor`."""

    cfg: ModelConfig
    ctx: ParallelContext
    dtype: jnp.dtype = jnp.float32
    kernel: str = "xla"              # core attention (`core_attention.KERNELS`)
    recompute_core: bool = False     # selective recomputation: the core keeps only Q, K, V (and its key)

    @property
    def qkv_bias(self) -> bool:
        return self.cfg.arch == "gpt" or self.cfg.qkv_bias

    def _kv_layer(self, name: str) -> ColumnParallelLinear:
        """K or V: x [b, s, h] -> this rank's kv heads [b, s, k_r, d]; when k < t the kernel [h, k, d]
        and bias are whole on every rank, and only head r k / t, the one its query heads use, is
        projected (`pick_t`: k_r = 1)."""
        c, t = self.cfg, self.ctx.tensor
        split = c.kv_heads % t == 0
        return ColumnParallelLinear((c.kv_heads, c.head_dim), ("kv_heads", "head_dim"), t if split else 1,
                                    self.qkv_bias, c.init_std, self.dtype, pick_t=1 if split else t,
                                    joined=self.has_variable(JOINED, "qkv"), name=name)

    @nn.compact
    def __call__(self, x, rope, deterministic: bool, cache: KVCache | None = None, positions=None,
                 segments=None, prefix: KVCache | None = None, export_kv: bool = False):
        """x [b, s, h] (inside the tensor region; or its `SequenceShard`, `layers.column_parallel`)
        -> ([b, s, h] or [b, s/t, h] (after the exit), cache).

        Without a cache the s tokens attend to each other (the returned cache is None); packed
        rows (`segments` [b, s_row], the whole row's document ids, `model/documents.py`) only
        inside their document. With a cache they sit at `positions` [b, s] (consecutive in each
        row), their keys and values are written there, and they attend to the whole cache
        (`einsum_attention`).

        Sequence halves (`block.halved`): `export_kv` returns this half's K, V [b, s, k_r, d]
        (after RoPE) in the cache's place, and `prefix` holds the first half's, which these
        queries, the second half's, read whole (`prefix_attention.py`)."""
        c, t = self.cfg, self.ctx.tensor
        joined = joined_kernel(self, "qkv")                                      # [h, (a_r + 2 k_r) d] or None
        q = ColumnParallelLinear((c.num_heads, c.head_dim), ("heads", "head_dim"), t, self.qkv_bias,
                                 c.init_std, self.dtype, joined=joined is not None, name="q")
        q, k, v = column_parallel(x, q, self._kv_layer("k"), self._kv_layer("v"), joined=joined)
        # [b, s, a/t, d], [b, s, k_r, d]
        q, k, v = batch_major(q), batch_major(k), batch_major(v)                 # (from [s, b, ...]: sp's layout)
        if c.qk_norm:
            q = HeadRMSNorm(c.norm_eps, name="q_norm")(q)
            k = HeadRMSNorm(c.norm_eps, name="k_norm")(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            cache = write_cache(cache, k, v, positions[:, 0])
            k, v = cache.k, cache.v                                              # [b, S, k_r, d]
        b, s, heads, d = q.shape
        kv = k.shape[2]
        q = q.reshape(b, s, kv, heads // kv, d)                                  # [b, s, k_r, g, d]
        if prefix is None:
            out = self._core(q, k, v, deterministic, positions, segments)       # [b, s, k_r, g, d]
        else:        # (attention dropout is refused with sequence halves)
            kernel = "cudnn" if self.kernel == "cudnn" and cudnn_blocks() is not None else "xla"
            out = prefixed_attention(q, k, v, prefix.k, prefix.v, kernel)       # [b, s, k_r, g, d]
        out = out.reshape(b, s, heads, d)                                        # [b, s, a/t, d]
        out_std = c.init_std / jnp.sqrt(2.0 * c.num_layers)
        y = RowParallelLinear((c.num_heads, c.head_dim), ("heads", "head_dim"), c.hidden_size, t,
                              self.ctx.sp, c.arch == "gpt", out_std, self.dtype, self.ctx.tensor_overlap,
                              ring_by_all_to_all=self.ctx.ring_by_all_to_all, name="o")(out)
        return y, (KVCache(k, v) if export_kv else cache)

    def _core(self, q, k, v, deterministic: bool, positions, segments=None):
        """softmax(Q K^T / sqrt(d) + causal mask) V by this model's kernel (`core_attention`):
        q [b, s, k_r, g, d], k/v [b, S, k_r, d] -> [b, s, k_r, g, d]; every kernel takes the
        packed rows' document mask (`segments`). Decoding (`positions`) takes the einsums.
        Selective recomputation wraps the core so that its backward keeps only Q, K, V (the
        segment ids) and the dropout key, and runs the core again (Korthikanti et al.'s choice: the
        5 a s^2 b bytes of scores, mask and probabilities are cheap to recompute)."""
        rate = self.cfg.attention_dropout
        # heads differ per tensor rank, so each draws its own mask; the key is the same on every
        # context rank, whose masks differ by their true positions (`attention_dropout.py`)
        key = None if deterministic or rate == 0.0 else dropout_key(self, self.ctx.tensor, split=True)
        if positions is not None:
            return einsum_attention(q, k, v, key, rate, positions)
        if self.ctx.context > 1 and self.ctx.context_attention == "ring":
            # its own backward keeps only Q, K, V, O and the log-sum-exp: nothing to recompute
            kernel = "cudnn" if self.kernel == "cudnn" and cudnn_blocks() is not None else "xla"
            return ring_attention(q, k, v, self.ctx.context, self.ctx.ring_by_all_to_all, kernel, segments,
                                  key, rate)
        if self.ctx.context > 1 and self.kernel != "xla" and segments is None:
            # the causal blocks (`gathered_attention`) keep only Q, K, V, O and the lse, as the ring
            return all_gather_attention(q, k, v, self.ctx.context, self.kernel)
        if self.ctx.context > 1:        # the row is split over `context`: K, V gathered inside the core
            c, kernel = self.ctx.context, self.kernel
            core = lambda q, k, v, key, seg: all_gather_attention(q, k, v, c, kernel, key, rate, seg)  # noqa: E731
        elif self.kernel == "xla":
            core = lambda q, k, v, key, seg: einsum_attention(q, k, v, key, rate, segments=seg)   # noqa: E731
        else:
            kernel = self.kernel
            core = lambda q, k, v, key, seg: fused_attention(q, k, v, kernel, seg)   # noqa: E731 (no dropout)
        if self.recompute_core:
            core = saving_inputs_only(core)
        return core(q, k, v, key, segments)

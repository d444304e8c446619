"""Generation with a KV cache on a (1, 1, t) mesh: the cache's layout, the sharded decode step and
the jitted loop over new tokens.

Shape legend: b rows, n tokens per pass, S = model.seq_len (the cache's length), l layers,
k kv heads, k_r = kv heads per tensor rank, d head dim, V vocabulary (unpadded), t tensor size.

    prefill   prompts [b, P] (right-padded to a bucket) -> one pass -> cache filled, first token
    decode    last token [b, 1] at position len + i - 1 -> one pass over one position -> next token

Each pass is `Transformer.decode` inside one `shard_map`: heads split over `tensor` as in
training (column-parallel Q/K/V, row-parallel O and its all-reduce), the cache split the same
way, and the logits of the one position each row needs gathered over `tensor`, so that every rank
samples the same token from the same full logits and key.

The cache is [l, b, S, k_r, d] per rank (keys and values each): globally [l, b, S, k_g, d] with
k_g = k, split over `tensor`, or k_g = t when k < t, every rank holding the one replicated head
its query heads use (`model/attention.py`). Rows may have prompts of different lengths: row r's
new tokens go to positions len_r, len_r + 1, ...; the padding a shorter row's prefill wrote is
overwritten before any query can see it (a query at p sees 0 .. p only).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from mtjax.mesh import TENSOR
from mtjax.model.attention import KVCache
from mtjax.parallel.vocab import gather_logits
from mtjax.inference.sampling import next_tokens

CACHE_SPEC = P(None, None, None, TENSOR, None)          # [l, b, S, k_g, d]: kv heads over tensor


def cache_heads(kv_heads: int, t: int) -> int:
    """k_g, the global kv-head axis of the cache: k, or t when k < t (one replicated head per rank)."""
    return kv_heads if kv_heads % t == 0 else t


class Decoder:
    """The cache, the decode step and the generation loop of one model on one mesh (built once;
    jit compiles the loop once per (rows, padded prompt length))."""

    def __init__(self, model, mesh, plan):
        c = model.cfg
        self.model, self.mesh, self.plan = model, mesh, plan
        self.cache_sharding = NamedSharding(mesh, CACHE_SPEC)
        self.cache_dims = (c.num_layers, c.seq_len, cache_heads(c.kv_heads, plan.tensor), c.head_dim)
        self.step = jax.shard_map(self._step, mesh=mesh, in_specs=(plan.params.specs, P(), CACHE_SPEC, P(), P()),
                                  out_specs=(P(), CACHE_SPEC), check_vma=False)
        self.empty_cache = jax.jit(self._empty_cache, static_argnums=0,
                                   out_shardings=KVCache(self.cache_sharding, self.cache_sharding))
        self.generate = jax.jit(self._generate)

    def _empty_cache(self, rows: int) -> KVCache:
        """Zeros [l, b, S, k_g, d] in the compute dtype, split over `tensor`."""
        l, s, k, d = self.cache_dims
        zeros = jnp.zeros((l, rows, s, k, d), self.plan.compute_dtype)
        return KVCache(zeros, zeros)

    def _step(self, params, tokens, cache, start, last):
        """Inside shard_map: tokens [b, n] at start [b] -> (full logits [b, V] at index last [b], cache)."""
        logits, cache = self.model.apply({"params": params}, tokens, cache, start, last, method="decode")
        logits = gather_logits(logits[:, 0].astype(jnp.float32), self.plan.vocab, self.plan.tensor)
        return logits, cache                                                  # [b, V]

    def _generate(self, params, prompts, lengths, max_new, key, temperature, top_k, top_p, stop_id):
        """prompts [b, P] (right-padded), lengths [b] -> (tokens [b, S], count): row r's new tokens in
        tokens[r, :count], count <= max_new (1 <= max_new, lengths + max_new <= S). A row that has
        produced `stop_id` (-1: none) gets -1 after it; the loop ends early once every row has."""
        b = prompts.shape[0]
        zeros = jnp.zeros((b,), jnp.int32)
        cache = lax.with_sharding_constraint(self._empty_cache(b), KVCache(self.cache_sharding, self.cache_sharding))
        logits, cache = self.step(params, prompts, cache, zeros, lengths - 1)           # prefill
        token = next_tokens(logits, jax.random.fold_in(key, 0), temperature, top_k, top_p)
        out = jnp.full((b, self.cache_dims[1]), -1, jnp.int32).at[:, 0].set(token)
        done = token == stop_id

        def more(carry):
            i, _, _, _, done = carry
            return (i < max_new) & ~jnp.all(done)

        def one(carry):
            i, cache, out, token, done = carry
            logits, cache = self.step(params, token[:, None], cache, lengths + i - 1, zeros)
            token = next_tokens(logits, jax.random.fold_in(key, i), temperature, top_k, top_p)
            token = jnp.where(done, -1, token)
            out = lax.dynamic_update_slice_in_dim(out, token[:, None], i, axis=1)
            return i + 1, cache, out, token, done | (token == stop_id)

        count, _, out, _, _ = lax.while_loop(more, one, (jnp.int32(1), cache, out, token, done))
        return out, count

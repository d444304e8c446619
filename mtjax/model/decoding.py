"""Decoding from a KV cache: the Transformer's methods that generation runs (`mtjax/inference/`).

Shape legend: b rows, n tokens per pass, h hidden, S = model.seq_len (the cache's length), l
layers (L of a pipeline chunk, P of a mixture of experts' dense prefix), f layers a unit and u
units (`layer_pattern.py`), k_r kv heads of this rank, d head dim, V/t this rank's vocabulary.

The same model as training runs, from a cache: n tokens at given positions go through the same
embedding, blocks and head, each attention layer writing their keys and values into its slice of
the cache and reading the earlier ones from it. The layers decode in the order they are stored:
the dense prefix's P rows, then units of f rows (`layer_pattern.py`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mtjax.model.attention import KVCache
from mtjax.model.block import scan_layers
from mtjax.model.layer_pattern import unit_block
from mtjax.model.rotary import rope_tables


class KVDecoding:
    """`Transformer`'s decoding methods (a mixin: it reads the model's fields and its embedding,
    prefix, layer stack and head)."""

    def decode(self, tokens, cache: KVCache, start, last=None):
        """Tokens [b, n] at positions start[r] .. start[r] + n - 1 of each row r (start [b]) through
        the model, reading earlier positions' keys and values from `cache` (leaves [l, b, S, k_r, d],
        all l layers here, S = model.seq_len) and writing theirs -> (this rank's logits [b, n, V/t],
        or [b, 1, V/t] at index last[r] of each row when `last` [b] is given; the cache).
        start + n <= S. One pass over a prompt fills the cache (prefill), then one token per pass."""
        if self.depth != self.cfg.num_layers:
            raise ValueError("decoding runs every layer of the model")
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=start.dtype)[None, :]   # [b, n]
        x = self.embed_tokens_to_stream(tokens, positions)                   # [b, n, h]
        x, cache = self.decode_layers(x, cache, positions)
        if last is not None:
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)          # [b, 1, h]
        return self.head(x), cache

    def decode_layers(self, x, cache: KVCache, positions):
        """The stream x [b, n, h] at positions [b, n] through this model's layers, decoding from
        `cache` (leaves [L, b, S, k_r, d], layer i of the model (chunk) at row i) -> (x, cache):
        the dense prefix's P rows first when the model holds it, then units of f rows
        (`layer_pattern.py`), each unit's f layers reading their f consecutive rows."""
        c = self.cfg
        if self.ctx.sp:
            raise ValueError("decoding runs without sequence parallelism")
        rope = rope_tables(positions, c) if c.arch == "llama" else None
        block = unit_block(c, self.ctx, self.dtype, self.deterministic, self.attention, False)
        p, head = self.pattern, None
        if p.prefix:
            x, head = self._run_prefix(x, rope, None, cache=jax.tree.map(lambda a: a[:p.prefix], cache),
                                       positions=positions)
            cache = jax.tree.map(lambda a: a[p.prefix:], cache)
        if p.group > 1:     # [u f, ...] -> [u, f, ...]: a unit's f layers
            cache = jax.tree.map(lambda a: a.reshape(-1, p.group, *a.shape[1:]), cache)
        x, cache = scan_layers(block, self._stacked_layers(block, x, rope), None, x, rope, None, cache, positions)
        if p.group > 1:
            cache = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), cache)
        if head is not None:
            cache = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), head, cache)
        return x, cache

    def decode_prefix(self, x, cache: KVCache, positions):
        """A pipeline's first stage: x [b, n, h] through the dense prefix's P layers, decoding
        from `cache` (leaves [P, b, S, k_r, d]) -> (x, cache); `decode_layers` then runs the chunk."""
        rope = rope_tables(positions, self.cfg) if self.cfg.arch == "llama" else None
        return self._run_prefix(x, rope, None, cache=cache, positions=positions, count=self.cfg.dense_prefix)

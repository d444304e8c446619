"""Attention dropout's mask as a function of where each probability sits, not of the tensor's layout.

Shape legend: B rows of a block (the micro-batch b, or a batch of blocks stacked along it), k_r kv
heads on this rank, g query heads per kv head, T query rows, S key rows.

Element (row n, head e, query position i, key position j) of the probabilities P
[B, k_r, g, T, S] is kept or dropped by its own 32-bit hash: n is the batch row, e = r g + m the
query head's index on this rank (kv group r, member m), and i, j the TRUE positions in the whole
row. So any block of P computes its own part of the one mask: c = 1's whole s x s, a context
rank's rows against the gathered keys, a ring step's L x L blocks, a recomputation. The layer's
dropout key (`dropout.dropout_key`: folded with the tensor rank, the heads being split) gives two
seed words s0, s1 (threefry); with uint32 arithmetic mod 2^32 and

    mix(x):  x ^= x >> 16;  x *= 0x7feb352d;  x ^= x >> 15;  x *= 0x846ca68b;  x ^= x >> 16

(a multiply-xorshift finalizer with the constants of Wellons' "lowbias32"; a bijection of the
uint32s, as xorshifts and products with odd numbers are invertible):

    u_n      = mix(s0 ^ mix(n + s1))                  per batch row
    u_ne     = mix(u_n ^ e C1)                        per head
    u_nei    = mix(u_ne ^ i C2)                       per query row
    bits     = mix(u_nei ^ j C3)                      per element
    kept     = bits < floor(keep 2^32)

(C1, C2, C3 odd constants, so distinct heads, rows and keys enter as distinct words). The
per-element work is the last line: one xor, the 8 operations of mix and a compare, against about 15
for Philox's 32 bits (`dropout.keep_mask`), and no state to split. The statistics (kept share,
no structure along any axis, neighbours independent) are checked in tests/test_attention_dropout.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp

U32 = jnp.uint32
C1, C2, C3 = U32(0x9E3779B9), U32(0x85EBCA6B), U32(0xC2B2AE35)


def mix(x):
    """The uint32 bijection of the module docstring (elementwise)."""
    x = x ^ (x >> U32(16))
    x = x * U32(0x7FEB352D)
    x = x ^ (x >> U32(15))
    x = x * U32(0x846CA68B)
    return x ^ (x >> U32(16))


def keep_mask(seed, rows, queries, keys, kv_heads: int, group: int, keep: float):
    """The kept elements of a block of P: bool [B, k_r, g, T, S]. seed uint32 [2]; rows [B] the
    batch rows; queries [T] or [B, T] and keys [S] or [B, S] the true positions (int)."""
    n = rows.astype(U32)
    u = mix(seed[0] ^ mix(n + seed[1]))                                         # [B]
    heads = jnp.arange(kv_heads * group, dtype=U32).reshape(1, kv_heads, group)
    u = mix(u[:, None, None] ^ heads * C1)                                      # [B, k_r, g]
    i = jnp.broadcast_to(queries.astype(U32), (n.shape[0], queries.shape[-1]))  # [B, T]
    u = mix(u[..., None] ^ (i * C2)[:, None, None])                             # [B, k_r, g, T]
    j = keys.astype(U32).reshape(-1 if keys.ndim == 2 else 1, keys.shape[-1]) * C3
    bits = mix(u[..., None] ^ j[:, None, None, None])                          # [B, k_r, g, T, S]
    return bits < U32(min(int(keep * 2 ** 32), 2 ** 32 - 1))


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout at `rate` on a block of P, from the layer's `seed` (uint32 [2], `seed_of`), the
    block's batch `rows` [B], and the true positions of its `queries` ([T] or [B, T]) and `keys`
    ([S] or [B, S]); positions None until a block is placed (`at`). A pytree whose leaves are the
    arrays (`rate` is static), so it passes through `custom_vjp`, `lax.cond` and recomputation."""
    seed: Any
    rate: float
    rows: Any = None
    queries: Any = None
    keys: Any = None

    def at(self, rows, queries, keys) -> "AttentionDropout":
        return replace(self, rows=rows, queries=queries, keys=keys)

    def cut(self, q_rows: slice, k_rows: slice) -> "AttentionDropout":
        """The sub-block at these query and key rows (slices of the positions' last axis)."""
        return replace(self, queries=self.queries[..., q_rows], keys=self.keys[..., k_rows])

    def apply(self, p):
        """P [B, k_r, g, T, S] (or [B, k_r, T, S] when g = 1) -> P M / keep in P's dtype (inverted
        dropout; M the mask of `keep_mask`)."""
        keep = 1.0 - self.rate
        k_r, g = p.shape[1], p.shape[2] if p.ndim == 5 else 1
        mask = keep_mask(self.seed, self.rows, self.queries, self.keys, k_r, g, keep).reshape(p.shape)
        return jnp.where(mask, p / keep, 0.0).astype(p.dtype)


jax.tree_util.register_dataclass(AttentionDropout, data_fields=["seed", "rows", "queries", "keys"],
                                 meta_fields=["rate"])


def seed_of(key):
    """The two seed words of a dropout key (threefry bits)."""
    return jax.random.bits(key, (2,), U32)


def attention_dropout(key, rate: float) -> AttentionDropout | None:
    """Dropout from the layer's key, no block placed yet; None without a key (no dropout)."""
    return None if key is None or rate == 0.0 else AttentionDropout(seed_of(key), rate)


def on(drop: AttentionDropout | None, p):
    """`drop.apply(p)`, or P itself without dropout."""
    return p if drop is None else drop.apply(p)

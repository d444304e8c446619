"""Generation with a KV cache on a (data, pipe, tensor) mesh: rows split over `data`, layers over
`pipe` (each stage keeps the cache of its own layers), heads over `tensor`.

Shape legend: b rows of one data rank (a multiple of p), g = b/p rows per group, n tokens per pass,
S = model.seq_len (the cache's length), l layers, L = l/p per stage, k_r kv heads per tensor rank,
d head dim, V vocabulary (unpadded), N new tokens.

    prefill   prompts [g, P] (right-padded to a bucket) -> one pass -> cache filled, first token
    decode    last token [g, 1] at position len + i - 1 -> one pass over one position -> next token

Pipelined decode: a data rank's rows are p groups, and the stages work on different groups at
once. In tick T stage s runs group (T - s) mod p through its L layers and passes the stream
[g, n, h] on to stage s + 1 (a ring `ppermute`); the last stage also turns it into logits,
samples the group's next token and passes that token round to stage 0, which embeds it in tick
T + 1, when the group's turn comes again:

    tick       0    1    2    3    4    5   ...        (p = 3; digit: group, -: fill)
    stage 0    0    1    2    0    1    2
    stage 1    -    0    1    2    0    1
    stage 2    -    -    0    1    2    0   -> tokens of groups 0, 1, 2, 0, ...

A stage is idle only while the pipe fills and drains, (p - 1) ticks per phase, not for a whole
token in turn: N new tokens take p (N - 1) + p - 1 decode ticks of one stage running g rows.
Prefill runs the same ticks with the prompts (2p - 1 ticks). A tick's attention writes the
keys and values of its group's rows; a tick that belongs to no pass (filling or draining) writes
where a later real pass overwrites it first (decode) or is undone (prefill, a select).

Every rank of a tensor group samples the same token from the same full logits (gathered over
`tensor`). Row r's key for its i-th token is fold_in(fold_in(seed key, i), r), r its index in
the whole batch, so a row draws the same token whatever the layout and the rows beside it.

The cache is [l, b, S, k_g, d] globally: layers over `pipe`, rows over `data`, k_g = k kv
heads over `tensor`, or k_g = t when k < t (each rank holds the one replicated head its query
heads use, `model/attention.py`). A mixture of experts with a dense prefix of P layers
(`model/layer_pattern.py`) on p > 1 stages: [p (P + L), ...], each stage's P + L rows its copy
of the prefix's (used on stage 0, which runs the prefix after the embedding) and its L = (l - P)/p
layers'. Rows may have prompts of different lengths: row r's new
tokens go to positions len_r, len_r + 1, ...; the padding a shorter row's prefill wrote is
overwritten before any query can see it (a query at position j sees 0 .. j only).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from mtjax.layout import ModelLayout
from mtjax.mesh import DATA, PIPE, TENSOR
from mtjax.model.attention import KVCache
from mtjax.model.layer_pattern import chunk_layers
from mtjax.parallel.vocab import gather_logits
from mtjax.inference.sampling import next_tokens

CACHE_SPEC = P(PIPE, DATA, None, TENSOR, None)          # [l, b, S, k_g, d]


def cache_heads(kv_heads: int, t: int) -> int:
    """k_g, the global kv-head axis of the cache: k, or t when k < t (one replicated head per rank)."""
    return kv_heads if kv_heads % t == 0 else t


def ticks(phase: str, p: int, max_new):
    """The ticks of a phase: prefill 2p - 1; decode p (N - 1) + p - 1 (none when N = 1)."""
    if phase == "prefill":
        return 2 * p - 1
    return jnp.where(max_new > 1, p * (max_new - 1) + p - 1, 0)


def turn(phase: str, p: int, tick, stage, max_new):
    """(group, token index produced, whether it is a real pass) of `stage` in `tick`. Prefill:
    group tick - s, token 0. Decode: group (tick - s) mod p, its pass k = (tick - s) // p, which
    reads token k and produces token k + 1 (k clipped into range on the ticks of no pass)."""
    r = tick - stage
    if phase == "prefill":
        return jnp.clip(r, 0, p - 1), jnp.int32(0), (r >= 0) & (r < p)
    k = r // p
    return r % p, jnp.clip(k, 0, jnp.maximum(max_new - 2, 0)) + 1, (r >= 0) & (k + 1 < max_new)


class Decoder:
    """The cache and the generation loop of one model on one layout (built once; jit compiles
    the loop once per (rows, padded prompt length))."""

    def __init__(self, layout: ModelLayout):
        c, t = layout.model, layout.tensor
        if layout.grid is not None or layout.sequence_parallel:
            raise ValueError("decoding runs on the 1d tensor layout without sequence parallelism")
        self.layout, self.mesh, p = layout, layout.mesh, layout.pipe
        self.model = layout.local_model(chunk_layers(c, p, 1))
        # a pipeline's stages hold P + L cache rows: the dense prefix's P (stage 0's are used),
        # then their L = (l - P)/p layers' (`layer_pattern.py`); no pipeline: all l
        self.prefix = c.dense_prefix if p > 1 else 0
        sharding = NamedSharding(self.mesh, CACHE_SPEC)
        rows = p * (self.prefix + self.model.depth) if p > 1 else c.num_layers
        self.cache_dims = (rows, c.seq_len, cache_heads(c.kv_heads, t), c.head_dim)
        self.empty_cache = jax.jit(self._empty_cache, static_argnums=0, out_shardings=KVCache(sharding, sharding))
        scalars = (P(),) * 7
        self.generate = jax.jit(jax.shard_map(
            self._generate, mesh=self.mesh, in_specs=(layout.params.specs, P(DATA, None), P(DATA), P(DATA), *scalars),
            out_specs=P(DATA, None), check_vma=False))

    def _empty_cache(self, rows: int, layers: int | None = None, heads: int | None = None) -> KVCache:
        """Zeros [l, b, S, k_g, d] in the compute dtype (global; or a rank's part, given its sizes)."""
        l, s, k, d = self.cache_dims
        zeros = jnp.zeros((layers or l, rows, s, heads or k, d), self.layout.compute_dtype)
        return KVCache(zeros, zeros)

    def _pass(self, params, x_in, tokens, start, cache: KVCache):
        """One stage's pass over a group: tokens [g, n] at positions start [g] .. (embedded on
        stage 0; the other stages take the stream x_in [g, n, h]) through this stage's layers and
        cache -> (stream [g, n, h], cache)."""
        apply = self.model.apply
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=start.dtype)[None, :]   # [g, n]
        x = apply({"params": params}, tokens, positions, method="embed_tokens_to_stream")
        stage = lax.axis_index(PIPE)
        x = jnp.where(stage == 0, x, x_in)
        if not self.prefix:
            return apply({"params": params}, x, cache, positions, method="decode_layers")
        head, rest = (KVCache(*(a[:self.prefix] for a in cache)), KVCache(*(a[self.prefix:] for a in cache)))
        x, head = lax.cond(stage == 0, lambda x, h: apply({"params": params}, x, h, positions, method="decode_prefix"),
                           lambda x, h: (x, h), x, head)                 # [g, n, h]; the prefix's rows
        x, rest = apply({"params": params}, x, rest, positions, method="decode_layers")
        return x, KVCache(*(jnp.concatenate([a, b]) for a, b in zip(head, rest)))

    def _next(self, params, y, last, key, settings, rows):
        """The last stage's next tokens [g] from the stream y [g, n, h] at index last [g]: the head,
        its full logits [g, V] (gathered over `tensor`) and the choice (`sampling.py`). The other
        stages skip it (a `cond` on the stage; its collectives stay within one stage's tensor group)."""
        def choose(y):
            h = jnp.take_along_axis(y, last[:, None, None], axis=1)                      # [g, 1, h]
            logits = self.model.apply({"params": params}, h, method="head")[:, 0].astype(jnp.float32)
            logits = gather_logits(logits, self.layout.vocab, self.layout.tensor)       # [g, V]
            return next_tokens(logits, key, *settings, rows=rows)
        p = self.layout.pipe
        if p == 1:
            return choose(y)
        return lax.cond(lax.axis_index(PIPE) == p - 1, choose, lambda y: jnp.zeros(rows.shape, jnp.int32), y)

    def _tick(self, phase: str, tick, carry, inputs):
        """Every stage's pass of `tick` (see the module doc), the last stage's sampling and
        recording, and the ring that carries streams on and tokens back to stage 0."""
        params, prompts, lengths, rows, max_new, key, settings, stop_id = inputs
        cache, x, tok, out, done = carry
        p, stage = self.layout.pipe, lax.axis_index(PIPE)
        g = tok.shape[0] // p
        q, i, real = turn(phase, p, tick, stage, max_new)

        def group(a):
            return lax.dynamic_slice_in_dim(a, q * g, g, axis=0)

        if phase == "prefill":
            tokens, start, last = group(prompts), jnp.zeros((g,), jnp.int32), group(lengths) - 1
        else:
            tokens, start, last = group(tok)[:, None], group(lengths) + i - 1, jnp.zeros((g,), jnp.int32)
        mine = KVCache(*(lax.dynamic_slice_in_dim(a, q * g, g, axis=1) for a in cache))
        y, new = self._pass(params, x, tokens, start, mine)
        if phase == "prefill":   # a tick of no pass must not touch a group already filled
            new = jax.tree.map(lambda a, b: jnp.where(real, a, b), new, mine)
        cache = KVCache(*(lax.dynamic_update_slice_in_dim(a, b, q * g, axis=1) for a, b in zip(cache, new)))
        token = self._next(params, y, last, jax.random.fold_in(key, i), settings, group(rows))
        record = real & (stage == p - 1)
        was_done = group(done)
        column = jnp.where(record, jnp.where(was_done, -1, token), lax.dynamic_slice(out, (q * g, i), (g, 1))[:, 0])
        out = lax.dynamic_update_slice(out, column[:, None], (q * g, i))
        done = lax.dynamic_update_slice_in_dim(done, jnp.where(record, was_done | (token == stop_id), was_done),
                                               q * g, axis=0)
        if p > 1:
            ring = [(s, (s + 1) % p) for s in range(p)]
            y, token = lax.ppermute(y, PIPE, ring), lax.ppermute(token, PIPE, ring)
        q_last, _, real_last = turn(phase, p, tick, p - 1, max_new)   # what stage 0 just received
        tok = jnp.where((stage == 0) & real_last, lax.dynamic_update_slice_in_dim(tok, token, q_last * g, 0), tok)
        return cache, y, tok, out, done

    def _generate(self, params, prompts, lengths, rows, live, max_new, key_data, temperature, top_k, top_p,
                  stop_id):
        """Inside shard_map: prompts [b, P] (right-padded), lengths [b], rows [b] (index in the
        batch; rows >= `live` are padding) -> tokens [b, S]: row r's new tokens, then -1.
        1 <= max_new, lengths + max_new <= S. A row that has produced `stop_id` (-1: none) gets -1
        after it; the loop ends early once every row has."""
        p, t = self.layout.pipe, self.layout.tensor
        b, width = prompts.shape
        key = jax.random.wrap_key_data(key_data)
        inputs = (params, prompts, lengths, rows, max_new, key, (temperature, top_k, top_p), stop_id)
        cache = self._empty_cache(b, self.prefix + self.model.depth, self.cache_dims[2] // t)
        hidden = (b // p, width, self.model.cfg.hidden_size)
        carry = (cache, jnp.zeros(hidden, self.layout.compute_dtype), jnp.zeros((b,), jnp.int32),
                 jnp.full((b, self.cache_dims[1]), -1, jnp.int32), rows >= live)
        with jax.named_scope("prefill"):      # the scopes name the phases' work in the HLO (bench_generate)
            carry = lax.fori_loop(0, ticks("prefill", p, max_new),
                                  lambda tick, c: self._tick("prefill", tick, c, inputs), carry)
        cache, _, tok, out, done = carry
        x = jnp.zeros((b // p, 1, hidden[2]), self.layout.compute_dtype)

        def more(state):
            tick, (_, _, _, _, done) = state
            waiting = jnp.where(lax.axis_index(PIPE) == p - 1, jnp.sum(~done), 0)
            return (tick < ticks("decode", p, max_new)) & (lax.psum(waiting, (DATA, PIPE)) > 0)

        def one(state):
            tick, carry = state
            return tick + 1, self._tick("decode", tick, carry, inputs)

        with jax.named_scope("decode"):
            _, (_, _, _, out, _) = lax.while_loop(more, one, (jnp.int32(0), (cache, x, tok, out, done)))
        return lax.psum(jnp.where(lax.axis_index(PIPE) == p - 1, out, 0), PIPE)

"""The decoder-only Transformer: embedding, a scanned stack of blocks, vocabulary-parallel head.

Shape legend: b micro-batch, s sequence, h hidden, V padded vocabulary,
t tensor size, l layers. With sequence parallelism the residual stream is
[b, s/t, h]; otherwise [b, s, h], replicated over `tensor`. With context parallelism (c > 1) s
is this rank's s/c tokens (two chunks of the row, `parallel/context_ops.py`): positions, learned
or rotary, are their true positions, and attention crosses `context` (`context_attention.py`).

    tokens [b, s] -> embedding -> exit (all-reduce | reduce-scatter) -> + positions
      -> l x Block -> final norm -> enter (f | all-gather) -> logits [b, s, V/t]

The input may be shorter than `model.seq_len` (a multiple of t with sequence parallelism):
positions, learned or rotary, are those of its first s tokens, so under the causal mask a
prefix gets the logits the full sequence has there.

`decode` is the same model run from a KV cache (generation): `decoding.py`.

The blocks' parameters are stacked along a leading `layers` axis (declared at initialisation by
the Block that runs them, `block.init` vmapped over l keys), and the forward is a `lax.scan` over
them, so the program (and its compile time) has one block whatever the depth; block-wise recomputation runs two
scans over two slices of the same stack (see `layer_plan`). The block, the layer scan and the
recomputation policies are in `block.py`. A mixture of experts with dense layers among its MoE
layers stacks units of f = `model.moe_layer_freq` layers instead, after a stack of dense layers (`layer_pattern.py`).
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mtjax.config.schema import ModelConfig
from mtjax.model.block import HOST, REMAT_POLICIES, Block, Recompute, layer_plan, scan_layers
from mtjax.model.decoding import KVDecoding
from mtjax.model.dropout import dropout
from mtjax.model.fsdp_scan import fsdp_scan
from mtjax.model.joined_columns import COLLECTION as JOINED
from mtjax.model.layer_pattern import Pattern, dense_block, layer_pattern, unit_block
from mtjax.model.norms import make_norm
from mtjax.model.rotary import rope_tables
from mtjax.model.stash_scan import MAIN_GRAD
from mtjax.parallel.context import ParallelContext
from mtjax.model.documents import Documents
from mtjax.parallel.context_ops import context_positions, split_row
from mtjax.parallel.fsdp import Fsdp
from mtjax.parallel.sequence_halves import in_position_order, stream_order
from mtjax.parallel.layers import ColumnParallelLinear, declare
from mtjax.parallel.taps import COLLECTION as TAPS
from mtjax.parallel.tensor_ops import enter_tensor_region, exit_tensor_region, tensor_rank
from mtjax.parallel.vocab import VocabParallelEmbedding

__all__ = ["HOST", "REMAT_POLICIES", "Block", "Recompute", "Transformer", "layer_plan", "scan_layers"]


class Transformer(KVDecoding, nn.Module):
    """GPT (LayerNorm, learned positions, GeLU) or Llama (RMSNorm, RoPE, SwiGLU, GQA).

    Three parts that a pipeline stage can run separately (`apply(..., method=...)`):
    `embed_and_prefix` on the first stage (the embedding, then a mixture of experts' dense
    prefix, `layer_pattern.py`), `run_layers` on every stage (its `num_layers` local layers),
    `head` on the last stage.
    """

    cfg: ModelConfig
    vocab: int                       # padded V
    ctx: ParallelContext = ParallelContext()
    dtype: jnp.dtype = jnp.float32
    deterministic: bool = True
    num_layers: int = 0              # layers held here; 0 means all of cfg.num_layers
    recompute: Recompute = Recompute()   # what the layers' backward keeps
    attention: str = "xla"           # the core attention kernel (`core_attention.resolve_attention`)
    # fn(layer weights, layer's slice of the `grad_sink` collection) -> weights, inside the layer
    # scan (`scan_layers`' sink); None: no sink. The training step's overlapped data reduction.
    grad_sink: Callable | None = None
    # FSDP: the layer stack arrives as shards, gathered a layer at a time (`model/fsdp_scan.py`)
    fsdp: Fsdp | None = None

    def setup(self):
        c, t = self.cfg, self.ctx.tensor
        self.embed = VocabParallelEmbedding(self.vocab, c.hidden_size, t, c.init_std)
        if c.arch == "gpt":
            # under sequence parallelism each rank adds (and so differentiates) only its s/t rows
            self.pos_embedding = declare(self, "pos_embedding", (c.seq_len, c.hidden_size), ("seq", "embed"),
                                         nn.initializers.normal(c.init_std), sequence_parallel=True)
        self.ln_final = make_norm(c.arch, c.norm_eps)
        if not c.tied:
            self.lm_head = ColumnParallelLinear((self.vocab,), ("vocab",), t, False, c.init_std, self.dtype)

    def embed_tokens_to_stream(self, tokens, positions=None, docs: Documents | None = None):
        """tokens [b, s] -> residual stream [b, s, h] or [b, s/t, h]; s <= model.seq_len.
        `positions` [b, s] (decoding, no sequence parallelism): the tokens' positions, by default
        0 .. s - 1. Packed rows (`docs`, the whole rows'): each token's position in its document."""
        c, t, sp = self.cfg, self.ctx.tensor, self.ctx.sp
        s = tokens.shape[1]
        if s > c.seq_len:
            raise ValueError(f"an input of {s} tokens is longer than model.seq_len {c.seq_len}")
        if sp and s % t:
            raise ValueError(f"sequence parallelism splits the {s} input tokens over parallel.tensor {t}: "
                             "give a multiple of it")
        order = stream_order(s, t) if self.sequence_halves and positions is None else None
        if order is not None:   # the stream's rows: each rank's of both halves (`sequence_halves.stream_order`)
            tokens = tokens[:, order]
        x = exit_tensor_region(self.embed(tokens).astype(self.dtype), t, sp)   # partial [b, s, h] -> [b, s(/t), h]
        if c.arch == "gpt" and docs is not None:       # this rank's rows of the documents' positions
            rows = x.shape[1]
            ids = lax.dynamic_slice_in_dim(split_row(docs.positions, self.ctx.context),
                                           tensor_rank(t) * rows if sp else 0, rows, axis=1)   # [b, rows]
            x = x + jnp.take(self.pos_embedding, ids, axis=0).astype(self.dtype)
        elif c.arch == "gpt" and positions is not None:
            x = x + jnp.take(self.pos_embedding, positions, axis=0).astype(self.dtype)   # [b, s, h]
        elif c.arch == "gpt":
            rows = x.shape[1]                                               # s, or s/t with SP
            if self.ctx.context > 1:    # this rank's chunks: their true positions (`context_ops`)
                ids = lax.dynamic_slice_in_dim(context_positions(s, self.ctx.context), tensor_rank(t) * rows
                                               if sp else 0, rows)         # [rows]
                pos = jnp.take(self.pos_embedding, ids, axis=0)
            elif order is not None:
                pos = jnp.take(self.pos_embedding, lax.dynamic_slice_in_dim(order, tensor_rank(t) * rows, rows), axis=0)
            else:
                pos = lax.dynamic_slice_in_dim(self.pos_embedding, tensor_rank(t) * rows if sp else 0, rows)
            x = x + pos[None].astype(self.dtype)
        return dropout(self, x, c.dropout, self.deterministic, t, sp, self.ctx.context)

    @property
    def sequence_halves(self) -> bool:
        """The layers run the sequence's halves over a sequence-parallel stream (`block.halved`):
        the stream's rows are in `stream_order`, the head puts them back in position order."""
        return self.ctx.sp and self.ctx.sequence_halves

    @property
    def depth(self) -> int:
        return self.num_layers or self.cfg.num_layers

    @property
    def pattern(self) -> Pattern:
        """The dense prefix and the units of the `layers` stack (`layer_pattern.py`); a pipeline
        chunk's (depth < l) holds units only."""
        return layer_pattern(self.cfg, self.depth)

    @property
    def prefix_layers(self) -> int:
        """The dense prefix's layers that `embed_and_prefix` runs: P on a pipeline chunk, 0 on a
        model of all layers (its `run_layers` runs them) or without a prefix."""
        return self.cfg.dense_prefix - self.pattern.prefix

    def embed_and_prefix(self, tokens, docs: Documents | None = None):
        """Virtual stage 0's work before its chunk: tokens [b, s] -> the stream [b, s(/t), h]
        through the embedding and, on a pipeline chunk, the dense prefix's P layers (P = 0, or a
        model of all layers, whose `run_layers` runs them: the embedding alone). The
        prefix's dropout keys are folded apart from the chunk's layers', which the stage draws
        from the same key."""
        x = self.embed_tokens_to_stream(tokens, docs=docs)
        n = self.prefix_layers
        if not n:
            return x
        _, rope = self._block_and_rope(x, docs)
        keys = None if self.deterministic else jax.random.split(jax.random.fold_in(self.make_rng("dropout"), n), n)
        return self._run_prefix(x, rope, self._layer_plan()[0][1], None if docs is None else docs.segments,
                                count=n, keys=keys)

    @property
    def layer_runs(self) -> tuple[int, ...]:
        """Row counts of the runs `run_layers` scans, in order (`layer_plan`): (l,), or block
        mode's (N, l - N); rows are units of f layers in a mixed stack (`layer_pattern.py`)."""
        return tuple(n for n, _ in self._layer_plan())

    def run_layers(self, x, runs=None, sinks=None, taps=None, docs: Documents | None = None):
        """[b, s(/t), h] -> [b, s(/t), h] through the stacked blocks, in runs of layers that
        save the same residuals (`layer_plan`); layer i draws dropout from the i-th split of one
        key, so every recompute mode sees the same masks.

        `runs`, if given, holds the runs' stacked parameters ([n_k, ...] leaves, counts
        `layer_runs`) cut by the caller, so that they enter a surrounding `jax.vjp` as
        parameters rather than as slices computed inside it: a pipeline stage recognises the
        weights among its pullback's residuals by identity and does not stash them. `sinks`, if
        given, holds the `grad_sink` slots the same way (else they come from the collection).
        `taps`, if given, holds each run's taps (`zero_taps`): the split backward's
        (`parallel/taps.py`). `docs`: packed rows (`model/documents.py`), the whole rows': RoPE at
        the positions inside each document, attention inside each document."""
        block, rope = self._block_and_rope(x, docs)
        segments = None if docs is None else docs.segments
        plan = self._layer_plan()
        x = self._run_prefix(x, rope, plan[0][1], segments)
        if runs is None:
            runs = self._cut_runs(self._stacked_layers(block, x, rope))
        rows = sum(self.layer_runs)
        keys = None if self.deterministic else jax.random.split(self.make_rng("dropout"), rows)
        if sinks is None:
            sinks = (self._cut_runs(self.get_variable("grad_sink", "layers")) if self.grad_sink is not None
                     else (None,) * len(plan))
        taps = (None,) * len(plan) if taps is None else taps
        joined, main_grad = (self.get_variable(c, "layers") if self.has_variable(c, "layers") else None
                             for c in (JOINED, MAIN_GRAD))     # (main_grad: for one run only)
        joined = (None,) * len(plan) if joined is None else self._cut_runs(joined)
        first = 0
        for (count, policy), params, into, tap, join in zip(plan, runs, sinks, taps, joined, strict=True):
            rows = None if keys is None else lax.slice_in_dim(keys, first, first + count)
            sink = None if into is None else (self.grad_sink, into)
            if self.fsdp is not None:
                x = fsdp_scan(block, self.fsdp, params, rows, x, rope, policy, tap, segments,
                              self.ctx.half_batch_unit(count))
            else:
                x, _ = scan_layers(block, params, rows, x, rope, policy, sink=sink, taps=tap, segments=segments,
                                   joined=join, main_grad=main_grad)
            first += count
        return x

    def zero_taps(self, x, runs):
        """The taps `run_layers` takes for input x [b, s(/t), h] and runs: per run, each matmul's
        (X, Y)-shaped zeros stacked over the run's layers, [n_k, b, s, ...]."""
        block, rope = self._block_and_rope(x)

        def one_layer(p):
            p = p if self.fsdp is None else self.fsdp.gather(p)     # a layer's shard -> its weights
            _, made = block.apply({"params": p}, x, rope, rngs={"dropout": jax.random.key(0)}, mutable=[TAPS])
            return made[TAPS]
        out = []
        for params, n in zip(runs, self.layer_runs, strict=True):
            shapes = jax.eval_shape(one_layer, jax.tree.map(lambda w: w[0], params))
            out.append(jax.tree.map(lambda a, n=n: jnp.zeros((n, *a.shape), a.dtype), shapes))
        return tuple(out)

    def _block_and_rope(self, x, docs: Documents | None = None):
        """The Block the layer scan runs, and Llama's rotary tables for x's tokens (None for GPT):
        [s/c, d/2], or [b, s/c, d/2] at the positions inside each packed document."""
        c = self.cfg
        s = x.shape[1] * self.ctx.tensor if self.ctx.sp else x.shape[1]     # the tokens, not this rank's rows
        if docs is not None:
            positions = split_row(docs.positions, self.ctx.context)        # [b, s/c]
        elif self.ctx.context > 1:
            positions = context_positions(s, self.ctx.context)
        else:
            positions = jnp.arange(s)
        rope = rope_tables(positions, c) if c.arch == "llama" else None
        return self.make_block(), rope

    def make_block(self) -> nn.Module:
        """The block `run_layers` scans (the grid model's differs: `grid_model.py`): a layer, or a
        unit of f layers (`layer_pattern.py`)."""
        return unit_block(self.cfg, self.ctx, self.dtype, self.deterministic, self.attention,
                          self.recompute.core_attention)

    def _stacked_layers(self, block: Block, x, rope, name: str = "layers", rows: int = 0):
        """The parameters of the stack `name` (`rows` blocks; default: the `layers` stack's), every
        leaf [rows, ...] with the logical axis `name` first (`layers` is split over `pipe`; the dense
        prefix's `dense_layers` is whole on every stage). Initialising declares them:
        `block.init` once per row (vmapped over keys split from one), so the layers are built by
        the very Block that `scan_layers` then runs, at init as at apply."""
        if self.is_initializing() and not self.has_variable("params", name):
            keys = jax.random.split(self.make_rng("params"), rows or self.pattern.rows(self.depth))
            stack = jax.vmap(lambda k: block.init({"params": k}, x, rope)["params"])(keys)
            self.put_variable("params", name, nn.meta.add_axis(stack, 0, {nn.PARTITION_NAME: name}))
        return nn.unbox(self.variables["params"][name])

    def _run_prefix(self, x, rope, policy, segments=None, cache=None, positions=None, count=None, keys=None):
        """(x through the dense prefix's P layers, their cache) (`layer_pattern.py`), under the
        first run's `policy` (block recomputation is refused with a prefix); x as is when P = 0.
        `count`: P where this model (a pipeline chunk) does not hold the prefix in its pattern;
        `keys`: the layers' dropout keys, else drawn here."""
        n = self.pattern.prefix if count is None else count
        if not n:
            return x if cache is None else (x, cache)
        block = dense_block(self.cfg, self.ctx, self.dtype, self.deterministic, self.attention,
                            self.recompute.core_attention and cache is None)
        params = self._stacked_layers(block, x, rope, "dense_layers", n)
        if keys is None and not self.deterministic:
            keys = jax.random.split(self.make_rng("dropout"), n)
        x, cache = scan_layers(block, params, keys, x, rope, policy, cache, positions, segments=segments)
        return x if cache is None else (x, cache)

    def _layer_plan(self) -> list[tuple[int, object]]:
        r, f = self.recompute, self.pattern.group
        return layer_plan(r.mode, self.pattern.rows(self.depth), r.layers // f, r.offload)

    def _cut_runs(self, stack) -> tuple:
        """The stacked parameters (every leaf [l, ...]) cut into `layer_runs`; a single run is
        the stack itself, not a full-range slice (see `run_layers`). In block mode XLA copies
        each run's weights into its loop."""
        if len(self.layer_runs) == 1:
            return (stack,)
        starts = np.cumsum((0,) + self.layer_runs[:-1])
        return tuple(jax.tree.map(lambda w, a=a, n=n: lax.slice_in_dim(w, a, a + n), stack)
                     for a, n in zip(starts, self.layer_runs))

    def head(self, x):
        """[b, s(/t), h] -> this rank's logits [b, s, V/t]."""
        t, sp = self.ctx.tensor, self.ctx.sp
        x = enter_tensor_region(self.ln_final(x), t, sp)                   # [b, s(/t), h] -> [b, s, h]
        if self.sequence_halves:
            x = in_position_order(x, t)
        if self.cfg.tied:
            return self.embed.attend(x)
        return self.lm_head(x)

    def __call__(self, tokens, docs: Documents | None = None):
        """tokens [b, s] -> this rank's logits [b, s, V/t]; `docs`: packed rows, the whole rows'."""
        return self.head(self.run_layers(self.embed_tokens_to_stream(tokens, docs=docs), docs=docs))

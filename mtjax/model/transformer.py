"""The decoder-only Transformer: embedding, a scanned stack of blocks, vocabulary-parallel head.

Shape legend: b micro-batch, s sequence, h hidden, V padded vocabulary,
t tensor size, l layers. With sequence parallelism the residual stream is
[b, s/t, h]; otherwise [b, s, h], replicated over `tensor`.

    tokens [b, s] -> embedding -> exit (all-reduce | reduce-scatter) -> + positions
      -> l x Block -> final norm -> enter (f | all-gather) -> logits [b, s, V/t]

The input may be shorter than `model.seq_len` (a multiple of t with sequence parallelism):
positions, learned or rotary, are those of its first s tokens, so under the causal mask a
prefix gets the logits the full sequence has there.

`decode` is the same model run from a KV cache (generation, `mtjax/inference/`): n tokens at
given positions go through the same embedding, blocks and head, each attention layer writing
their keys and values into its slice of the cache and reading the earlier ones from it.

The blocks' parameters are stacked along a leading `layers` axis (declared at
initialisation by the Block that runs them, `block.init` vmapped over l keys),
and the forward is a `lax.scan` over them, so the program (and its compile
time) has one block whatever the depth; block-wise recomputation runs two
scans over two slices of the same stack (see `layer_plan`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import Offloadable

from mtjax.config.schema import ModelConfig
from mtjax.model.attention import KVCache, SelfAttention
from mtjax.model.dropout import dropout
from mtjax.model.mlp import MLP
from mtjax.model.norms import make_norm
from mtjax.model.rotary import rope_tables
from mtjax.parallel.context import ParallelContext
from mtjax.parallel.layers import ColumnParallelLinear, declare
from mtjax.parallel.taps import COLLECTION as TAPS
from mtjax.parallel.tensor_ops import enter_tensor_region, exit_tensor_region, tensor_rank
from mtjax.parallel.vocab import VocabParallelEmbedding

# Where offloaded residuals go: from accelerator memory to page-locked host memory.
HOST = ("device", "pinned_host")


def _offload_everything(prim, *args, **params):
    """recompute=none or selective with offload: every residual is kept, in host memory. (Offloading only the
    weight matmuls' outputs and keeping the rest on device moves nothing: the backward then reads
    what follows each matmul, the bias add or the activation's input, which stays on device.)
    The sequence-parallel all-gathers' outputs are gathered again instead (`_all_but_gathers`)."""
    return Offloadable(*HOST) if _all_but_gathers(prim) else False


def _all_but_gathers(prim, *args, **params):
    """recompute=none: keep every residual but the all-gathers' outputs. With sequence
    parallelism those are the [b, s, h] norm outputs entering QKV and fc1: the layer keeps their
    [b, s/t, h] shard (the gather's input) and the backward gathers again, as Megatron does."""
    return prim is not lax.all_gather_p


REMAT_POLICIES = {
    # (recompute, offload) -> jax.checkpoint policy of one layer; None would keep every residual
    # (no checkpoint at all). Selective (Korthikanti et al.) keeps what none keeps except the
    # attention core's scores, mask and probabilities: the core itself keeps only Q, K, V
    # (`SelfAttention.recompute_core`), so its policy is none's.
    ("none", False): _all_but_gathers,
    ("none", True): _offload_everything,
    ("selective", False): _all_but_gathers,
    ("selective", True): _offload_everything,
    # full keeps only each layer's input (the scan carry): nothing to offload (refused by validate)
    ("full", False): jax.checkpoint_policies.nothing_saveable,
}


@dataclass(frozen=True)
class Recompute:
    """What each layer's backward keeps (`train.recompute`, resolved into the step plan)."""

    mode: str = "none"       # none | selective | full | block (see `layer_plan`)
    layers: int = 0          # block: the first N of the layers a model chunk holds are recomputed
    offload: bool = False    # saved residuals go to host memory

    @property
    def core_attention(self) -> bool:
        """Selective: the attention core keeps only its inputs and runs again in the backward."""
        return self.mode == "selective"


def layer_plan(recompute: str, num_layers: int, recompute_layers: int = 0,
               offload: bool = False) -> list[tuple[int, object]]:
    """[(layer count, checkpoint policy)] in layer order: consecutive layers that save the same.

    block (Megatron's --recompute-method block): the first N = `recompute_layers` layers save
    only their input and recompute everything in the backward; the other l - N save every
    residual, as `none` (with offload: every residual in host memory).
    N = 0 is `none`, N = l is `full`. The other modes: one run of l layers."""
    if recompute != "block":
        return [(num_layers, REMAT_POLICIES[recompute, offload])]
    runs = [(recompute_layers, REMAT_POLICIES["full", False]),
            (num_layers - recompute_layers, REMAT_POLICIES["none", offload])]
    return [(n, policy) for n, policy in runs if n > 0]


class Block(nn.Module):
    """x + Attn(Norm(x)), then x + MLP(Norm(x)); each sublayer crosses the tensor region once."""

    cfg: ModelConfig
    ctx: ParallelContext
    dtype: jnp.dtype = jnp.float32
    deterministic: bool = True
    attention: str = "xla"           # the core attention kernel (`core_attention.KERNELS`)
    recompute_core: bool = False     # selective recomputation of the attention core

    @nn.compact
    def __call__(self, x, rope, cache: KVCache | None = None, positions=None):
        """-> (x, this layer's cache updated, or None without one; see `SelfAttention`)."""
        c, t, sp = self.cfg, self.ctx.tensor, self.ctx.sp
        y = make_norm(c.arch, c.norm_eps, "ln_attn")(x)
        y = enter_tensor_region(y, t, sp)                                   # [b, s, h]
        attention = SelfAttention(c, self.ctx, self.dtype, self.attention, self.recompute_core, name="attn")
        y, cache = attention(y, rope, self.deterministic, cache, positions)
        x = x + dropout(self, y, c.dropout, self.deterministic, t, split=sp)
        y = make_norm(c.arch, c.norm_eps, "ln_mlp")(x)
        y = enter_tensor_region(y, t, sp)                                   # [b, s, h]
        y = MLP(c, self.ctx, self.dtype, name="mlp")(y)
        x = x + dropout(self, y, c.dropout, self.deterministic, t, split=sp)
        return x, cache


def scan_layers(block: Block, params, keys, x, rope, policy, cache: KVCache | None = None, positions=None,
                sink=None, taps=None):
    """(x through the layers whose stacked parameters are `params` (leaves [n, ...]), their
    cache): layer i draws its dropout from keys[i] (keys None when deterministic) and decodes
    from cache[i] (leaves [n, b, S, k_r, d]; None when not decoding, and so is the cache returned).
    With a `policy`, each layer is a `jax.checkpoint`: its backward keeps what the policy saves and
    recomputes the rest. `sink` = (fn, stacked tree [n, ...]): layer i runs with weights
    fn(params[i], tree[i]), an identity whose backward sees layer i's weight gradient as soon as
    the backward has made it (the training step reduces it over `data` there). `taps` (stacked
    [n, ...]): layer i's matmuls are tapped with taps[i] (`parallel/taps.py`, the split backward)."""
    fn, sinks = sink if sink is not None else (None, None)

    def run(x, p, key, kv, tap):
        rngs = {} if key is None else {"dropout": key}
        variables = {"params": p} if tap is None else {"params": p, TAPS: tap}
        return block.apply(variables, x, rope, kv, positions, rngs=rngs)

    if policy is not None:
        run = jax.checkpoint(run, policy=policy, prevent_cse=False)   # scan already blocks CSE

    def layer(x, xs):
        p, key, kv, into, tap = xs
        if fn is not None:
            p = fn(p, into)     # outside the checkpoint: the sink is no residual of the layer's policy
        return run(x, p, key, kv, tap)

    return lax.scan(layer, x, (params, keys, cache, sinks, taps))


class Transformer(nn.Module):
    """GPT (LayerNorm, learned positions, GeLU) or Llama (RMSNorm, RoPE, SwiGLU, GQA).

    Three parts that a pipeline stage can run separately (`apply(..., method=...)`):
    `embed_tokens_to_stream` on the first stage, `run_layers` on every stage (its `num_layers`
    local layers), `head` on the last stage.
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

    def embed_tokens_to_stream(self, tokens, positions=None):
        """tokens [b, s] -> residual stream [b, s, h] or [b, s/t, h]; s <= model.seq_len.
        `positions` [b, s] (decoding, no sequence parallelism): the tokens' positions, by default
        0 .. s - 1."""
        c, t, sp = self.cfg, self.ctx.tensor, self.ctx.sp
        s = tokens.shape[1]
        if s > c.seq_len:
            raise ValueError(f"an input of {s} tokens is longer than model.seq_len {c.seq_len}")
        if sp and s % t:
            raise ValueError(f"sequence parallelism splits the {s} input tokens over parallel.tensor {t}: "
                             "give a multiple of it")
        x = exit_tensor_region(self.embed(tokens).astype(self.dtype), t, sp)   # [b, s(/t), h]
        if c.arch == "gpt" and positions is not None:
            x = x + jnp.take(self.pos_embedding, positions, axis=0).astype(self.dtype)   # [b, s, h]
        elif c.arch == "gpt":
            rows = x.shape[1]                                               # s, or s/t with SP
            pos = lax.dynamic_slice_in_dim(self.pos_embedding, tensor_rank(t) * rows if sp else 0, rows)
            x = x + pos[None].astype(self.dtype)
        return dropout(self, x, c.dropout, self.deterministic, t, split=sp)

    @property
    def depth(self) -> int:
        return self.num_layers or self.cfg.num_layers

    @property
    def layer_runs(self) -> tuple[int, ...]:
        """Layer counts of the runs `run_layers` scans, in order (`layer_plan`): (l,), or block
        mode's (N, l - N)."""
        return tuple(n for n, _ in self._layer_plan())

    def run_layers(self, x, runs=None, sinks=None, taps=None):
        """[b, s(/t), h] -> [b, s(/t), h] through the stacked blocks, in runs of layers that
        save the same residuals (`layer_plan`); layer i draws dropout from the i-th split of one
        key, so every recompute mode sees the same masks.

        `runs`, if given, holds the runs' stacked parameters ([n_k, ...] leaves, counts
        `layer_runs`) cut by the caller, so that they enter a surrounding `jax.vjp` as
        parameters rather than as slices computed inside it: a pipeline stage recognises the
        weights among its pullback's residuals by identity and does not stash them. `sinks`, if
        given, holds the `grad_sink` slots the same way (else they come from the collection).
        `taps`, if given, holds each run's taps (`zero_taps`): the split backward's
        (`parallel/taps.py`)."""
        l = self.depth
        block, rope = self._block_and_rope(x)
        if runs is None:
            runs = self._cut_runs(self._stacked_layers(block, x, rope))
        plan = self._layer_plan()
        keys = None if self.deterministic else jax.random.split(self.make_rng("dropout"), l)
        if sinks is None:
            sinks = (self._cut_runs(self.get_variable("grad_sink", "layers")) if self.grad_sink is not None
                     else (None,) * len(plan))
        taps = (None,) * len(plan) if taps is None else taps
        first = 0
        for (count, policy), params, into, tap in zip(plan, runs, sinks, taps, strict=True):
            rows = None if keys is None else lax.slice_in_dim(keys, first, first + count)
            sink = None if into is None else (self.grad_sink, into)
            x, _ = scan_layers(block, params, rows, x, rope, policy, sink=sink, taps=tap)
            first += count
        return x

    def zero_taps(self, x, runs):
        """The taps `run_layers` takes for input x [b, s(/t), h] and runs: per run, each matmul's
        (X, Y)-shaped zeros stacked over the run's layers, [n_k, b, s, ...]."""
        block, rope = self._block_and_rope(x)

        def one_layer(p):
            _, made = block.apply({"params": p}, x, rope, rngs={"dropout": jax.random.key(0)}, mutable=[TAPS])
            return made[TAPS]
        out = []
        for params, n in zip(runs, self.layer_runs, strict=True):
            shapes = jax.eval_shape(one_layer, jax.tree.map(lambda w: w[0], params))
            out.append(jax.tree.map(lambda a, n=n: jnp.zeros((n, *a.shape), a.dtype), shapes))
        return tuple(out)

    def _block_and_rope(self, x):
        """The Block the layer scan runs, and Llama's rotary tables for x's tokens (None for GPT)."""
        c = self.cfg
        s = x.shape[1] * self.ctx.tensor if self.ctx.sp else x.shape[1]     # the tokens, not this rank's rows
        rope = rope_tables(jnp.arange(s), c) if c.arch == "llama" else None
        return self.make_block(), rope

    def make_block(self) -> nn.Module:
        """The block `run_layers` scans (the grid model's differs: `grid_model.py`)."""
        return Block(self.cfg, self.ctx, self.dtype, self.deterministic, self.attention,
                     self.recompute.core_attention, parent=None)

    def _stacked_layers(self, block: Block, x, rope):
        """The `depth` blocks' parameters, every leaf [l, ...] with the logical axis `layers`
        first. Initialising declares them: `block.init` once per layer (vmapped over l keys split
        from one), so the layers are built by the very Block that `scan_layers` then runs, at
        init as at apply."""
        if self.is_initializing() and not self.has_variable("params", "layers"):
            keys = jax.random.split(self.make_rng("params"), self.depth)
            stack = jax.vmap(lambda k: block.init({"params": k}, x, rope)["params"])(keys)
            self.put_variable("params", "layers", nn.meta.add_axis(stack, 0, {nn.PARTITION_NAME: "layers"}))
        return nn.unbox(self.variables["params"]["layers"])

    def _layer_plan(self) -> list[tuple[int, object]]:
        r = self.recompute
        return layer_plan(r.mode, self.depth, r.layers, r.offload)

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
        x = enter_tensor_region(self.ln_final(x), t, sp)                   # [b, s, h]
        if self.cfg.tied:
            return self.embed.attend(x)
        return self.lm_head(x)

    def __call__(self, tokens):
        """tokens [b, s] -> this rank's logits [b, s, V/t]."""
        return self.head(self.run_layers(self.embed_tokens_to_stream(tokens)))

    def decode(self, tokens, cache: KVCache, start, last=None):
        """Tokens [b, n] at positions start[r] .. start[r] + n - 1 of each row r (start [b]) through
        the model, reading earlier positions' keys and values from `cache` (leaves [l, b, S, k_r, d],
        all l layers here, S = model.seq_len) and writing theirs -> (this rank's logits [b, n, V/t],
        or [b, 1, V/t] at index last[r] of each row when `last` [b] is given; the cache).
        start + n <= S. One pass over a prompt fills the cache (prefill), then one token per pass."""
        c = self.cfg
        if self.ctx.sp or self.depth != c.num_layers:
            raise ValueError("decoding runs every layer of the model, without sequence parallelism")
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=start.dtype)[None, :]   # [b, n]
        x = self.embed_tokens_to_stream(tokens, positions)                   # [b, n, h]
        rope = rope_tables(positions, c) if c.arch == "llama" else None
        block = Block(c, self.ctx, self.dtype, self.deterministic, self.attention, parent=None)
        x, cache = scan_layers(block, self._stacked_layers(block, x, rope), None, x, rope, None, cache, positions)
        if last is not None:
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)          # [b, 1, h]
        return self.head(x), cache

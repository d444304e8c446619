"""One Transformer layer (`Block`), how a stack of them runs (`scan_layers`), and what each
layer's backward keeps (`Recompute`, `layer_plan`, the `jax.checkpoint` policies).

Shape legend: b micro-batch, s sequence, h hidden, t tensor size, l layers. With sequence
parallelism the residual stream is [b, s/t, h]; otherwise [b, s, h], replicated over `tensor`.
"""
from __future__ import annotations


from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import Offloadable

from mtjax.config.schema import ModelConfig
from mtjax.model.attention import KVCache, SelfAttention
from mtjax.model.dropout import dropout
from mtjax.model.joined_columns import COLLECTION as JOINED
from mtjax.model.mlp import MLP
from mtjax.model.moe import MoE
from mtjax.model.norms import make_norm
from mtjax.model.stash_scan import stash_scan
from mtjax.parallel.context import ParallelContext
from mtjax.parallel.half_batches import split_layer
from mtjax.parallel.taps import COLLECTION as TAPS
from mtjax.parallel.tensor_ops import enter_tensor_region


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
    [b, s/t, h] shard (the gather's input) and the backward gathers again, as Megatron does. A
    fence's outputs (`ring.fence`, `parallel/half_batches.py`) are not kept either: they are its
    inputs, kept (or gathered again) as those are."""
    return prim is not lax.all_gather_p and prim is not lax.optimization_barrier_p


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
    if not 0 <= recompute_layers <= num_layers:   # validate refuses it; a run of more rows than exist
        raise ValueError(f"block recomputation of {recompute_layers} of {num_layers} layers")
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
    dense: bool = False              # a dense MLP even in a mixture-of-experts model (`layer_pattern.py`)

    @nn.compact
    def __call__(self, x, rope, cache: KVCache | None = None, positions=None, segments=None,
                 prefix: KVCache | None = None, export_kv: bool = False):
        """-> (x, this layer's cache updated, or None without one; see `SelfAttention`; `segments`:
        packed rows' document ids [b, s_row]). Sequence halves (`halved`): `export_kv` returns
        this half's keys and values in the cache's place, `prefix` holds the first half's."""
        c, t, sp = self.cfg, self.ctx.tensor, self.ctx.sp
        y = make_norm(c.arch, c.norm_eps, "ln_attn")(x)
        y = enter_tensor_region(y, t, sp, self.ctx.tensor_overlap, self.ctx.ring_by_all_to_all,
                                sequence_major=True, fused=not self.ctx.half_batches)
        # y: [b, s, h] -> [b, s, h] (f), or with sp [b, s/t, h] left as a `SequenceShard` for QKV to gather
        attention = SelfAttention(c, self.ctx, self.dtype, self.attention, self.recompute_core, name="attn")
        y, cache = attention(y, rope, self.deterministic, cache, positions, segments, prefix, export_kv)
        x = x + dropout(self, y, c.dropout, self.deterministic, t, sp, self.ctx.context)
        y = make_norm(c.arch, c.norm_eps, "ln_mlp")(x)
        if c.moe and not self.dense:   # routes the stream it is given, then enters the region itself (`model/moe.py`)
            y = MoE(c, self.ctx, self.dtype, name="moe")(y, segments)
        else:                          # y: as at the attention's entry
            y = enter_tensor_region(y, t, sp, self.ctx.tensor_overlap, self.ctx.ring_by_all_to_all,
                                    sequence_major=True, fused=not self.ctx.half_batches)
            y = MLP(c, self.ctx, self.dtype, name="mlp")(y)
        x = x + dropout(self, y, c.dropout, self.deterministic, t, sp, self.ctx.context)
        return x, cache


def scan_layers(block: Block, params, keys, x, rope, policy, cache: KVCache | None = None, positions=None,
                sink=None, taps=None, segments=None, joined=None, main_grad=None):
    """(x through the layers whose stacked parameters are `params` (leaves [n, ...]), their
    cache): layer i draws its dropout from keys[i] (keys None when deterministic) and decodes
    from cache[i] (leaves [n, b, S, k_r, d]; None when not decoding, and so is the cache returned).
    With a `policy`, each layer is a `jax.checkpoint`: its backward keeps what the policy saves and
    recomputes the rest. `sink` = (fn, stacked tree [n, ...]): layer i runs with weights
    fn(params[i], tree[i]), an identity whose backward sees layer i's weight gradient as soon as
    the backward has made it (the training step reduces it over `data` there). `taps` (stacked
    [n, ...]): layer i's matmuls are tapped with taps[i] (`parallel/taps.py`, the split backward).
    `segments` [b, s_row]: packed rows' document ids, the same for every layer. A training run
    (no cache or taps; not offloaded) is `stash_scan`: the same values, its stash in
    uninitialised buffers; `joined` (its `COLLECTION` variables stacked [n, ...],
    `joined_columns.join_columns`): the layers' joined column kernels, left out of `params`;
    `main_grad` ({"params": fp32 [n, ...] as params, "joined": as joined}): the accumulated weight
    gradients the backward adds into (`stash_scan`'s gradient accumulation fusion)."""
    fn, sinks = sink if sink is not None else (None, None)
    if cache is None and positions is None and taps is None and policy is not _offload_everything:
        ctx = getattr(block, "ctx", None)                         # (a tensor grid's block has none)
        halves, sequence = ctx is not None and ctx.half_batches, ctx is not None and ctx.sequence_halves
        params = (params, {} if joined is None else joined)   # (the weights, the joined kernels' rows)

        def one(x, p, key, rope, segments, prefix=None):     # training: the stash in uninitialised buffers
            rngs, variables = {} if key is None else {"dropout": key}, {"params": p[0], JOINED: p[1]}
            if sequence:                                    # (a `Block`: -> (x, its K, V))
                return block.apply(variables, x, rope, None, None, segments, prefix, True, rngs=rngs)
            return block.apply(variables, x, rope, None, None, segments, rngs=rngs)[0]
        one = one if policy is None else jax.checkpoint(one, policy=policy, prevent_cse=False)
        group = 1
        if halves:     # each half's backward keeps what the policy saves
            group = ctx.half_batch_unit(jax.tree.leaves(params)[0].shape[0])
            one = halved(one, group, sequence)
        if sink is not None:                                # (the slots are the parameters')
            sink = (lambda w, slots, fn=sink[0]: (fn(w[0], slots), w[1]), sink[1])
        if main_grad is not None:                           # shaped as (params, joined)
            main_grad = (main_grad["params"], {} if joined is None else main_grad["joined"])
        return stash_scan(one, params, keys, x, rope, segments, sink, group, main_grad), None

    assert not joined and main_grad is None, "joined kernels and main_grad are a training run's (no cache, taps or offload)"

    def run(x, p, key, kv, tap):
        rngs = {} if key is None else {"dropout": key}
        variables = {"params": p} if tap is None else {"params": p, TAPS: tap}
        return block.apply(variables, x, rope, kv, positions, segments, rngs=rngs)

    if policy is not None:
        run = jax.checkpoint(run, policy=policy, prevent_cse=False)   # scan already blocks CSE

    def layer(x, xs):
        p, key, kv, into, tap = xs
        if fn is not None:
            p = fn(p, into)     # outside the checkpoint: the sink is no residual of the layer's policy
        return run(x, p, key, kv, tap)

    return lax.scan(layer, x, (params, keys, cache, sinks, taps))


def halved(one, group: int = 1, sequence: bool = False):
    """A training layer run(x, W, key, rope, segments) on x [b, ...] as its two halves
    interleaved (`parallel/half_batches.py`): the same values, each half's dropout drawn from the
    layer's key folded with the half. Packed rows (`segments` [b, s]) have per-row rotary tables
    ([b, s, d/2]): each half takes its rows of both. With `group` g > 1 the run is g consecutive
    layers (W and key g-tuples, `stash_scan.layer_rows`) interleaved as one, so that the halves'
    windows cross the layers' boundaries: only the group's first collective waits alone.

    `sequence`: the halves are the sequence's, x [b, n, h] -> [b, n/2, h] each: the rank's rows of
    the first half of the positions, then of the second (with sequence parallelism the stream is
    laid out so, `sequence_halves.stream_order`); each takes its half of the rotary table, and
    one(x, W, key, rope, segments, prefix) -> (x, the layer's K, V): the first half's K, V go to
    the second half's same layer as its `prefix` (causal attention: the second half reads the
    first, never the other way round)."""
    def layer(x, rest, shared, passed):
        keys, rows, rows_rope = rest
        weights = shared[0] if group > 1 else (shared[0],)
        keys = keys if group > 1 and keys is not None else (keys,) * group
        rope = shared[1] if rows_rope is None else rows_rope
        made = []
        for i, (w, key) in enumerate(zip(weights, keys, strict=True)):
            if sequence:
                x, kv = one(x, w, key, rope, rows, None if passed is None else passed[i])
                made.append(kv)
            else:
                x = one(x, w, key, rope, rows)
        return x, (tuple(made) if sequence else None)
    paired = split_layer(layer, passes=sequence)

    def fold(key, half: int):
        if key is None:
            return None
        return jax.random.fold_in(key, half) if group == 1 else tuple(jax.random.fold_in(k, half) for k in key)

    def run(x, p, key, rope, segments):
        if sequence:                     # (packed rows are refused with sequence halves)
            n = x.shape[1] // 2
            ropes = ((None, None) if rope is None else          # each half its positions' rows of the tables
                     (jax.tree.map(lambda a: a[:a.shape[0] // 2], rope),
                      jax.tree.map(lambda a: a[a.shape[0] // 2:], rope)))
            ya, yb = paired((x[:, :n], (fold(key, 0), None, ropes[0])), (x[:, n:], (fold(key, 1), None, ropes[1])),
                            (p, None))
            return jnp.concatenate([ya, yb], axis=1)
        h = x.shape[0] // 2
        rows = (None, None) if segments is None else (segments[:h], segments[h:])
        per_row = segments is not None and rope is not None
        ropes = ((jax.tree.map(lambda a: a[:h], rope), jax.tree.map(lambda a: a[h:], rope)) if per_row
                 else (None, None))
        ya, yb = paired((x[:h], (fold(key, 0), rows[0], ropes[0])), (x[h:], (fold(key, 1), rows[1], ropes[1])),
                        (p, None if per_row else rope))
        return jnp.concatenate([ya, yb], axis=0)
    return run

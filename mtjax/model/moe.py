"""The mixture-of-experts layer in place of the MLP: an fp32 router, top-k routing with capacity,
experts split over e expert ranks (and their inner size over `tensor`), an optional shared expert.

Shape legend: b micro-batch, s tokens of a row (s/c with context parallelism), h hidden, E
experts, k chosen per token, f_e an expert's inner size, t tensor, e expert ranks, E_r = E/e.

    scores  = softmax(x W_r) or sigmoid(x W_r)          fp32, W_r [h, E]
    chosen  = top-k of the scores; gate_j = score_j (/ sum of the k, `moe_renormalize`)
    y_t     = sum_j gate_j Expert_{chosen_j}(x_t) (+ SharedExpert(x_t), times sigmoid(x_t w_g) with
              `moe_shared_expert_gate`, w_g [h, 1] fp32: Qwen2-MoE),
    Expert  = GeLU(x A) B, or (SiLU(x A_g) * x A_u) B  (no biases)

Parallel layout: the router runs on the residual stream this rank holds (s/t rows under sequence
parallelism; W_r's gradient then a partial sum, declared `sequence_parallel`), and its fp32 logits
enter the tensor region like the hidden states, so every tensor rank routes the whole row the same
way. The experts' inner dimension is split over `tensor` (expert tensor parallelism: column A,
row B, one exit, as the MLP); the routed tokens go to their experts' ranks by an all-to-all
(`parallel/expert_dispatch.py`). With `parallel.tensor_overlap` the attention (and the shared
expert's row layer) runs its rings (`parallel/collective_matmul.py`); the experts keep their
all-gather and reduce-scatter, since the router reads whole rows. Expert weights are declared
[E, ...] (a shape no e changes) and each rank computes with its E_r: they arrive as those alone
when e = d c (`experts_split`), else whole; their gradients, zero outside a rank's experts, sum
over the replicas with every other layer's. Under split schedules (zb, zbv) the expert products
(`taps.grouped`), the router and the shared gate are tapped: their X^T dY is W's, not B's.

Padding (packed fine-tuning rows: the tokens after a row's last sample, `model/documents.py`
`real_tokens`) is routed nowhere: it takes no slot (it ranks after every real entry and is then
dropped), its output is 0 (the shared expert's aside: a dense MLP on every token, as the dense
layers are), and it counts in none of the sums below. Its output is never read (causal: it
follows every real token; its labels carry no loss).

Auxiliary losses, per MoE layer, added to the objective (their gradients only; the reported loss
is the cross-entropy):
    balance = moe_aux_loss_coeff * mean over rows of E/(k S^2) sum_x n_x P_x
        n_x: the row's entries routed to x (before drops), P_x: sum over the row of x's score
        (sigmoid scores normalised per token), S the row's length: a per-row (DeepSeek's
        sequence-wise) loss, the same sum on any batch split, micro-batches and pipelines included;
    z = moe_z_loss_coeff * mean over rows of (1/S) sum over the row of logsumexp(logits)^2,
with the row's real tokens only (S: their count; s without padding). Both are sums over rows
divided by the global batch B (`ParallelContext.batch_rows`), as the cross-entropy is, and enter
the backward through `attach` (identity forward, gradient S for the loss, the step's loss scale:
1 but in fp16): no value has to travel through the layer scan or the pipeline. The routing's
statistics leave the same way, as the "gradient" of a zero parameter `stats` [E + 3]
(`training/moe_stats.py` takes them out before the optimizer sees them);
the same parameter brings S in: the step hands the layers `stats` filled with S - 1
(`moe_stats.carry_loss_scale`; stored, it is 0: S = 1). `bias` [E] (with
`moe_router_bias`): the aux-loss-free balancing bias, added to the scores that choose the experts
only, never differentiated, moved once per global batch from the loads (`moe_stats.py`).
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mtjax.config.schema import ModelConfig
from mtjax.mesh import CONTEXT, TENSOR
from mtjax.model.documents import real_tokens
from mtjax.model.mlp import GELUS, MLP
from mtjax.parallel import expert_dispatch as ed
from mtjax.parallel import taps
from mtjax.parallel.context import ParallelContext
from mtjax.parallel.context_ops import all_positions, context_rank, split_row
from mtjax.parallel.layers import declare, local
from mtjax.parallel.tensor_ops import enter_tensor_region, exit_tensor_region


def stays_fp32(path: tuple) -> bool:
    """A leaf the 16-bit compute copy keeps in fp32 (`layout.compute_params`): the aux-loss-free
    bias, which only chooses experts. Rounded to bf16 (spacing 2^-9 near 0.3, against a step of
    `moe_router_bias_rate` = 1e-3) it would tie experts the fp32 bias tells apart; Megatron keeps
    its `expert_bias` fp32 for the same reason. `path`: the leaf's dict keys."""
    return path[-2:] == ("moe", "bias")


def step_fp32(path: tuple) -> bool:
    """A leaf whose value in the train step is not its compute copy's (the master rounded to the
    compute dtype): the fp32 bias (`stays_fp32`), and `stats`, which the step fills with S - 1
    (`training/moe_stats.carry_loss_scale`; 2^16 - 1 has no bf16 or fp16 form). FSDP gathers
    these in fp32 and every other leaf in the compute dtype (`parallel/fsdp.py`)."""
    return stays_fp32(path) or path[-2:] == ("moe", "stats")


class Routing(NamedTuple):
    expert: jax.Array    # [b, n] int32, n = s k: token-major, choice-minor
    gate: jax.Array      # [b, n] fp32
    pos: jax.Array       # [b, n] int32: slot within (row, expert); >= capacity: dropped
    capacity: int
    loss: jax.Array      # scalar: this rank's share of the auxiliary losses
    stats: jax.Array     # [E + 3]: this rank's routed entries per expert (before drops), entries
                         # kept, sum over rows of the balance term, of the z term (mean over the row)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def attach(row_axes, y, loss, probe, stats):
    """y, whose backward also gives `loss` the cotangent S = 1 + probe[0] (it joins the objective,
    scaled as the cross-entropy is: S is fp16's loss scale, `moe_stats.carry_loss_scale`) and
    `probe` (`MoE`'s parameter `stats`, zero where stored) the cotangent `stats`: the step's gradient
    sums over micro-batches, stages and replicas then deliver the global sums (`training/moe_stats.py`).

    Only where the backward is a real one, nothing where y's cotangent is all zeros on every rank
    of `row_axes` (the mesh axes that split the rows' tokens: `row_axes(ctx)`): the pipeline runs
    backwards with zero cotangents where a stage has no work in a tick (its last tick with the data
    reduction inside, `pipeline.executor.last_backward_reduces`), trusting a zero cotangent to give
    zero gradients. A real cotangent is not all zeros on the whole rows (every layer reaches the
    loss), but may be on one rank's part of them: a packed row's padding and its last EOD reach no
    loss (causal, their labels carry none), and a sequence-parallel or context rank can hold only
    those."""
    return y


def _attach_fwd(row_axes, y, loss, probe, stats):
    return y, (stats, 1.0 + probe[0].astype(jnp.float32))


def _attach_bwd(row_axes, saved, dy):
    stats, scale = saved
    real = jnp.any(dy != 0)    # a non-finite dY (fp16 overflow: a skipped step) is real
    if row_axes:
        real = lax.psum(real.astype(jnp.int32), row_axes) > 0
    real = real.astype(jnp.float32)
    return dy, real * scale, real * stats, jnp.zeros_like(stats)


attach.defvjp(_attach_fwd, _attach_bwd)


def row_axes(ctx: ParallelContext) -> tuple[str, ...]:
    """The mesh axes whose ranks hold parts of the same rows of the MoE's output: `tensor` under
    sequence parallelism, `context`."""
    return (TENSOR,) * (ctx.sp and ctx.tensor > 1) + (CONTEXT,) * (ctx.context > 1)


def route(logits, cfg: ModelConfig, ctx: ParallelContext, bias=None, real=None) -> Routing:
    """logits [b, s, E] fp32 (whole rows, the same on every tensor rank) -> the routing. `bias` [E]
    (aux-loss-free balancing) shifts the scores that choose the experts, not the gates. `real`
    bool [b, c s] (the whole rows'; None: every token): False on padding, routed nowhere."""
    b, s, E = logits.shape
    k = cfg.moe_top_k
    scores = jax.nn.softmax(logits, -1) if cfg.moe_score == "softmax" else jax.nn.sigmoid(logits)
    choose = lax.stop_gradient(scores if bias is None else scores + lax.stop_gradient(bias)[None, None, :])
    top, expert = lax.top_k(choose, k)                                       # [b, s, k]
    gate = jnp.take_along_axis(scores, expert, -1)
    if cfg.moe_renormalize:
        gate = gate / jnp.sum(gate, -1, keepdims=True)
    expert, top, gate = (a.reshape(b, s * k) for a in (expert, top, gate))
    mine = jnp.ones((b, s), bool) if real is None else split_row(real, ctx.context)    # this rank's tokens
    entries = jnp.repeat(mine, k, axis=1)                                    # [b, n], token-major
    cap, pos = _capacity_slots(expert, jnp.where(entries, top, -jnp.inf), cfg, ctx.context)   # padding ranks last
    pos = jnp.where(entries, pos, cap)                                       # and is dropped
    routed = (jnp.arange(E)[None, None, :] == expert[..., None]) & entries[..., None]
    counts = jnp.sum(routed, axis=1).astype(jnp.float32)                    # [b, E]
    length = s * ctx.context if real is None else jnp.maximum(jnp.sum(real, 1), 1).astype(jnp.float32)
    balance, z = _balance_and_z(logits, scores, counts, mine, length, cfg, ctx)
    stats = jnp.concatenate([jnp.sum(counts, 0), jnp.sum(pos < cap, dtype=jnp.float32)[None],
                             lax.stop_gradient(jnp.stack([balance, z]))])
    return Routing(expert, gate, pos, cap, _objective_share(balance, z, cfg, ctx), stats)


def _capacity_slots(expert, top, cfg: ModelConfig, c: int):
    """expert, top [b, n] (n = s k, this rank's entries) -> (C, pos [b, n]): capacity and each
    entry's slot. Capacity is per row: with context parallelism (c > 1) C counts the whole row's
    c s tokens, and each entry is ranked among the row's entries of all c ranks (gathered over
    `context`, [b, c n], tied scores broken by true token position), so the same tokens are
    dropped as on one device. Dropless (factor 0) keeps every entry: each rank's own s slots."""
    E, k, n = cfg.num_experts, cfg.moe_top_k, expert.shape[1]
    if c == 1 or not cfg.moe_capacity_factor:
        return ed.capacity(cfg.moe_capacity_factor, n // k, k, E), ed.slots(expert, top, E)
    cap = ed.capacity(cfg.moe_capacity_factor, c * n // k, k, E)
    token = all_positions(c * n // k, c).reshape(-1)                            # [c s] rank-major
    entry = (token[:, None] * k + jnp.arange(k)[None, :]).reshape(-1)           # [c n]: token-major
    every = lambda a: lax.all_gather(a, CONTEXT, axis=1, tiled=True)             # noqa: E731  [b, n] -> [b, c n]
    pos = ed.slots(every(expert), every(top), E, entry)                         # [b, c n]
    return cap, lax.dynamic_slice_in_dim(pos, context_rank(c) * n, n, axis=1)    # [b, n]: this rank's


def _balance_and_z(logits, scores, counts, mine, length, cfg: ModelConfig, ctx: ParallelContext):
    """(sum over this rank's rows of E/(k S^2) sum_x n_x P_x, of (1/S) sum over its tokens of
    logsumexp^2): `mine` [b, s] this rank's real tokens, `length` S (per row [b], or one for all)."""
    E = logits.shape[-1]
    if ctx.context > 1:     # n_x counts the row's other chunks too
        counts = lax.psum(counts, CONTEXT)      # [b, E], this chunk's -> the whole row's
    probs = scores if cfg.moe_score == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)
    probs = jnp.where(mine[..., None], probs, 0.0)                            # P_x over real tokens
    per_row = jnp.sum(lax.stop_gradient(counts) * jnp.sum(probs, axis=1), -1)          # [b]
    z = jnp.sum(jnp.where(mine, jnp.square(jax.nn.logsumexp(logits, -1)), 0.0), -1)   # [b]
    return jnp.sum(per_row * (E / cfg.moe_top_k) / length ** 2), jnp.sum(z / length)


def _objective_share(balance, z, cfg: ModelConfig, ctx: ParallelContext):
    """This rank's share of the auxiliary losses (module docstring), divided by t: every tensor rank
    computes it on the same rows and the logits' entry into the tensor region sums their gradients."""
    if not ctx.batch_rows:
        return jnp.zeros((), jnp.float32)
    return (cfg.moe_aux_loss_coeff * balance + cfg.moe_z_loss_coeff * z) / (ctx.batch_rows * ctx.tensor)


class Experts(nn.Module):
    """The E experts' weights ([E, h, f_e/t], [E, f_e/t, h]; E_r rows, not E, when `experts_split`) and
    their work on routed tokens."""

    cfg: ModelConfig
    ctx: ParallelContext
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, r: Routing):
        """x [b, s, h] (inside the tensor region) -> partial [b, s, h] fp32 (summed by the exit)."""
        c, ctx = self.cfg, self.ctx
        E, h, e = c.num_experts, c.hidden_size, ctx.expert
        f = local(c.expert_ffn_size, ctx.tensor)
        inner = nn.initializers.normal(c.init_std)
        outer = nn.initializers.normal(c.init_std / jnp.sqrt(2.0 * c.num_layers))
        names = ("gate", "up") if c.mlp_activation == "swiglu" else ("fc1",)
        held = E // e if ctx.experts_split else E        # stored split (e = d c), or whole
        w_in = [declare(self, n, (held, h, f), ("expert", "embed", "mlp"), inner) for n in names]
        w_out = declare(self, "fc2", (held, f, h), ("expert", "mlp", "embed"), outer)
        blocks = held // (E // e)                         # G: 1 (stored split) or e (whole)
        rank = ed.expert_rank(e, ctx.expert_axes) if blocks > 1 else 0
        mine = lambda w: (w if blocks == 1 else lax.dynamic_slice_in_dim(w, rank * (E // e), E // e)  # noqa: E731
                          ).astype(self.dtype)
        place = jax.nn.one_hot(rank, blocks)              # where W puts this rank's dA (`taps.grouped`)
        buf = ed.dispatch(x.astype(self.dtype), r.expert, r.pos, E, r.capacity, c.moe_top_k)   # [E, b, C, h]
        got = ed.exchange(buf, e, ctx.expert_axes, ctx.replicas)                      # [e E_r, b, C, h]
        tokens = got.reshape(e, E // e, -1, h).transpose(1, 0, 2, 3).reshape(E // e, -1, h)   # [E_r, e b C, h]
        hidden = [taps.grouped(self, n, tokens, mine(w), place) for n, w in zip(names, w_in)]   # [E_r, e b C, f]
        if c.mlp_activation == "swiglu":
            act = jax.nn.silu(hidden[0]) * hidden[1]
        else:
            act = GELUS[c.mlp_activation](hidden[0])
        out = taps.grouped(self, "fc2", act, mine(w_out), place)                    # [E_r, e b C, h]
        out = out.reshape(E // e, e, -1, h).transpose(1, 0, 2, 3).reshape(buf.shape)
        back = ed.exchange(out, e, ctx.expert_axes, ctx.replicas)                     # [e E_r, b, C, h] -> [E, b, C, h]
        return ed.combine(back, r.expert, r.pos, r.gate, c.moe_top_k)


class MoE(nn.Module):
    """Router, experts and shared expert (module docstring); replaces `MLP` in a `Block`."""

    cfg: ModelConfig
    ctx: ParallelContext
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, y, segments=None):
        """y [b, s, h] or [b, s/t, h] (the normed residual stream, outside the tensor region) -> the
        same shape, after the region's exit. `segments`: packed rows' document ids [b, s_row], the
        padding's marked (`model/documents.py`), or None."""
        c, t, sp = self.cfg, self.ctx.tensor, self.ctx.sp
        w_r = declare(self, "router", (c.hidden_size, c.num_experts), ("embed", None),
                      nn.initializers.normal(c.init_std), sequence_parallel=True)
        logits = taps.linear(self, "bsh,he->bse", y.astype(jnp.float32), w_r, "router")   # fp32, this rank's rows
        logits = enter_tensor_region(logits, t, sp)                                  # [b, s(/t), E] -> [b, s, E]
        x = enter_tensor_region(y, t, sp)                                            # [b, s(/t), h] -> [b, s, h]
        bias = declare(self, "bias", (c.num_experts,), (None,), nn.initializers.zeros) if c.moe_router_bias else None
        probe = declare(self, "stats", (c.num_experts + 3,), (None,), nn.initializers.zeros)
        r = route(logits, c, self.ctx, bias, None if segments is None else real_tokens(segments))
        # partial [b, s, h] -> [b, s(/t), h]
        out = exit_tensor_region(Experts(c, self.ctx, self.dtype, name="experts")(x, r).astype(self.dtype), t, sp)
        if c.moe_shared_expert_size:
            shared = replace(c, ffn_hidden_size=c.moe_shared_expert_size)
            y_s = MLP(shared, self.ctx, self.dtype, name="shared")(x)
            if c.moe_shared_expert_gate:   # Qwen2-MoE: sigmoid(y w_g) on the rows this rank holds
                w_g = declare(self, "shared_gate", (c.hidden_size, 1), ("embed", None),
                              nn.initializers.normal(c.init_std), sequence_parallel=True)
                gate = jax.nn.sigmoid(taps.linear(self, "bsh,ho->bso", y.astype(jnp.float32), w_g, "shared_gate"))
                y_s = y_s * gate.astype(self.dtype)
            out = out + y_s
        return attach(row_axes(self.ctx), out, r.loss, probe, r.stats)

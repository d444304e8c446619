"""An independent, plain single-device GPT/Llama: the oracle every parallel layout is compared to.

Written for clarity, not speed: no Flax, no scan, no sharding, a Python loop
over layers, heads expanded with jnp.repeat for grouped-query attention, the
full vocabulary softmax. It reads the same parameter tree (global shapes,
layers stacked on axis 0) that mtjax initialises. Every model option is implemented here
again, from its definition (the config fields only, no mtjax model code).
"""
import math
from decimal import Decimal

import jax
import jax.numpy as jnp
import numpy as np


def bcast(w, ndim):
    return w.reshape((1,) * (ndim - w.ndim) + w.shape)


def layer_norm(x, p, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * bcast(p["scale"], 3) + bcast(p["bias"], 3)


def rms_norm(x, p, eps):
    return x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * bcast(p["scale"], 3)


def head_rms_norm(x, p, eps):
    """x [b, s, n, d]: RMSNorm of each head over d, one scale [d]."""
    return x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * bcast(p["scale"], 4)


def rope_frequency(i, d, cfg):
    """Frequency i of d/2, in float64: theta^(-2i/d); llama3 rescales it by its wavelength band
    (Meta's Llama 3.1 `apply_scaling`). Linear scaling divides the positions instead (`rope`)."""
    f = cfg.rope_theta ** (-2.0 * i / d)
    if cfg.rope_scaling != "llama3":
        return f
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength, context = 2 * math.pi / f, cfg.rope_original_positions
    if wavelength < context / high:
        return f
    if wavelength > context / low:
        return f / factor
    smooth = (context / wavelength - low) / (high - low)
    return (1 - smooth) * f / factor + smooth * f


def rope(x, cfg):
    """x [b, s, n, d]; rotate-half RoPE at positions 0 .. s-1 (divided by the factor for linear scaling)."""
    s, d = x.shape[1], x.shape[-1]
    positions = np.arange(s, dtype=np.float64)
    if cfg.rope_scaling == "linear":
        positions = positions / cfg.rope_scaling_factor
    freqs = np.array([rope_frequency(i, d, cfg) for i in range(d // 2)])
    ang = jnp.asarray(positions[:, None] * freqs[None, :], jnp.float32)
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def linear(x, p, n_in=1):
    """x [..., in...] @ kernel [in..., out...] (+ bias)."""
    k = p["kernel"]
    y = jnp.tensordot(x, k, axes=n_in)
    return y + bcast(p["bias"], y.ndim) if "bias" in p else y


def attention(x, p, cfg):
    a, kvh = cfg.num_heads, cfg.kv_heads
    d = cfg.kv_channels or cfg.hidden_size // a
    for name, heads in (("q", a), ("k", kvh), ("v", kvh)):
        assert p[name]["kernel"].shape == (cfg.hidden_size, heads, d), (name, p[name]["kernel"].shape)
        assert ("bias" in p[name]) == (cfg.arch == "gpt" or cfg.qkv_bias), name
    assert ("bias" in p["o"]) == (cfg.arch == "gpt")
    q, k, v = linear(x, p["q"]), linear(x, p["k"]), linear(x, p["v"])    # [b, s, n, d]
    assert ("q_norm" in p and "k_norm" in p) == cfg.qk_norm
    if cfg.qk_norm:     # each head over its d values, one scale shared by the heads (Qwen3)
        q, k = head_rms_norm(q, p["q_norm"], cfg.norm_eps), head_rms_norm(k, p["k_norm"], cfg.norm_eps)
    if cfg.arch == "llama":
        q, k = rope(q, cfg), rope(k, cfg)
    k = jnp.repeat(k, a // kvh, axis=2)
    v = jnp.repeat(v, a // kvh, axis=2)
    s = x.shape[1]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / jnp.sqrt(q.shape[-1] * 1.0)
    mask = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    out = jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(scores, -1), v)
    return linear(out, p["o"], n_in=2)


def gelu(x, activation):
    """gelu: x Phi(x) with the normal CDF through erf; gelu_tanh: its tanh approximation."""
    if activation == "gelu_tanh":
        return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    assert activation == "gelu", activation
    return 0.5 * x * (1 + jax.scipy.special.erf(x / math.sqrt(2)))


def mlp(x, p, cfg):
    activation = cfg.activation or {"gpt": "gelu", "llama": "swiglu"}[cfg.arch]
    if activation == "swiglu":
        return linear(jax.nn.silu(linear(x, p["gate"])) * linear(x, p["up"]), p["fc2"])
    return linear(gelu(linear(x, p["fc1"]), activation), p["fc2"])


def expert_capacity(cfg, s):
    """Slots per expert and row: ceil(factor s k / E) clipped to [1, s]; factor 0: s (dropless).
    In integers, the factor n/d read off the decimal it was written as: ceil(n s k / (d E))."""
    f, k, E = cfg.moe_capacity_factor, cfg.moe_top_k, cfg.num_experts
    n, d = Decimal(repr(f)).as_integer_ratio()
    return s if f == 0 else max(1, min(s, -(-n * s * k // (d * E))))


def expert_ffn(x, p, i, cfg):
    """Expert i of an MoE layer on x [b, s, h] (no biases)."""
    activation = cfg.activation or {"gpt": "gelu", "llama": "swiglu"}[cfg.arch]
    if activation == "swiglu":
        hidden = jax.nn.silu(x @ p["gate"][i]) * (x @ p["up"][i])
    else:
        hidden = gelu(x @ p["fc1"][i], activation)
    return hidden @ p["fc2"][i]


def kept_routes(scores, routed, cfg):
    """scores, routed [b, s, E] -> kept [b, s, E]: token t keeps expert e if routed there and fewer
    than C of its row's tokens routed to e beat it (a higher score, or the same and earlier)."""
    s = scores.shape[1]
    earlier = jnp.arange(s)[None, :, None, None] < jnp.arange(s)[None, None, :, None]   # [1, t', t, 1]
    beats = (scores[:, :, None, :] > scores[:, None, :, :]) | ((scores[:, :, None, :] == scores[:, None, :, :]) & earlier)
    rank = jnp.sum(beats & routed[:, :, None, :], axis=1)                       # [b, t, E]
    return routed & (rank < expert_capacity(cfg, s))


def moe(x, p, cfg):
    """Mixture of experts on x [b, s, h] -> (y, per-row balance sums [b], per-token z [b, s],
    (routes per expert [E], routes kept)).

    Each token takes its k highest-scored experts (softmax or sigmoid of x W_r, fp32), weighted
    by their scores (divided by the k scores' sum if renormalising); a router bias shifts the
    choice, not the weights. Capacity: in each row, of the tokens routed to expert e only the C
    best-scored (ties: earlier token first) keep it."""
    E, k = cfg.num_experts, cfg.moe_top_k
    b, s, _ = x.shape
    z = x @ p["router"]
    scores = jax.nn.softmax(z, -1) if cfg.moe_score == "softmax" else jax.nn.sigmoid(z)
    choose = jax.lax.stop_gradient(scores + p["bias"][None, None, :] if "bias" in p else scores)   # aux-loss-free bias
    chosen = jnp.argsort(-choose, axis=-1, stable=True)[..., :k]               # [b, s, k] best first
    gates = jnp.take_along_axis(scores, chosen, -1)
    if cfg.moe_renormalize:
        gates = gates / gates.sum(-1, keepdims=True)
    routed = jnp.zeros((b, s, E), bool)
    weight = jnp.zeros((b, s, E))
    for j in range(k):
        hot = chosen[..., j:j + 1] == jnp.arange(E)[None, None, :]
        routed, weight = routed | hot, weight + hot * gates[..., j:j + 1]
    kept = kept_routes(choose, routed, cfg)
    weight = jnp.where(kept, weight, 0.0)
    y = sum(weight[..., i:i + 1] * expert_ffn(x, p["experts"], i, cfg) for i in range(E))
    if cfg.moe_shared_expert_size:
        shared = mlp(x, p["shared"], cfg)
        if cfg.moe_shared_expert_gate:
            shared = shared * jax.nn.sigmoid(x @ p["shared_gate"])
        y = y + shared
    probs = scores if cfg.moe_score == "softmax" else scores / scores.sum(-1, keepdims=True)
    balance = jnp.sum(routed.sum(1) * probs.sum(1), -1) * E / (k * s * s)      # [b]
    return y, balance, jax.nn.logsumexp(z, -1) ** 2, (routed.sum((0, 1)), kept.sum())


def is_moe_layer(i, cfg):
    """Layer i holds experts: past the first moe_first_dense layers, every moe_layer_freq-th."""
    k, f = cfg.moe_first_dense, cfg.moe_layer_freq
    return cfg.num_experts > 0 and i >= k and (i - k) % f == 0


def layer_params(params, i, cfg):
    """Layer i's parameters in mtjax's tree: all l stacked under `layers`, or (dense layers among
    MoE layers, f = moe_layer_freq > 1 or a first dense layer) the first P = k - k mod f layers
    under `dense_layers`, then units of f layers under `layers`, the unit's MoE layer at its top
    and its dense layer j under `dense_{j}`."""
    k, f = cfg.moe_first_dense, cfg.moe_layer_freq
    prefix = k - k % f
    if i < prefix:
        return jax.tree.map(lambda w: w[i], params["dense_layers"])
    unit, j = divmod(i - prefix, f)
    if f > 1 and j != k % f:
        tree = params["layers"][f"dense_{j}"]
    else:
        tree = {name: sub for name, sub in params["layers"].items() if not name.startswith("dense_")}
    return jax.tree.map(lambda w: w[unit], tree)


def logits(params, tokens, cfg, vocab):
    """tokens [b, s] -> logits [b, s, vocab] (padding columns dropped)."""
    return forward(params, tokens, cfg, vocab)[0]


def routing(params, tokens, cfg, vocab):
    """tokens [b, s] -> each MoE layer's (routes per expert [E], routes kept), in layer order."""
    return forward(params, tokens, cfg, vocab)[2]


def forward(params, tokens, cfg, vocab):
    """tokens [b, s] -> (logits [b, s, vocab], the MoE layers' auxiliary loss: 0 without experts,
    each MoE layer's (routes per expert [E], routes kept) in layer order)."""
    norm = rms_norm if cfg.arch == "llama" else layer_norm
    aux, routing = 0.0, []
    table = params["embed"]["embedding"]
    x = table[tokens]
    if cfg.arch == "gpt":
        x = x + params["pos_embedding"][None, : tokens.shape[1]]
    for i in range(cfg.num_layers):
        p = layer_params(params, i, cfg)
        assert ("moe" in p) == is_moe_layer(i, cfg), i
        x = x + attention(norm(x, p["ln_attn"], cfg.norm_eps), p["attn"], cfg)
        if "moe" in p:
            y, balance, z, counts = moe(norm(x, p["ln_mlp"], cfg.norm_eps), p["moe"], cfg)
            x, routing = x + y, routing + [counts]
            aux = aux + cfg.moe_aux_loss_coeff * balance.mean() + cfg.moe_z_loss_coeff * z.mean()
        else:
            x = x + mlp(norm(x, p["ln_mlp"], cfg.norm_eps), p["mlp"], cfg)
    x = norm(x, params["ln_final"], cfg.norm_eps)
    tied = cfg.arch == "gpt" if cfg.tie_embeddings is None else cfg.tie_embeddings
    assert ("lm_head" in params) != tied
    out = x @ table.T if tied else x @ params["lm_head"]["kernel"]
    return out[..., :vocab], aux, routing


def loss(params, batch, cfg, vocab):
    """Mean next-token cross-entropy over batch [B, s + 1]."""
    z = logits(params, batch[:, :-1], cfg, vocab)
    logp = jax.nn.log_softmax(z, -1)
    return -jnp.take_along_axis(logp, batch[:, 1:, None], -1).mean()


def objective(params, batch, cfg, vocab):
    """What training minimises: the loss plus the MoE layers' auxiliary losses -> (objective, loss)."""
    z, aux, _ = forward(params, batch[:, :-1], cfg, vocab)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(z, -1), batch[:, 1:, None], -1).mean()
    return ce + aux, ce


# Compiled once per (cfg, vocab, shapes). Run eagerly, the reference dispatched about 500
# single-operation compiles per equality test (17 of its 45 s on this suite's CPUs); jit
# changes no operation of the model, only how it is dispatched.
logits = jax.jit(logits, static_argnums=(2, 3))
routing = jax.jit(routing, static_argnums=(2, 3))
loss = jax.jit(loss, static_argnums=(2, 3))
objective = jax.jit(objective, static_argnums=(2, 3))

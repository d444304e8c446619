"""An independent, plain single-device GPT/Llama: the oracle every parallel layout is compared to.

Written for clarity, not speed: no Flax, no scan, no sharding, a Python loop
over layers, heads expanded with jnp.repeat for grouped-query attention, the
full vocabulary softmax. It reads the same parameter tree (global shapes,
layers stacked on axis 0) that mtjax initialises. Every model option is implemented here
again, from its definition (the config fields only, no mtjax model code); packed fine-tuning rows
too (`packed_rows`: documents, loss weights and padding read token by token).
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


def yarn_frequency(f, i, d, cfg):
    """YaRN (Peng et al. 2023, section 3.2 as transformers implements it) for pair i of d/2 with
    frequency f: over the original context L the pair turns L f / 2pi times; the pair index at which
    that count equals beta is d log_theta(L / (2 pi beta)) / 2. Pairs up to the (floored, >= 0) index
    of beta_fast keep f, those from the (ceiled, <= d - 1) index of beta_slow get f / factor, and the
    pairs between move linearly from one to the other."""
    context, theta = cfg.rope_original_positions, cfg.rope_theta

    def index_turning(beta):
        return d / 2 * math.log(context / (2 * math.pi * beta), theta)

    start = max(math.floor(index_turning(cfg.rope_beta_fast)), 0)
    end = min(math.ceil(index_turning(cfg.rope_beta_slow)), d - 1)
    width = (end - start) or 0.001
    weight = min(max((i - start) / width, 0.0), 1.0)        # 0: kept, 1: divided by the factor
    return (1 - weight) * f + weight * f / cfg.rope_scaling_factor


def rope_magnitude(cfg):
    """YaRN's multiplier of cos and sin: the given attention factor, else 1 + ln(factor) / 10
    (for a factor above 1); 1 for every other scaling."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor > 0:
        return cfg.rope_attention_factor
    return 1.0 + math.log(cfg.rope_scaling_factor) / 10 if cfg.rope_scaling_factor > 1 else 1.0


def rope_frequency(i, d, cfg):
    """Frequency i of d/2, in float64: theta^(-2i/d); llama3 rescales it by its wavelength band
    (Meta's Llama 3.1 `apply_scaling`), yarn by `yarn_frequency`. Linear scaling divides the
    positions instead (`rope`)."""
    f = cfg.rope_theta ** (-2.0 * i / d)
    if cfg.rope_scaling == "yarn":
        return yarn_frequency(f, i, d, cfg)
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


def rope(x, cfg, positions=None):
    """x [b, s, n, d]; rotate-half RoPE at positions 0 .. s-1, or at `positions` [b, s] (each
    token's in its packed document), divided by the factor for linear scaling; cos and sin times
    `rope_magnitude` (yarn)."""
    s, d = x.shape[1], x.shape[-1]
    scale = cfg.rope_scaling_factor if cfg.rope_scaling == "linear" else 1.0
    freqs = np.array([rope_frequency(i, d, cfg) for i in range(d // 2)])
    if positions is None:
        ang = jnp.asarray(np.arange(s, dtype=np.float64)[None, :, None] / scale * freqs, jnp.float32)   # [1, s, d/2]
    else:
        ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs / scale, jnp.float32)[None, None]
    mag = rope_magnitude(cfg)
    cos, sin = mag * jnp.cos(ang)[:, :, None, :], mag * jnp.sin(ang)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def linear(x, p, n_in=1):
    """x [..., in...] @ kernel [in..., out...] (+ bias)."""
    k = p["kernel"]
    y = jnp.tensordot(x, k, axes=n_in)
    return y + bcast(p["bias"], y.ndim) if "bias" in p else y


def attention(x, p, cfg, docs=None):
    """docs: packed rows' (segments, positions, real) [b, s], or None: one document a row."""
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
        positions = None if docs is None else docs[1]
        q, k = rope(q, cfg, positions), rope(k, cfg, positions)
    k = jnp.repeat(k, a // kvh, axis=2)
    v = jnp.repeat(v, a // kvh, axis=2)
    s = x.shape[1]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / jnp.sqrt(q.shape[-1] * 1.0)
    mask = jnp.arange(s)[None, :, None] >= jnp.arange(s)[None, None, :]                 # [1, s, s]
    if docs is not None:      # a query reads its own document only
        mask = mask & (docs[0][:, :, None] == docs[0][:, None, :])
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
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


def moe(x, p, cfg, real=None):
    """Mixture of experts on x [b, s, h] -> (y, per-row balance terms [b], per-row mean z [b],
    (routes per expert [E], routes kept)).

    Each token takes its k highest-scored experts (softmax or sigmoid of x W_r, fp32), weighted
    by their scores (divided by the k scores' sum if renormalising); a router bias shifts the
    choice, not the weights. Capacity: in each row, of the tokens routed to expert e only the C
    best-scored (ties: earlier token first) keep it. `real` [b, s] (packed rows; None: all):
    a token that is not real (padding) is routed nowhere and counts in no sum, and a row's
    length S is its real tokens."""
    E, k = cfg.num_experts, cfg.moe_top_k
    b, s, _ = x.shape
    real = jnp.ones((b, s), bool) if real is None else real
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
    routed = routed & real[..., None]
    kept = kept_routes(choose, routed, cfg)
    weight = jnp.where(kept, weight, 0.0)
    y = sum(weight[..., i:i + 1] * expert_ffn(x, p["experts"], i, cfg) for i in range(E))
    if cfg.moe_shared_expert_size:
        shared = mlp(x, p["shared"], cfg)
        if cfg.moe_shared_expert_gate:
            shared = shared * jax.nn.sigmoid(x @ p["shared_gate"])
        y = y + shared
    probs = scores if cfg.moe_score == "softmax" else scores / scores.sum(-1, keepdims=True)
    length = jnp.maximum(real.sum(1), 1)                                         # [b]
    balance = jnp.sum(routed.sum(1) * (probs * real[..., None]).sum(1), -1) * E / (k * length ** 2)   # [b]
    z_mean = jnp.where(real, jax.nn.logsumexp(z, -1) ** 2, 0.0).sum(1) / length     # [b]
    return y, balance, z_mean, (routed.sum((0, 1)), kept.sum())


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


def routing(params, tokens, cfg, vocab, docs=None):
    """tokens [b, s] -> each MoE layer's (routes per expert [E], routes kept), in layer order."""
    return forward(params, tokens, cfg, vocab, docs)[2]


def forward(params, tokens, cfg, vocab, docs=None):
    """tokens [b, s] -> (logits [b, s, vocab], the MoE layers' auxiliary loss: 0 without experts,
    each MoE layer's (routes per expert [E], routes kept) in layer order). `docs`: packed rows'
    (segments, positions, real) [b, s] (`packed_rows`), or None."""
    norm = rms_norm if cfg.arch == "llama" else layer_norm
    aux, routing = 0.0, []
    table = params["embed"]["embedding"]
    x = table[tokens]
    if cfg.arch == "gpt":
        x = x + (params["pos_embedding"][None, : tokens.shape[1]] if docs is None else params["pos_embedding"][docs[1]])
    for i in range(cfg.num_layers):
        p = layer_params(params, i, cfg)
        assert ("moe" in p) == is_moe_layer(i, cfg), i
        x = x + attention(norm(x, p["ln_attn"], cfg.norm_eps), p["attn"], cfg, docs)
        if "moe" in p:
            real = None if docs is None else docs[2]
            y, balance, z, counts = moe(norm(x, p["ln_mlp"], cfg.norm_eps), p["moe"], cfg, real)
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


NO_LOSS = 1 << 30     # a token's no-loss bit in a training row (the data's, mtjax/data/sft.py)


def packed_rows(batch, eod):
    """Rows [B, s + 1] of packed fine-tuning samples (numpy) -> (loss weights [B, s], docs), docs
    = (segments, positions, real) [B, s] of the inputs, read token by token: a document ends at
    (and includes) each EOD; a label carries loss unless it has NO_LOSS or its input is an EOD;
    real is False on padding only: the EODs marked NO_LOSS that end the row, each a document of its
    own (a prompt's tokens are real; so is the padding's first EOD after a cut sample: it ends it)."""
    batch = np.asarray(batch)
    ids, s = batch & (NO_LOSS - 1), batch.shape[1] - 1
    segments, positions, real = (np.zeros((len(batch), s), np.int32) for _ in range(3))
    for r, row in enumerate(batch):
        tail = len(row)                  # the row's last tokens row[tail:] are EOD | NO_LOSS
        while tail and row[tail - 1] == eod | NO_LOSS:
            tail -= 1
        doc = pos = 0
        for i in range(s):
            segments[r, i], positions[r, i], real[r, i] = doc, pos, i < tail or pos > 0
            doc, pos = (doc + 1, 0) if ids[r, i] == eod else (doc, pos + 1)
    weights = ((batch[:, 1:] & NO_LOSS) == 0) & (ids[:, :-1] != eod)
    return weights.astype(np.float32), (segments, positions, real.astype(bool))


def objective(params, batch, cfg, vocab, packed=None):
    """What training minimises: the loss plus the MoE layers' auxiliary losses -> (objective, loss).
    `packed`: packed rows' (loss weights, docs) (`packed_rows`); the loss is then the mean over the
    labels that carry it."""
    if packed is None:
        z, aux, _ = forward(params, batch[:, :-1], cfg, vocab)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(z, -1), batch[:, 1:, None], -1).mean()
        return ce + aux, ce
    weights, docs = packed
    ids = batch & (NO_LOSS - 1)
    z, aux, _ = forward(params, ids[:, :-1], cfg, vocab, docs)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(z, -1), ids[:, 1:, None], -1)[..., 0]
    ce = jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return ce + aux, ce


# Compiled once per (cfg, vocab, shapes). Run eagerly, the reference dispatched about 500
# single-operation compiles per equality test (17 of its 45 s on this suite's CPUs); jit
# changes no operation of the model, only how it is dispatched.
logits = jax.jit(logits, static_argnums=(2, 3))
routing = jax.jit(routing, static_argnums=(2, 3))
loss = jax.jit(loss, static_argnums=(2, 3))
objective = jax.jit(objective, static_argnums=(2, 3))

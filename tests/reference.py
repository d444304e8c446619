"""An independent, plain single-device GPT/Llama: the oracle every parallel layout is compared to.

Written for clarity, not speed: no Flax, no scan, no sharding, a Python loop
over layers, heads expanded with jnp.repeat for grouped-query attention, the
full vocabulary softmax. It reads the same parameter tree (global shapes,
layers stacked on axis 0) that mtjax initialises.
"""
import jax
import jax.numpy as jnp


def bcast(w, ndim):
    return w.reshape((1,) * (ndim - w.ndim) + w.shape)


def layer_norm(x, p, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * bcast(p["scale"], 3) + bcast(p["bias"], 3)


def rms_norm(x, p, eps):
    return x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * bcast(p["scale"], 3)


def rope(x, theta):
    """x [b, s, n, d]; rotate-half RoPE."""
    s, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, d, 2) / d)
    ang = jnp.arange(s)[:, None] * freqs[None, :]
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
    q, k, v = linear(x, p["q"]), linear(x, p["k"]), linear(x, p["v"])    # [b, s, n, d]
    if cfg.arch == "llama":
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
    k = jnp.repeat(k, a // kvh, axis=2)
    v = jnp.repeat(v, a // kvh, axis=2)
    s = x.shape[1]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / jnp.sqrt(q.shape[-1] * 1.0)
    mask = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    out = jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(scores, -1), v)
    return linear(out, p["o"], n_in=2)


def mlp(x, p, cfg):
    if cfg.arch == "llama":
        return linear(jax.nn.silu(linear(x, p["gate"])) * linear(x, p["up"]), p["fc2"])
    return linear(jax.nn.gelu(linear(x, p["fc1"]), approximate=False), p["fc2"])


def logits(params, tokens, cfg, vocab):
    """tokens [b, s] -> logits [b, s, vocab] (padding columns dropped)."""
    norm = rms_norm if cfg.arch == "llama" else layer_norm
    table = params["embed"]["embedding"]
    x = table[tokens]
    if cfg.arch == "gpt":
        x = x + params["pos_embedding"][None, : tokens.shape[1]]
    for i in range(cfg.num_layers):
        p = jax.tree.map(lambda w: w[i], params["layers"])
        x = x + attention(norm(x, p["ln_attn"], cfg.norm_eps), p["attn"], cfg)
        x = x + mlp(norm(x, p["ln_mlp"], cfg.norm_eps), p["mlp"], cfg)
    x = norm(x, params["ln_final"], cfg.norm_eps)
    out = x @ table.T if cfg.tie_embeddings else x @ params["lm_head"]["kernel"]
    return out[..., :vocab]


def loss(params, batch, cfg, vocab):
    """Mean next-token cross-entropy over batch [B, s + 1]."""
    z = logits(params, batch[:, :-1], cfg, vocab)
    logp = jax.nn.log_softmax(z, -1)
    return -jnp.take_along_axis(logp, batch[:, 1:, None], -1).mean()

"""One-device check of the context-parallel attention cores (GPU or CPU): the c ranks run as a vmap over a
named `context` axis; each core's output and gradients against one-device attention, its time, and (cuDNN)
how many fused-attention calls the compiled program makes. `python scripts/gpu_context_cores.py`."""
import time
import jax, jax.numpy as jnp, numpy as np
from mtjax.mesh import CONTEXT
from mtjax.model.context_attention import all_gather_attention, ring_attention
from mtjax.model.core_attention import einsum_attention
from mtjax.parallel.context_ops import chunk_positions

gpu = jax.devices()[0].platform == "gpu"
B, S, KV, G, D = (2, 512, 2, 2, 64) if gpu else (2, 16, 2, 2, 8)
DT = jnp.bfloat16 if gpu else jnp.float32
keys = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(keys[0], (B, S, KV, G, D))
k, v = (jax.random.normal(kk, (B, S, KV, D)) for kk in keys[1:3])
t = jax.random.normal(keys[3], q.shape)

def vjp_of(fn, dtype, c=None):
    def run(q, k, v, t):
        out, pull = jax.vjp(fn, *(x.astype(dtype) for x in (q, k, v)))
        return [x.astype(jnp.float32) for x in (out, *pull(t.astype(dtype)))]
    return jax.jit(run if c is None else jax.vmap(run, axis_name=CONTEXT))

with jax.default_matmul_precision("highest"):
    ref = vjp_of(einsum_attention, jnp.float32)(*(x.astype(DT).astype(jnp.float32) for x in (q, k, v)), t)
cores = {"ring": lambda c: lambda q, k, v: ring_attention(q, k, v, c),
         "gather_xla": lambda c: lambda q, k, v: all_gather_attention(q, k, v, c),
         "gather_dot": lambda c: lambda q, k, v: all_gather_attention(q, k, v, c, "dot_product")}
# (the cuDNN kernel under this vmap fails in jax's own batching of the cuDNN mask: checked below,
# unbatched, with the mask all_gather_attention builds for rank 0 of c = 2)
for c in (2, 4):
    order = np.concatenate([np.asarray(chunk_positions(S, c, r)) for r in range(c)])
    ranked = lambda x: jnp.moveaxis(x[:, order].reshape(x.shape[0], c, S // c, *x.shape[2:]), 1, 0)
    for name, core in cores.items():
        f = vjp_of(core(c), DT, c)
        args = [ranked(x) for x in (q, k, v, t)]
        got = f(*args)
        jax.block_until_ready(got)
        t0 = time.perf_counter(); jax.block_until_ready(f(*args)); ms = 1e3 * (time.perf_counter() - t0)
        errs = [float(jnp.max(jnp.abs(g - ranked(w))) / jnp.max(jnp.abs(w))) for g, w in zip(got, ref)]
        hlo = ""
        print(f"c={c} {name:13s} rel max err out/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs),
              f"{ms:.1f} ms", "cudnn fmha calls:" if hlo else "", hlo.count("__cudnn$fmha") if hlo else "", flush=True)

if gpu:   # the all_gather core's cuDNN call: a dense causal mask over true positions, GQA, bf16
    c, r = 2, 0
    qpos = chunk_positions(S, c, r)
    mask = jnp.arange(S)[None, :] <= qpos[:, None]                           # [s_l, s]
    args = (q[:, qpos].reshape(B, S // c, KV * G, D).astype(DT), k.astype(DT), v.astype(DT))
    outs = {}
    for impl in ("cudnn", "xla"):
        f = jax.jit(jax.value_and_grad(lambda q, k, v, impl=impl: jnp.sum(jax.nn.dot_product_attention(
            q, k, v, mask=mask[None, None], implementation=impl).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
        outs[impl] = jax.block_until_ready(f(*args))
        hlo = f.lower(*args).compile().as_text()
        print(impl, "fused-attention custom calls:", hlo.count("__cudnn$fmha"), flush=True)
    (lc, gc), (lx, gx) = outs["cudnn"], outs["xla"]
    print("cudnn vs xla with the mask: loss rel", abs(float(lc) - float(lx)) / abs(float(lx)),
          "grads rel max", [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                                  jnp.max(jnp.abs(b.astype(jnp.float32)))) for a, b in zip(gc, gx)])

"""The all_gather core's block route (`model/gathered_attention.py`) on one GPU, rank by rank: each
context rank's output and its share of dQ, dK, dV against one-device attention (fp32 reference on
the same bf16 inputs), cuDNN blocks and einsum blocks; the cuDNN calls the compiled program makes;
and the core's time at a longer row against the dense-mask call it replaced.
`python scripts/gpu_gathered_blocks.py` (on a CPU it runs the einsum blocks only, small)."""
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.model import gathered_attention as ga
from mtjax.model.attention_blocks import cudnn_blocks
from mtjax.model.core_attention import einsum_attention
from mtjax.parallel.context_ops import chunk_positions

gpu = jax.devices()[0].platform == "gpu"
fa = cudnn_blocks()
print("jax", jax.__version__, jax.devices()[0].device_kind, "| cuDNN block calls:", fa is not None, flush=True)
if os.environ.get("OUT") and fa is not None:
    shutil.copy(fa.__file__, os.environ["OUT"])          # this jax's cuDNN attention, to read
KERNELS = ("cudnn", "xla") if gpu and fa is not None else ("xla",)
DT = jnp.bfloat16 if gpu else jnp.float32


def data(b, s, kv, g, d):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, kv, g, d)).astype(DT)
    k, v = (jax.random.normal(x, (b, s, kv, d)).astype(DT) for x in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape).astype(DT)


def vjp_of(fn):
    def run(q, k, v, t):
        out, pull = jax.vjp(fn, q, k, v)
        return [x.astype(jnp.float32) for x in (out, *pull(t))]
    return jax.jit(run)


def rank_core(c, r, kernel):
    ga.context_rank = lambda _c, r=r: r                  # rank r's program, without a mesh:
    ga.gather_from_context_region = lambda x, _c: x      # K, V come in gathered (rank-major)
    return vjp_of(lambda q, k, v: ga.gathered_attention(q, k, v, c, kernel))


def check(shape=(2, 1024, 2, 4, 64) if gpu else (2, 32, 2, 2, 8)):
    q, k, v, t = data(*shape)
    with jax.default_matmul_precision("highest"):
        ref = vjp_of(einsum_attention)(*(x.astype(jnp.float32) for x in (q, k, v, t)))
    rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))  # noqa: E731
    s = shape[1]
    for c in (2, 4):
        order = np.concatenate([np.asarray(chunk_positions(s, c, r)) for r in range(c)])
        for kernel in KERNELS:
            errs, dk, dv, calls = [], 0, 0, None
            for r in range(c):
                rows = np.asarray(chunk_positions(s, c, r))
                f = rank_core(c, r, kernel)
                args = (q[:, rows], k[:, order], v[:, order], t[:, rows])
                out, dq, dk_r, dv_r = f(*args)
                errs.append((rel(out, ref[0][:, rows]), rel(dq, ref[1][:, rows])))
                dk, dv = dk + dk_r, dv + dv_r
                if calls is None:
                    hlo = f.lower(*args).compile().as_text()
                    calls = sorted(set(x.split('"')[0] for x in hlo.split('custom_call_target="')[1:]))
            worst = np.max(np.array(errs), axis=0)
            print(f"c={c} {kernel:5s} rel max err out {worst[0]:.1e} dq {worst[1]:.1e} "
                  f"dk {rel(dk, ref[2][:, order]):.1e} dv {rel(dv, ref[3][:, order]):.1e} | custom calls {calls}",
                  flush=True)


def timing(b=1, s=16384, kv=8, g=4, d=64, c=8, r=0, reps=5):
    """Rank r's core, forward and backward: the blocks against the dense-mask cuDNN call."""
    q, k, v, t = data(b, s, kv, g, d)
    rows = np.asarray(chunk_positions(s, c, r))
    order = np.concatenate([np.asarray(chunk_positions(s, c, j)) for j in range(c)])
    mask = jnp.asarray(order)[None, :] <= jnp.asarray(rows)[:, None]

    def dense(q, k, v):
        n = q.shape[2] * q.shape[3]
        o = jax.nn.dot_product_attention(q.reshape(*q.shape[:2], n, d), k, v, mask=mask[None, None],
                                         implementation="cudnn")
        return o.reshape(q.shape)
    args = (q[:, rows], k[:, order], v[:, order], t[:, rows])
    for name, f in (("blocks", rank_core(c, r, "cudnn")), ("dense mask", vjp_of(dense))):
        jax.block_until_ready(f(*args))
        start = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(f(*args))
        print(f"s {s} c {c} rank {r} {name:10s} fwd+bwd {1e3 * (time.perf_counter() - start) / reps:.2f} ms",
              flush=True)


for step in (check, timing) if "cudnn" in KERNELS else (check,):
    try:
        step()
    except Exception as e:                                  # report and go on to the next check
        print(step.__name__, "failed:", type(e).__name__, str(e)[:2000], flush=True)

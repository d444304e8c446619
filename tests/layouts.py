"""Shared builders for the layout tests: a tiny config, a mesh, a Trainer, a batch."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtjax.config import load_config
from mtjax.mesh import make_mesh
from mtjax.training.trainer import Trainer

VOCAB = 301          # not a multiple of any tensor size
SEQ = 16
BATCH = 8


def tiny_config(arch="gpt", tensor=1, pipe=1, data=1, sp=False, micro_batch=None, extra=()):
    """The tiny model's config; micro_batch None: 2, or with a train.micro_batches=m override the
    b = BATCH/(m data) it makes (validation refuses a micro_batch that m would ignore)."""
    m = next((int(e.split("=")[1]) for e in extra if e.startswith("train.micro_batches=")), 0)
    if micro_batch is None:
        micro_batch = BATCH // (m * data) if m else 2
    overrides = [
        f"model.arch={arch}", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=8",
        f"model.num_kv_heads={2 if arch == 'llama' else 0}", f"model.seq_len={SEQ}",
        f"model.tie_embeddings={'true' if arch == 'gpt' else 'false'}",
        f"parallel.data={data}", f"parallel.pipe={pipe}", f"parallel.tensor={tensor}",
        f"parallel.sequence_parallel={'true' if sp else 'false'}",
        f"train.global_batch={BATCH}", f"train.micro_batch={micro_batch}",
        "optim.warmup_steps=0", "optim.lr=0.001", "optim.min_lr=0.0001", "train.steps=10",
        *extra]
    return load_config(None, overrides)


def build(cfg, data, pipe, tensor, context=1, eod=None) -> Trainer:
    mesh = make_mesh(data, pipe, tensor, jax.devices()[: data * pipe * context * tensor], context=context)
    return Trainer(cfg, mesh, VOCAB, eod=eod)


def random_batch(seed=0, batch=BATCH):
    return jnp.asarray(np.random.RandomState(seed).randint(0, VOCAB, (batch, SEQ + 1)), jnp.int32)


# GPT's key projection bias adds q . b_k to every score of a query row, which softmax
# ignores: its true gradient is exactly zero and both sides hold only rounding noise
# (which Adam then normalises). It is checked to be negligible, not compared. (Llama's, with
# model.qkv_bias, is rotated with the key, so it differs between positions and is compared.)
ZERO_GRADIENT = "['layers']['attn']['k']['bias']"


def tree_norm(tree) -> float:
    """In numpy (float64): no per-leaf-shape XLA compile."""
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))


def relative(a, b) -> float:
    """||a - b|| / ||b|| in numpy (float64): eager jnp would compile a program per op and shape."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def skipped(key: str, skip) -> bool:
    """key is one of `skip`, or the same leaf in another stack or unit layer: a skip path under
    `layers` also names it under `dense_layers` and in a unit's `dense_{j}` (`model/layer_pattern.py`)."""
    return any(key == s or key.endswith(s.removeprefix("['layers']")) for s in skip)


def leaf_errors(actual, expected, skip=()):
    """{path: ||a - e|| / ||e||} for every leaf but `skip` (`skipped`); ||e|| is floored at 1e-7 x
    the norm of the whole tree. In numpy (float64), for the same reason as `tree_norm`."""
    floor = 1e-7 * tree_norm(expected)
    errs = {}
    flat_e = dict(jax.tree_util.tree_leaves_with_path(expected))
    for path, a in jax.tree_util.tree_leaves_with_path(actual):
        if skipped(jax.tree_util.keystr(path), skip):
            continue
        a, e = np.asarray(a, np.float64), np.asarray(flat_e[path], np.float64)
        assert a.shape == e.shape, (path, a.shape, e.shape)
        errs[jax.tree_util.keystr(path)] = float(np.linalg.norm(a - e) / max(float(np.linalg.norm(e)), floor))
    assert all(k in errs or skipped(k, skip) for k in map(jax.tree_util.keystr, flat_e))
    return errs


def unpad(params):
    """Drop the padded vocabulary rows (their number depends on t)."""
    return {**params, "embed": {"embedding": params["embed"]["embedding"][:VOCAB]}}


def step_report(trainer) -> dict:
    """The `collectives` and `memory` sections of `mtjax.inspect.report(trainer)`, alone: the rest
    of the report (fusions, copies, executed FLOPs per pipe rank) parses the program again each."""
    from mtjax.hlo_report import collective_report, memory_report
    from mtjax.inspect import compile_train_step, without_no_ops
    compiled = compile_train_step(trainer)
    return {"collectives": without_no_ops(collective_report(compiled.as_text(), trainer.mesh)),
            "memory": memory_report(compiled)}


def applied_gradients(trainer, opt_state):
    """The clipped gradients a first step applied, in canonical layer order, read back from AdamW's
    first moment: from zero moments mu_1 = (1 - beta1) clip(g), so clip(g) = mu_1 / (1 - beta1)
    (fp32: a rounding of about 1e-7 relative). The train step's own gradients, without compiling
    `trainer.grad_fn` (the same shard_map again: about a fifth of an equality test's compile)."""
    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)    # noqa: E731
    (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
    assert int(adam.count) == 1, "read after the first step only"
    mu = jax.device_get(trainer.canonical(adam.mu))
    return jax.tree.map(lambda m: np.asarray(m, np.float64) / (1 - trainer.cfg.optim.beta1), mu)


def clipped(cfg, grads):
    """`grads` through the step's global-norm clip (optim.clip_grad; 0 leaves them as they are)."""
    c = cfg.optim.clip_grad
    if c <= 0:
        return grads
    scale = min(1.0, c / tree_norm(grads))
    return jax.tree.map(lambda g: np.asarray(g, np.float64) * scale, grads)

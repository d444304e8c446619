"""Any layout: reading a stored TrainState onto the shardings of another layout.

Arrays are stored in their global shapes with the layers in canonical order, and the
distributed optimizer changes only where the shards live, so orbax restores onto the new
shardings directly. The one shape that depends on the layout is the padded vocabulary (a
multiple of vocab_multiple * t): those leaves are read at their stored size and cut or
zero-padded to the new one (`fit`). Rows beyond the true vocabulary never carry probability
(their logits are masked), so they do not change the loss.

The training modules this needs (the state's structure, the loss scaler) are imported when a
state is restored, not with the package: opening and checking a checkpoint needs none of them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from mtjax.checkpoint.errors import CheckpointError


def restore_target(trainer, padded_vocab: int):
    """(what to read, what the new layout wants). Leaves are read onto the new layout's
    shardings, except those whose stored shape differs (the vocabulary axis, when the saved
    run padded V differently), which are read whole (replicated) and then fitted by `fit`."""
    from mtjax.training import state as state_lib
    from mtjax.training.loss_scale import init_loss_scale
    from mtjax.training.plan import global_model
    cfg = trainer.cfg
    stored = state_lib.abstract_state(global_model(cfg, padded_vocab), trainer.tx, cfg.model.seq_len,
                                      init_loss_scale(cfg))
    want = jax.eval_shape(trainer.init_state)
    whole = NamedSharding(trainer.mesh, P())

    def one(s, w, sharding):
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding if s.shape == w.shape else whole)
    return jax.tree.map(one, stored, want, trainer.state_shardings), want


def resize_vocab(x, w, vocab: int):
    """Leaf `x` as the wanted shape `w`: unchanged when the shapes agree; else its one differing
    axis (the padded vocabulary) cut to V and zero-padded to the wanted size."""
    if x.shape == w.shape:
        return x
    axes = [a for a, (m, n) in enumerate(zip(x.shape, w.shape)) if m != n]
    if len(x.shape) != len(w.shape) or len(axes) != 1 or min(x.shape[axes[0]], w.shape[axes[0]]) < vocab:
        raise CheckpointError(f"checkpoint leaf of shape {x.shape} does not fit {w.shape}")
    a = axes[0]
    pad = [(0, 0)] * x.ndim
    pad[a] = (0, w.shape[a] - vocab)
    return jnp.pad(jax.lax.slice_in_dim(x, 0, vocab, axis=a), pad)


def fit(tree, want, vocab: int, shardings):
    """Cut or zero-pad each vocabulary axis to the wanted padded size; every other leaf as is."""
    return jax.jit(lambda t: jax.tree.map(lambda x, w: resize_vocab(x, w, vocab), t, want),
                   out_shardings=shardings)(tree)


def fresh_loss_scale(state, trainer):
    """A run that changes precision starts the loss scaler afresh (S = 1 outside fp16, the
    initial scale in fp16); the count of skipped steps carries on."""
    from mtjax.training.loss_scale import init_loss_scale
    fresh = init_loss_scale(trainer.cfg).replace(skipped=state.loss_scale.skipped)
    sharding = trainer.state_shardings.loss_scale
    return state.replace(loss_scale=jax.tree.map(jax.device_put, fresh, sharding))


def fitted(state, want, vocab: int, precision: str, trainer):
    """The restored `state` made this run's: a fresh loss scaler when the precision changed,
    the vocabulary axes fitted when the padding changed, and the layers in run order."""
    if precision != trainer.plan.precision:
        state = fresh_loss_scale(state, trainer)
    if any(a.shape != b.shape for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want))):
        state = fit(state, want, vocab, trainer.state_shardings)
    return trainer.run_order(state)

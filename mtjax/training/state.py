"""The train state pytree and its sharded initialisation.

Everything a resume needs lives here: parameters, optimizer state, step,
the data position (samples consumed) and the base RNG key. Nothing else
persists between steps: the compute-dtype weights are cast (and gathered)
inside each step, and the gradients live only within it.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mtjax.parallel.reductions import ParamBox
from mtjax.partitioning import shardings
from mtjax.training.loss_scale import LossScale, all_finite


@flax.struct.dataclass
class TrainState:
    params: Any                # fp32 master weights (split over the replicas with the distributed optimizer)
    opt_state: Any
    step: jax.Array            # int32 scalar: optimizer steps taken
    data_position: jax.Array   # int32 scalar: samples consumed (the next batch starts here), modulo 2^32
                               # (it wraps past 2^31; a checkpoint's meta holds the exact count)
    rng: jax.Array             # uint32 [2]: base key; step keys are fold_in(rng, step)
    loss_scale: Any            # LossScale: fp16 dynamic loss scaling (S = 1 otherwise)


def state_specs(tx, master_specs, param_shapes):
    """Mesh PartitionSpecs for every leaf of the TrainState, given the master weights' specs.

    Optimizer moments follow their master weights; scalars (step counts) are replicated.
    """
    opt_shapes = jax.eval_shape(tx.init, param_shapes)
    opt_specs = _opt_specs(opt_shapes, param_shapes, master_specs)
    scaler = LossScale(scale=P(), good_steps=P(), hysteresis=P(), skipped=P())
    return TrainState(params=master_specs, opt_state=opt_specs, step=P(), data_position=P(), rng=P(),
                      loss_scale=scaler)


def _opt_specs(opt_shapes, params, pspecs):
    """Moments (subtrees shaped like params) take the param specs; everything else is replicated."""
    ptree = jax.tree.structure(params)

    def visit(node):
        if jax.tree.structure(node) == ptree:
            return pspecs
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*(visit(x) for x in node))
        if isinstance(node, (tuple, list)):
            return type(node)(visit(x) for x in node)
        if isinstance(node, dict):
            return {k: visit(v) for k, v in node.items()}
        return jax.tree.map(lambda _: P(), node)
    return visit(opt_shapes)


def new_state(model, tx, seq_len: int, loss_scale: LossScale, key, padded_vocab: int | None = None) -> TrainState:
    """A fresh TrainState: parameters drawn with global shapes from `key` (`draw_params`), step 0."""
    init_key, _ = jax.random.split(key)
    return start_state(draw_params(model, seq_len, init_key, padded_vocab), tx, loss_scale, key)


def draw_params(model, seq_len: int, key, padded_vocab: int | None = None):
    """The parameters of `model` drawn from `key`, unboxed.

    Every parameter with a `vocab` axis is drawn at the model's own V_d rows (a size no layout
    changes: `vocab.drawn_vocab_size`) and padded with zero rows up to `padded_vocab` (V_d
    rounded up for this layout's t), so one seed gives the same model on every layout: the
    random draw of an [h, V] kernel depends on its whole shape. The padded rows stay zero: no
    token looks them up and the loss masks their logits, so their gradient is zero.
    """
    boxed = model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]
    if padded_vocab is not None:
        boxed = jax.tree.map(lambda b: _pad_vocab(b, padded_vocab), boxed, is_leaf=lambda x: isinstance(x, ParamBox))
    return nn.unbox(boxed)


def _pad_vocab(box, padded_vocab: int):
    if "vocab" not in box.names:
        return box
    axis = box.names.index("vocab")
    pad = [(0, 0)] * box.value.ndim
    pad[axis] = (0, padded_vocab - box.value.shape[axis])
    return box.replace_boxed(jnp.pad(box.value, pad))


def start_state(params, tx, loss_scale: LossScale, key) -> TrainState:
    """Step 0 from `params`: fresh optimizer state, data position 0, and the run's RNG key drawn
    from `key` as `new_state` draws it (so a run started from given weights has the dropout
    masks of a run that drew them)."""
    _, run_key = jax.random.split(key)
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.int32(0),
                      data_position=jnp.int32(0), rng=jax.random.key_data(run_key), loss_scale=loss_scale)


def abstract_state(model, tx, seq_len: int, loss_scale: LossScale, padded_vocab: int | None = None) -> TrainState:
    """ShapeDtypeStructs of `new_state` (global shapes, nothing allocated)."""
    return jax.eval_shape(lambda key: new_state(model, tx, seq_len, loss_scale, key, padded_vocab), jax.random.key(0))


def state_initializer(model, tx, mesh, seq_len: int, specs, loss_scale: LossScale,
                      padded_vocab: int | None = None):
    """key -> the initial TrainState, created directly in its sharded layout: one jitted program
    for every seed (a trainer keeps it, so a second `init_state` compiles nothing).

    Parameters are drawn with global shapes from one key, the vocabulary's at a size no layout
    changes (`draw_params`), so every mesh layout starts from the same model.
    """
    return jax.jit(lambda key: new_state(model, tx, seq_len, loss_scale, key, padded_vocab),
                   out_shardings=shardings(mesh, specs))


def state_is_finite(state) -> bool:
    """True when every leaf of the parameters and optimizer state is finite. One
    jitted program: with several processes, eager per-leaf reductions could be matched out of
    order across processes and hang."""
    return bool(jax.device_get(_finite((state.params, state.opt_state))))


_finite = jax.jit(all_finite)   # integer leaves (step counts) are finite by definition

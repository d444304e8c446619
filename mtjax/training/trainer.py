"""Everything built once per run from (config, mesh, vocabulary): models, optimizer, jitted steps.

`train_step(state, batch) -> (state, metrics)` is jitted once, with explicit
input/output shardings and the state donated.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from mtjax.config.schema import Config
from mtjax.model.transformer import Transformer
from mtjax.parallel.reductions import tensor_reductions
from mtjax.parallel.vocab import padded_vocab_size
from mtjax.partitioning import rules_for, shardings
from mtjax.pipeline.layer_order import canonical_order, layer_order, permute_layers
from mtjax.pipeline.schedules import make_schedule
from mtjax.training import state as state_lib
from mtjax.training.optimizer import learning_rate, make_optimizer
from mtjax.training.loss_scale import all_finite, init_loss_scale, update_loss_scale
from mtjax.training.zero import state_split
from mtjax.training.step import (DTYPES, batch_sharding, local_model, main_grad_specs, make_grad_fn, make_logits_fn,
                                 make_loss_fn, step_layout)


@dataclass
class Trainer:
    cfg: Config
    mesh: object
    vocab: int                       # unpadded V (the tokenizer's)

    @cached_property
    def layout(self):
        return step_layout(self.cfg, self.mesh, self.vocab)

    @cached_property
    def padded_vocab(self) -> int:
        return padded_vocab_size(self.vocab, self.cfg.model.vocab_multiple, self.layout.tensor)

    @cached_property
    def global_model(self) -> Transformer:
        """Global shapes (t = 1): used to initialise and to declare the shardings."""
        return Transformer(self.cfg.model, self.padded_vocab)

    @cached_property
    def tx(self) -> optax.GradientTransformation:
        return make_optimizer(self.cfg)

    @cached_property
    def _rules(self) -> dict:
        return rules_for(self.cfg.model.kv_heads, self.layout.tensor)

    @cached_property
    def _declared(self):
        """The abstract parameters as declared: boxes with logical axes and `sequence_parallel`."""
        return state_lib.abstract_params(self.global_model, self.cfg.model.seq_len)

    @cached_property
    def _params(self):
        return state_lib.param_specs(self._declared, self._rules)

    @cached_property
    def tensor_reductions(self):
        """True where a gradient is a partial sum over `tensor` that the step all-reduces
        (`parallel/reductions.py`)."""
        return tensor_reductions(self._declared, self._rules, self.layout.tensor,
                                 self.cfg.parallel.sequence_parallel)

    @cached_property
    def param_specs(self):
        """Where the parameters live while the step computes with them."""
        return self._params[0]

    @cached_property
    def _master(self):
        """The optimizer state's layout (`zero.StateSplit`): the parameter layout split further
        over `pipe` for the pipe-replicated leaves, over `data` with the distributed optimizer."""
        return state_split(self.param_specs, self._params[1], self.mesh, self.cfg.parallel.distributed_optimizer)

    @property
    def megatron_layout(self) -> bool:
        """Megatron's persistent compute-dtype weights and main_grad buffer live in the state."""
        return self.cfg.train.state_layout == "megatron"

    @property
    def _keeps_model_params(self) -> bool:
        """A separate compute copy exists unless the master weights already are it (fp32, no ZeRO)."""
        return self.cfg.train.precision != "fp32" or self.cfg.parallel.distributed_optimizer

    @cached_property
    def _buffer_specs(self):
        if not self.megatron_layout:
            return None
        model = self.param_specs if self._keeps_model_params else None
        return state_lib.StepBuffers(model_params=model, main_grad=main_grad_specs(self._master.local_specs))

    @cached_property
    def specs(self) -> state_lib.TrainState:
        """PartitionSpecs of the whole TrainState (master weights, moments, counters, buffers)."""
        return state_lib.state_specs(self.tx, self._master.specs, self._params[1], self._buffer_specs)

    @cached_property
    def state_shardings(self):
        return shardings(self.mesh, self.specs)

    @cached_property
    def saved_shardings(self):
        """Shardings of what a checkpoint holds: the state without its (derived) buffers."""
        return self.state_shardings.replace(buffers=None)

    def init_state(self, seed: int | None = None) -> state_lib.TrainState:
        seed = self.cfg.train.seed if seed is None else seed
        state = state_lib.init_state(self.global_model, self.tx, self.mesh, seed, self.cfg.model.seq_len,
                                     self.specs.replace(buffers=None), init_loss_scale(self.cfg))
        return self.with_buffers(self.run_order(state))   # drawn in canonical order, stored in run order

    @cached_property
    def _layer_rows(self):
        """(run order, canonical order) row permutations of the `layers` axis, or None when the
        two orders are the same (no interleaving); see `pipeline/layer_order.py`."""
        v = self.cfg.parallel.virtual_stages
        if self.layout.pipe == 1 or v == 1:
            return None
        args = (self.cfg.model.num_layers, self.layout.pipe, v)
        return layer_order(*args), canonical_order(*args)

    def run_order(self, tree):
        """A state (without buffers), parameter or gradient tree from canonical layer order into
        the order this layout stores and runs the layers in (states keep their shardings)."""
        return self._permute(tree, 0)

    def canonical(self, tree):
        """The inverse of `run_order`: what checkpoints, the reference and users see."""
        return self._permute(tree, 1)

    def _permute(self, tree, which: int):
        if self._layer_rows is None:
            return tree
        rows = self._layer_rows[which]
        if isinstance(tree, state_lib.TrainState):
            return jax.jit(lambda t: permute_layers(t, rows), out_shardings=self.saved_shardings)(tree)
        return permute_layers(tree, rows)

    def with_buffers(self, state: state_lib.TrainState) -> state_lib.TrainState:
        """`state` (without buffers, as initialised or restored) completed for this layout: under
        the megatron layout, the compute copy of its master weights and a zeroed main_grad."""
        if not self.megatron_layout:
            return state
        return self._attach_buffers(state)

    @cached_property
    def _attach_buffers(self):
        d = self.layout.data

        def attach(state):
            model = self._model_copy(state.params)
            zeros = jax.tree.map(lambda a: jnp.zeros((d, *a.shape), jnp.float32), self._params[1])
            return state.replace(buffers=state_lib.StepBuffers(model_params=model, main_grad=zeros))
        return jax.jit(attach, out_shardings=self.state_shardings, donate_argnums=0)

    def grad_fn(self, params, batch, rng_data, scale=1.0):
        """(grads, loss): reduced gradients of the mean loss (times `scale`), for tests and tools."""
        return self.scaled_grad_fn(params, batch, rng_data, jnp.float32(scale))[:2]

    @cached_property
    def scaled_grad_fn(self):
        """(params, batch, rng_data, loss scale) -> (scale x grads, loss): the step's gradients."""
        cfg, layout = self.cfg, self.layout
        deterministic = cfg.model.dropout == 0 and cfg.model.attention_dropout == 0
        model = local_model(cfg, layout, self.padded_vocab, deterministic, stage=True)
        return make_grad_fn(model, self.mesh, self.param_specs, layout, self.tensor_reductions, self.schedule,
                            model.dtype,
                            self._master, keep_local=self.megatron_layout)

    @cached_property
    def schedule(self):
        """The training schedule's table (None without pipelining)."""
        layout = self.layout
        if layout.pipe == 1:
            return None
        return make_schedule(self.cfg.parallel.schedule, layout.pipe, layout.micro_batches,
                             self.cfg.parallel.virtual_stages)

    @cached_property
    def loss_fn(self):
        """(params, batch [B, s+1]) -> mean loss; pipelined through the stages when pipe > 1."""
        model = local_model(self.cfg, self.layout, self.padded_vocab, deterministic=True, stage=True)
        return make_loss_fn(model, self.mesh, self.param_specs, self.layout, self.schedule)

    @cached_property
    def logits_fn(self):
        """jit (params, tokens [B, s]) -> logits [B, s, V], the unpadded vocabulary."""
        model = local_model(self.cfg, self.layout, self.padded_vocab, deterministic=True, stage=True)
        return jax.jit(make_logits_fn(model, self.mesh, self.param_specs, self.layout, self.schedule))

    def compute_params(self, master):
        """The parameters the step computes with: the master weights cast to the compute dtype
        and gathered where the optimizer state is split (over `data` with the distributed
        optimizer, over `pipe` for the pipe-replicated leaves; `zero.py`). Every layout and state
        layout computes with the same rounded weights, norm scales and biases included, as
        Megatron's 16-bit model does; under fp32 without the distributed optimizer they are the
        master (its pipe-split leaves are gathered in fp32 where they enter the step's shard_map).

        Cast first, then laid out as the step computes, so the all-gather moves 16-bit values.
        The cast is pinned to the master's layout: left free, sharding propagation gives it the
        gathered layout and the partitioner gathers the fp32 weights before casting them."""
        if not self._keeps_model_params:
            return master
        dtype = DTYPES[self.cfg.train.precision]
        cast = jax.tree.map(lambda w: w.astype(dtype), master)
        cast = jax.lax.with_sharding_constraint(cast, self.saved_shardings.params)
        return jax.lax.with_sharding_constraint(cast, shardings(self.mesh, self.param_specs))

    def _model_copy(self, master):
        """The megatron layout's `model_params`: None where the master weights are the compute ones."""
        return self.compute_params(master) if self._keeps_model_params else None

    def _step_params(self, state):
        """The weights this step computes with: the persistent compute copy when the state keeps one."""
        if state.buffers is not None and state.buffers.model_params is not None:
            return state.buffers.model_params
        return self.compute_params(state.params)

    def _new_buffers(self, params, local_grads=None):
        """The megatron layout's buffers after the update: the new weights cast and (with the
        distributed optimizer) all-gathered over `data`, as Megatron does at the end of a step."""
        if not self.megatron_layout:
            return None
        model = self._model_copy(params)
        return state_lib.StepBuffers(model_params=model, main_grad=local_grads)

    def _train_step(self, state, batch):
        rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step))
        fp16 = self.cfg.train.precision == "fp16"
        scale = state.loss_scale.scale
        grads, loss, *local = self.scaled_grad_fn(self._step_params(state), batch, rng, scale)
        if fp16:
            grads = jax.tree.map(lambda g: g / scale, grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A step whose loss, gradients or updated weights and moments are not finite changes
        # nothing but the counters, so non-finite weights never exist (fp16 overflows are the
        # scaler's business; the rest is reported as `nonfinite`, and the loop stops or goes on
        # per train.on_nonfinite).
        finite_grads, finite_loss = all_finite(grads), jnp.isfinite(loss)
        ok = finite_grads & finite_loss & all_finite((params, opt_state))
        params = jax.tree.map(lambda new, old: jnp.where(ok, new, old), params, state.params)
        opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), opt_state, state.opt_state)
        if fp16:
            loss_scale = update_loss_scale(state.loss_scale, ok, self.cfg)
            nonfinite = ~finite_loss
        else:
            loss_scale = state.loss_scale.replace(skipped=state.loss_scale.skipped + (~ok).astype(jnp.int32))
            nonfinite = ~ok
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": learning_rate(self.cfg)(state.step),
                   "loss_scale": loss_scale.scale, "skipped_steps": loss_scale.skipped, "nonfinite": nonfinite}
        new = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                            data_position=state.data_position + batch.shape[0], loss_scale=loss_scale,
                            buffers=self._new_buffers(params, *local))
        return new, metrics

    @cached_property
    def train_step(self):
        rep = shardings(self.mesh, P())
        # keep_unused: the step never reads main_grad (it is overwritten), but kept as an argument
        # the donated buffer is aliased to the new one, so it persists instead of being reallocated
        return jax.jit(self._train_step, in_shardings=(self.state_shardings, batch_sharding(self.mesh)),
                       out_shardings=(self.state_shardings, rep),
                       donate_argnums=0, keep_unused=True)

    @cached_property
    def eval_step(self):
        return jax.jit(self.loss_fn, in_shardings=(self.state_shardings.params, batch_sharding(self.mesh)),
                       out_shardings=shardings(self.mesh, P()))

    @cached_property
    def local_rows(self) -> np.ndarray:
        """Sorted rows of a global batch [B, s+1] that this process's devices hold: all B with one
        process; with several, the rows of the `data` ranks its devices sit on (make_mesh groups
        devices by process, so usually one contiguous block)."""
        shape = (self.cfg.train.global_batch, self.cfg.model.seq_len + 1)
        slices = batch_sharding(self.mesh).addressable_devices_indices_map(shape).values()
        return np.array(sorted({r for idx in slices for r in range(*idx[0].indices(shape[0]))}))

    def put_batch(self, batch) -> jax.Array:
        """The global batch [B, s+1], split over `data`, from this process's part of it.

        `batch` is either this process's rows (`local_rows`, as a BatchLoader with
        `rows=local_rows` reads them) or the whole global batch, of which only those
        rows are used. Each process hands its devices only their own rows.
        """
        batch = np.asarray(batch, np.int32)
        rows, total = self.local_rows, self.cfg.train.global_batch
        if batch.shape[0] == total and len(rows) < total:
            batch = batch[rows]
        if batch.shape[0] != len(rows):
            raise ValueError(f"batch of {batch.shape[0]} rows is neither the global batch ({total}) "
                             f"nor this process's {len(rows)} rows")
        return jax.make_array_from_process_local_data(batch_sharding(self.mesh), batch, (total, batch.shape[1]))

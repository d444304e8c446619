"""The Trainer: what one run builds once from (config, mesh, vocabulary), in the order it is built.

  1. `plan`: every static fact of a step (`plan.py`), resolved once on top of the model's
     `layout` (`mtjax/layout.py`): sizes, dtype, recomputation, schedule, and per parameter its
     mesh spec, shape, tensor reduction (`plan.params`) and the
     optimizer state's split over `pipe` and the replicas (`plan.split`, `zero.py`);
  2. `global_model` (global shapes, t = 1: it initialises the parameters), `tx` (AdamW), and the
     TrainState's `specs` and `state_shardings` (fp32 master weights and moments, laid out by
     `plan.split`);
  3. the functions: `scaled_grad_fn` (the step's `shard_map`, `step.py`), `train_step` (that plus
     the optimizer update), `eval_step`, and the layout's `logits_fn`.

`train_step(state, batch) -> (state, metrics)` is jitted once, with explicit input/output
shardings and the state donated. Nothing here is computed lazily: reading `__init__` top to
bottom is reading how a run is put together.
"""
from __future__ import annotations

import dataclasses
import functools
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from mtjax.config.schema import Config
from mtjax.layout import compute_params, logits_fn
from mtjax.partitioning import shardings
from mtjax.pipeline.layer_order import permute_layers
from mtjax.training import state as state_lib
from mtjax.training import moe_stats
from mtjax.training.loss_scale import all_finite, init_loss_scale, step_scale, update_loss_scale
from mtjax.training.lr_schedule import learning_rate
from mtjax.training.optimizer import make_optimizer
from mtjax.training.plan import StepPlan, resolve_plan
from mtjax.training.step import batch_sharding, local_model, make_grad_fn, make_loss_fn
from mtjax.training.zero import StateSplit


class Trainer:
    """Everything a run steps with; see the module docstring for the order it is built in.
    `split` replaces the plan's optimizer-state layout (tests compare layouts with it); `eod`: the
    tokenizer's end-of-document id (read with `data.document_masking` or `data.eod_mask_loss`)."""

    def __init__(self, cfg: Config, mesh, vocab: int, split: StateSplit | None = None, eod: int | None = None):
        plan = resolve_plan(cfg, mesh, vocab, eod)
        # the model's side: parameters, layer order, compute weights, logits (`mtjax/layout.py`)
        self.layout = layout = plan.layout
        # 2d / 2.5d: the same devices, `tensor` cut into the grid's named sub-axes (`parallel/grid.py`)
        mesh = layout.mesh
        self.cfg, self.mesh, self.vocab = cfg, mesh, vocab       # vocab: the tokenizer's V, unpadded
        self.plan = plan = plan if split is None else dataclasses.replace(plan, split=split)
        # global shapes (t = 1): initialises the parameters, the vocabulary's at a size no layout changes
        self.global_model = layout.drawn_model()
        # the state: master weights and moments, laid out over pipe and the replicas (`plan.split`)
        self.tx = make_optimizer(cfg)
        self.specs = state_lib.state_specs(self.tx, plan.split.specs, plan.params.shapes)
        self.state_shardings = shardings(mesh, self.specs)
        self.batch_sharding = batch_sharding(mesh)
        self.local_rows = _local_rows(self.batch_sharding, plan)
        self._layer_rows = layout.layer_rows()
        # the functions
        self.scaled_grad_fn = make_grad_fn(local_model(cfg.model, plan), mesh, plan)
        # one program: a shard_map called outside jit would dispatch (and compile) op by op
        self._grad_program = jax.jit(self.scaled_grad_fn)
        evaluated = local_model(cfg.model, plan, deterministic=True)
        self.loss_fn = make_loss_fn(evaluated, mesh, plan)
        self.logits_fn = logits_fn(layout)
        replicated = shardings(mesh, P())
        self.train_step = jax.jit(self._train_step, in_shardings=(self.state_shardings, self.batch_sharding),
                                  out_shardings=(self.state_shardings, replicated), donate_argnums=0)
        # validation runs the weights the step computes with (the 16-bit copy under bf16/fp16), as
        # Megatron evaluates its 16-bit model: the master's norm scales would give another loss
        self.eval_step = jax.jit(lambda master, batch: self.loss_fn(self.compute_params(master), batch),
                                 in_shardings=(self.state_shardings.params, self.batch_sharding),
                                 out_shardings=replicated)

    # ------------------------------------------------------------------ what callers read

    @property
    def padded_vocab(self) -> int:
        return self.plan.padded_vocab

    @property
    def param_specs(self):
        """The parameters' mesh specs as declared (`plan.params.specs`); under FSDP the step
        computes with `plan.compute_specs`, where the layer leaves FSDP shards stay split."""
        return self.plan.params.specs

    @property
    def schedule(self):
        """The training schedule's table (None without pipelining)."""
        return self.plan.schedule

    # ------------------------------------------------------------------ state

    def init_state(self, seed: int | None = None) -> state_lib.TrainState:
        seed = self.cfg.train.seed if seed is None else seed
        return self.run_order(self._create_state(jax.random.key(seed)))  # drawn canonical, stored in run order

    @functools.cached_property
    def _create_state(self):
        return state_lib.state_initializer(self.global_model, self.tx, self.mesh, self.plan.seq_len,
                                           self.specs, init_loss_scale(self.cfg), self.plan.padded_vocab)

    def run_order(self, tree):
        """A state, parameter or gradient tree from canonical layer order into the order this
        layout stores and runs the layers in (states keep their shardings)."""
        return self._permute(tree, 0)

    def canonical(self, tree):
        """The inverse of `run_order`: what checkpoints, the reference and users see."""
        return self._permute(tree, 1)

    def _canonical_rows(self, stacked):
        """A [rows of `layers`, ...] array (the MoE routing sums) in canonical order: per-layer
        metrics are numbered as the model's layers are, not as a V or interleaved layout stores them."""
        if stacked is None or self._layer_rows is None:
            return stacked
        return jnp.take(stacked, self._layer_rows[1], axis=0)

    def _permute(self, tree, which: int):
        if self._layer_rows is None:
            return tree
        rows = self._layer_rows[which]
        if isinstance(tree, state_lib.TrainState):
            return jax.jit(lambda t: permute_layers(t, rows), out_shardings=self.state_shardings)(tree)
        return jax.jit(lambda t: permute_layers(t, rows))(tree)     # one program, not a take per leaf

    # ------------------------------------------------------------------ the step

    def grad_fn(self, params, batch, rng_data, scale=1.0):
        """(grads, loss): reduced gradients of the mean loss (times `scale`), for tests and tools."""
        return self._grad_program(params, batch, rng_data, jnp.float32(scale))

    def compute_params(self, master):
        """The parameters the step computes with: `layout.compute_params` from where the
        optimizer state keeps the master (split over the replicas with the distributed optimizer, over
        `pipe` for the pipe-replicated leaves; `zero.py`). Under fp32 without the distributed
        optimizer they are the master itself (its pipe-split leaves are gathered in fp32 where
        they enter the step's shard_map)."""
        if not self.plan.keeps_compute_copy:
            return master
        target = None if self.plan.fsdp is None else shardings(self.mesh, self.plan.compute_specs)
        return compute_params(self.layout, master, self.state_shardings.params, target)

    def _train_step(self, state, batch):
        rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step))
        fp16 = self.plan.precision == "fp16"
        scale = step_scale(state.loss_scale, self.cfg)
        grads, loss = self.scaled_grad_fn(self.compute_params(state.params), batch, rng, scale)
        grads, routing = moe_stats.take_stats(grads, self.cfg.model)      # MoE routing sums, out of the gradients
        if fp16:
            grads = jax.tree.map(lambda g: g / scale, grads)
        # A step whose loss, gradients or updated weights and moments are not finite changes
        # nothing but the counters, so non-finite weights never exist (fp16 overflows are the
        # scaler's business; the rest is reported as `nonfinite`, and the loop stops or goes on
        # per train.on_nonfinite). Two passes over the state, neither writing what the other
        # reads: the first only reduces isfinite over the update (nothing is stored), the second
        # computes the update again and writes it or the old state. Computing it once and
        # selecting after stored the new weights and moments and read them back beside the old
        # ones (a 13B step at tensor 8 on H100s: 41.7 ms of update passes, now 31.1, predicted by
        # `mtjax.inspect --target h100`). The barrier
        # keeps XLA from merging the two computations into one stored result; the gradients stay
        # outside it, so the clipping norm is still reduced once.
        finite_grads, finite_loss = all_finite(grads), jnp.isfinite(loss)
        ok = finite_grads & finite_loss & all_finite(self._updated(grads, state.params, state.opt_state))
        old_params, old_opt, ok = jax.lax.optimization_barrier((state.params, state.opt_state, ok))
        params, opt_state = self._updated(grads, old_params, old_opt)
        params = jax.tree.map(lambda new, old: jnp.where(ok, new, old), params, old_params)
        opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), opt_state, old_opt)
        # the balancing bias follows the forward's loads whenever they were counted (a finite
        # loss), a step skipped for its gradients included, as Megatron moves `expert_bias` in
        # finalize_model_grads before its optimizer finds an overflow
        params = moe_stats.update_router_bias(params, routing, self.cfg.model, where=finite_loss)
        if fp16:
            loss_scale = update_loss_scale(state.loss_scale, ok, self.cfg)
            nonfinite = ~finite_loss
        else:
            loss_scale = state.loss_scale.replace(skipped=state.loss_scale.skipped + (~ok).astype(jnp.int32))
            nonfinite = ~ok
        # the lr this step applies: the schedule at the optimizer's count, the steps applied so far
        # (a skipped step leaves it, as Megatron's scheduler; `state.step` counts every step)
        applied = state.step - state.loss_scale.skipped
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": learning_rate(self.cfg)(applied),
                   "loss_scale": loss_scale.scale, "skipped_steps": loss_scale.skipped, "nonfinite": nonfinite,
                   **moe_stats.metrics(self._canonical_rows(routing), self.cfg.model, self.plan.global_batch)}
        new = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                            data_position=state.data_position + batch.shape[0], loss_scale=loss_scale)
        return new, metrics

    def _updated(self, grads, params, opt_state):
        """(weights, optimizer state) after one optimizer step from `params`, `opt_state`."""
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # ------------------------------------------------------------------ batches

    def put_batch(self, batch) -> jax.Array:
        """The global batch [B, s+1], split over `data`, from this process's part of it.

        `batch` is either this process's rows (`local_rows`, as a BatchLoader with
        `rows=local_rows` reads them) or the whole global batch, of which only those
        rows are used. Each process hands its devices only their own rows.
        """
        batch = np.asarray(batch, np.int32)
        rows, total = self.local_rows, self.plan.global_batch
        if batch.shape[0] == total and len(rows) < total:
            batch = batch[rows]
        if batch.shape[0] != len(rows):
            raise ValueError(f"batch of {batch.shape[0]} rows is neither the global batch ({total}) "
                             f"nor this process's {len(rows)} rows")
        return jax.make_array_from_process_local_data(self.batch_sharding, batch, (total, batch.shape[1]))


def _local_rows(sharding, plan: StepPlan) -> np.ndarray:
    """Sorted rows of a global batch [B, s+1] that this process's devices hold: all B with one
    process; with several, the rows of the `data` ranks its devices sit on (make_mesh groups
    devices by process, so usually one contiguous block)."""
    shape = (plan.global_batch, plan.seq_len + 1)
    slices = sharding.addressable_devices_indices_map(shape).values()
    spans = {idx[0].indices(shape[0]) for idx in slices}      # (start, stop, step): a few distinct ones
    return np.unique(np.concatenate([np.arange(*span) for span in sorted(spans)]))

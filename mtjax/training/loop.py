"""The training loop: data -> jitted step -> metrics, with periodic validation.

Throughput is measured between log points after the first step (which
includes compilation), with the device synchronised at each log point; the time validation
and checkpoint saves take is left out (as Megatron's interval timer does).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import jax
import numpy as np

from mtjax.config.errors import RunFault
from mtjax.config.schema import Config
from mtjax.data import BatchLoader
from mtjax.training.data_setup import Datasets
from mtjax.training.flops import model_flops, peak_tflops
from mtjax.training.metrics import MetricsWriter
from mtjax.training.packing import loss_labels
from mtjax.training.profile import StepProfiler
from mtjax.training.signals import StopRequest
from mtjax.training.state import state_is_finite
from mtjax.training.trainer import Trainer


def evaluate(trainer: Trainer, params, valid, cfg: Config) -> dict:
    """Validation losses over the first `eval_batches` global batches of each validation set
    (`Datasets.valid`): L_k per named set as `val_loss/<name>`, and the blend's expected loss
    val_loss = sum_k w_k L_k (the sets' weights, normalised). L_k is per loss-carrying label over
    all its batches, L_k = sum_j N_j L_kj / sum_j N_j, with N_j batch j's count of such labels
    (`training/packing.py`; B s for every batch unless fine-tuning rows or EOD masks drop some),
    so a batch of few response tokens weighs less than one of many, as in the training loss."""
    row, blend, done = {}, 0.0, {}
    for vs in valid:
        if id(vs.dataset) not in done:     # a corpus listed twice is one dataset (`data_setup`): evaluated once
            done[id(vs.dataset)] = _valid_loss(trainer, params, vs.dataset, cfg)
        loss = done[id(vs.dataset)]
        blend += vs.weight * loss
        if vs.name:
            row[f"val_loss/{vs.name}"] = loss
    return {"val_loss": blend, "val_ppl": math.exp(min(blend, 50.0)), **row}


def _valid_loss(trainer: Trainer, params, dataset, cfg: Config) -> float:
    """L over the first eval_batches global batches of `dataset` (`evaluate`)."""
    loader = BatchLoader(dataset, cfg.train.global_batch, rows=trainer.local_rows)
    sums, counts = 0.0, 0.0
    for _ in range(cfg.train.eval_batches):
        batch = trainer.put_batch(loader.next_batch())    # global: every process counts the same
        n = loss_labels(batch, trainer.plan)
        sums += n * float(trainer.eval_step(params, batch))
        counts += n
    return sums / counts if counts else 0.0


class Throughput:
    """tokens/s, TFLOP/s per device and MFU over the steps since the last report.

    The FLOPs are the model's (`flops.model_flops`: without recomputation), as Megatron's
    throughput and every published MFU count them and as `inspect`'s `predicted_mfu` does: work
    a recompute mode repeats is not model work, so it does not raise the figure (counting it
    would give the hardware FLOPs utilisation, 4/3 of MFU under full recomputation)."""

    def __init__(self, trainer: Trainer, cfg: Config):
        self.tokens = trainer.plan.tokens_per_step
        self.flops = model_flops(cfg.model, trainer.plan)
        self.devices = trainer.mesh.size
        self.peak = peak_tflops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
        self.mark(0)

    def mark(self, step: int) -> None:
        self.t0, self.step0 = time.perf_counter(), step

    @contextlib.contextmanager
    def paused(self, state):
        """Leave out of the figures the time spent inside (a validation pass, a checkpoint save),
        but not the steps still computing when it starts: `state` is waited for first."""
        jax.block_until_ready(state)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.t0 += time.perf_counter() - start

    def report(self, step: int) -> dict:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        n = step - self.step0
        tflops = self.flops * n / dt / self.devices / 1e12
        self.mark(step)
        return {"step_time_s": dt / max(n, 1), "tokens_per_s": self.tokens * n / dt,
                "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None}


class NonFiniteLoss(RunFault):
    """Training stopped on a non-finite step (train.on_nonfinite=stop), or a save refused
    non-finite weights."""


@dataclass
class Outcome:
    """How `train` ended: the logged rows, the last step, and the signal that stopped it, if any."""

    rows: list
    step: int
    stopped_by: str | None = None


def train(cfg: Config, trainer: Trainer, data: Datasets, writer: MetricsWriter, state=None,
          checkpointer=None, stop: StopRequest | None = None, position: int | None = None) -> Outcome:
    """Run from `state` (fresh when None) to cfg.train.steps, reading samples from `position`
    (the exact count of a checkpoint's meta; by default the state's int32 data position).

    Saves through `checkpointer` every checkpoint.interval steps, at the end, and when `stop`
    reports a signal (then returns early: that step is the run's last, logged with its training
    metrics whatever train.log_interval, and checked for a non-finite loss, as step
    train.steps is). A step with a non-finite loss is never applied (the step function keeps the
    old weights); with train.on_nonfinite=stop it ends the run with NonFiniteLoss, with `skip` it
    is counted in `skipped_steps` and training goes on.
    """
    state = trainer.init_state() if state is None else state
    position = int(state.data_position) if position is None else position
    loader = BatchLoader(data.train, cfg.train.global_batch, position=position, rows=trainer.local_rows)
    meter = Throughput(trainer, cfg)
    interval = cfg.checkpoint.interval
    rows, first, pending = [], True, None
    done = int(state.step)
    with StepProfiler.of(cfg, jax.process_index() == 0) as profiler:    # stopped however the loop ends
        while done < cfg.train.steps:
            with profiler.step(done + 1):
                state, metrics = trainer.train_step(state, trainer.put_batch(loader.next_batch()))
            profiler.finished(done + 1, metrics)
            if checkpointer is not None:
                checkpointer.check()             # a save that failed in the background ends the run now
            nonfinite = metrics.pop("nonfinite")
            _check_finite(pending, cfg)          # the previous step's flag: read while this one runs
            pending = (done + 1, nonfinite, metrics["loss"])
            writer.advance()
            done += 1
            if first:  # the first step compiles: keep it out of the throughput figures
                jax.block_until_ready(metrics)
                meter.mark(done)
                first = False
            row = _logged_row(cfg, trainer, data, state, metrics, meter, done)
            signal_name = stop.requested(done) if stop is not None else None
            if signal_name and "loss" not in row:     # the run's last step: logged as the last of train.steps is
                row = {**_training_row(metrics, meter, done), **row}
            if row:
                writer.log(done, row)
                rows.append({"step": done, **row})
            due = checkpointer is not None and (done == cfg.train.steps or bool(interval and done % interval == 0))
            if signal_name or due:      # the run's last step (saved or not), or one a checkpoint will hold
                _check_finite(pending, cfg)
                pending = None
                if checkpointer is not None:
                    # wait for the last save too: a SIGTERM after the loop would find the handlers gone
                    with meter.paused(state):
                        save(checkpointer, state, trainer, wait=bool(signal_name) or done == cfg.train.steps,
                             position=loader.position)
            if signal_name:
                return Outcome(rows, done, signal_name)
        _check_finite(pending, cfg)
        return Outcome(rows, done)


def _logged_row(cfg: Config, trainer: Trainer, data: Datasets, state, metrics, meter: Throughput, done: int) -> dict:
    """Step `done`'s row: its training metrics at a log point (and at train.steps), validation at
    an eval point (and at train.steps), or {}."""
    row = {}
    if done % cfg.train.log_interval == 0 or done == cfg.train.steps:
        row = _training_row(metrics, meter, done)
    if data.valid is not None and cfg.train.eval_interval and (
            done % cfg.train.eval_interval == 0 or done == cfg.train.steps):
        with meter.paused(state):     # the steps before it stay in the figures, its own time does not
            row.update(evaluate(trainer, state.params, data.valid, cfg))
    return row


FIRST = ("loss", "lr", "grad_norm")     # what a reader looks for first, as Megatron's line has them near its start


def _training_row(metrics, meter: Throughput, done: int) -> dict:
    """Step `done`'s metrics as a row (counters such as skipped_steps stay integers in
    metrics.jsonl; the rest are floats), `FIRST` first, with the throughput since the last report."""
    values = jax.device_get(metrics)
    order = [k for k in FIRST if k in values] + [k for k in values if k not in FIRST]
    row = {k: int(values[k]) if np.issubdtype(np.asarray(values[k]).dtype, np.integer) else float(values[k])
           for k in order}
    return {**row, **(meter.report(done) if meter.step0 < done else {})}


def save(checkpointer, state, trainer, wait: bool = False, position: int | None = None) -> None:
    """Save unless the weights are not finite (then refuse: a checkpoint must be usable)."""
    checkpointer.save(state, trainer, precheck=_refuse_nonfinite, position=position)
    if wait:
        checkpointer.wait()


def _refuse_nonfinite(state) -> None:
    if not state_is_finite(state):
        raise NonFiniteLoss(f"refusing to checkpoint non-finite weights at step {int(state.step)}")


def _check_finite(pending, cfg: Config) -> None:
    """Stop on a step flagged `nonfinite` (its loss, or without fp16 its gradients or update, not
    finite; the update was not applied)."""
    if pending is None or cfg.train.on_nonfinite != "stop":
        return
    step, nonfinite, loss = pending
    if bool(nonfinite):
        raise NonFiniteLoss(f"non-finite loss or gradients at step {step} (loss {float(loss)}); the step was not "
                            f"applied and training stopped (train.on_nonfinite=stop; `skip` drops such steps "
                            f"and goes on)")

"""The training loop: data -> jitted step -> metrics, with periodic validation.

Throughput is measured between log points after the first step (which
includes compilation), with the device synchronised at each log point.
"""
from __future__ import annotations

import math
import time

import jax
import numpy as np

from mtjax.config.schema import Config
from mtjax.data import BatchLoader
from mtjax.training.data_setup import Datasets
from mtjax.training.flops import flops_per_step, peak_tflops
from mtjax.training.metrics import MetricsWriter
from mtjax.training.trainer import Trainer


def evaluate(trainer: Trainer, params, valid, cfg: Config) -> dict:
    """Mean validation loss over the first `eval_batches` global batches of the valid split."""
    loader = BatchLoader(valid, cfg.train.global_batch)
    losses = [float(trainer.eval_step(params, trainer.put_batch(loader.next_batch())))
              for _ in range(cfg.train.eval_batches)]
    loss = float(np.mean(losses))
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


class Throughput:
    """tokens/s, TFLOP/s per device and MFU over the steps since the last report."""

    def __init__(self, trainer: Trainer, cfg: Config):
        self.tokens = trainer.layout.tokens_per_step
        self.flops = flops_per_step(cfg.model, trainer.padded_vocab, cfg.train.global_batch, cfg.train.recompute)
        self.devices = trainer.mesh.size
        self.peak = peak_tflops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
        self.mark(0)

    def mark(self, step: int) -> None:
        self.t0, self.step0 = time.perf_counter(), step

    def report(self, step: int) -> dict:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        n = step - self.step0
        tflops = self.flops * n / dt / self.devices / 1e12
        self.mark(step)
        return {"step_time_s": dt / max(n, 1), "tokens_per_s": self.tokens * n / dt,
                "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None}


def train(cfg: Config, trainer: Trainer, data: Datasets, writer: MetricsWriter) -> list[dict]:
    """Run cfg.train.steps steps; returns the logged rows."""
    state = trainer.init_state()
    loader = BatchLoader(data.train, cfg.train.global_batch, position=int(state.data_position))
    meter = Throughput(trainer, cfg)
    rows, first = [], True
    for step in range(int(state.step), cfg.train.steps):
        state, metrics = trainer.train_step(state, trainer.put_batch(loader.next_batch()))
        writer.advance()
        done = step + 1
        if first:  # the first step compiles: keep it out of the throughput figures
            jax.block_until_ready(metrics)
            meter.mark(done)
            first = False
        row = {}
        if done % cfg.train.log_interval == 0 or done == cfg.train.steps:
            row = {k: float(v) for k, v in jax.device_get(metrics).items()}
            row.update(meter.report(done) if meter.step0 < done else {})
        if data.valid is not None and cfg.train.eval_interval and (
                done % cfg.train.eval_interval == 0 or done == cfg.train.steps):
            row.update(evaluate(trainer, state.params, data.valid, cfg))
            meter.mark(done)
        if row:
            if not math.isfinite(row.get("loss", 0.0)):
                raise FloatingPointError(f"non-finite loss {row['loss']} at step {done}")
            writer.log(done, row)
            rows.append({"step": done, **row})
    return rows

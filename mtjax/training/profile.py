"""A profiler trace of chosen training steps (`train.profile`, Megatron's `--profile`,
`--profile-step-start`, `--profile-step-end`).

Steps n with start <= n < end (numbered from 1, as the log lines number them) run inside
`jax.profiler.start_trace` / `stop_trace`, each under a `StepTraceAnnotation`, so the trace's
step view cuts at step boundaries. The trace goes to `<train.run_dir>/profile/plugins/profile/
<time>/<host>.xplane.pb` (and a Chrome-trace `.trace.json.gz`), TensorBoard's profile plugin's
layout: `tensorboard --logdir <run_dir>/profile`, or Perfetto for the JSON. Only process 0
traces (its own devices), as Megatron's default `--profile-ranks 0`.

Dispatch is asynchronous: the trace starts before step `start` is dispatched and stops once step
end - 1's outputs are ready, so it holds those steps' device work whole. A run that ends inside
the window (train.steps, a signal, a time limit, an error) stops the trace with what it has.
"""
from __future__ import annotations

import contextlib
import os

import jax


class StepProfiler:
    """`with StepProfiler(cfg, main_process) as p:` around the loop; `p.step(n)` around the dispatch
    of step n (a context), `p.finished(n, outputs)` after it."""

    def __init__(self, run_dir: str, start: int, end: int, enabled: bool):
        self.directory = os.path.join(run_dir, "profile")
        self.start, self.end, self.enabled = start, end, enabled
        self.tracing = False

    @classmethod
    def of(cls, cfg, main_process: bool) -> "StepProfiler":
        tr = cfg.train
        return cls(tr.run_dir, tr.profile_step_start, tr.profile_step_end, tr.profile and main_process)

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def step(self, n: int):
        """A context around the dispatch of step n: starts the trace at `start`, annotates the step."""
        if not self.enabled or not self.start <= n < self.end:
            return contextlib.nullcontext()
        if not self.tracing:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.tracing = True
        return jax.profiler.StepTraceAnnotation("train", step_num=n)

    def finished(self, n: int, outputs) -> None:
        """Step n is dispatched: the trace stops once the window's last step is done."""
        if self.tracing and n >= self.end - 1:
            jax.block_until_ready(outputs)
            self._stop()

    def _stop(self) -> None:
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()

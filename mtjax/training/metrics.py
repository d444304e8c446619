"""Where metrics go: a progress bar (interactive runs), `metrics.jsonl` and TensorBoard events.

Only process 0 writes. One JSON object per logged step, at least `step` and `loss`.
"""
from __future__ import annotations

import json
import math
import os
import sys


class MetricsWriter:
    def __init__(self, run_dir: str, total_steps: int, progress: bool, enabled: bool = True,
                 resume_step: int | None = None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._bar = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        # A fresh run starts a new file. A resumed one keeps the rows up to its checkpoint's
        # step (later ones belong to steps it is about to redo) and appends.
        if resume_step is not None:
            keep_rows_up_to(self.path, resume_step)
        self._file = open(self.path, "a" if resume_step is not None else "w", encoding="utf-8")
        try:
            from tensorboardX import SummaryWriter
            # TensorBoard hides earlier files' events from this step on, as metrics.jsonl drops
            # their rows: those steps are redone (or, in a fresh run, belong to another run)
            first_step = 1 if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=first_step)
        except ImportError:
            self._tb = None
        if progress and sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in row.items() if k in ("loss", "lr", "tokens_per_s")})
        else:
            print(format_row(row), flush=True)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def keep_rows_up_to(path: str, step: int) -> None:
    """Rewrite `path` (atomically) without the rows logged after `step`."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8", errors="replace") as f:   # a damaged line is dropped below, not fatal
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue   # a line cut by a crash
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _plain(v):
    v = v.item() if hasattr(v, "item") else v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def format_row(row: dict) -> str:
    parts = []
    for k, v in row.items():
        parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return " | ".join(parts)

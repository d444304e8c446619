"""`python scripts/bench_checkpoint.py [--config gpt100m] [--steps N] [--repeats R] [--json OUT]`

Checkpoint cost for the ~100M-parameter config on one device (fp32 master weights and
both AdamW moments: 12 bytes per parameter, plus a few scalars):
  - size on disk of one checkpoint (all files of `<step>/`), and bytes per parameter;
  - save time, synchronous (`checkpoint.async_save=false`: the loop waits for every byte);
  - restore time, split into the manifest check (CRC-32 of every file) and orbax's read
    onto the device layout;
  - what an asynchronous save costs the training loop: the time `save()` blocks (the
    device-to-host copy), and the extra wall time of N steps that start with an
    asynchronous save over N steps without one (the background write competes with the
    step for the CPU cores here; on a GPU host it competes only for host cores and disk).
    Both variants run R times, taking turns, and the medians are compared.
Steps use `model.seq_len=128`, `train.global_batch=2` (overridable) so that a step takes
about a second on 2 CPU cores; the checkpoint is the same size as at seq_len 1024 up to
the position table (0.8% of the parameters).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np

from mtjax.config import load_config, validate
from mtjax.mesh import make_mesh
from mtjax.checkpoint import Checkpointer, verify
from mtjax.training.trainer import Trainer

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
VOCAB = 257
STEP_OVERRIDES = ["model.seq_len=128", "train.global_batch=2", "train.micro_batch=2"]


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files)


def make(config: str, directory: str, async_save: bool, extra: list[str]) -> tuple[Trainer, Checkpointer]:
    cfg = load_config(os.path.join(CONFIGS, f"{config}.yaml"),
                      STEP_OVERRIDES + extra + [f"checkpoint.dir={directory}", "checkpoint.keep=100",
                                                f"checkpoint.async_save={'true' if async_save else 'false'}"])
    validate(cfg, 1)
    trainer = Trainer(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), VOCAB)
    return trainer, Checkpointer(cfg)


def steps(trainer, state, batch, n: int, ckpt: Checkpointer | None):
    """(state, seconds for n steps, seconds save() blocked); an async save starts before step 1."""
    t0, blocked = time.perf_counter(), 0.0
    if ckpt is not None:
        state = state.replace(step=state.step + 10_000 * (len(ckpt.steps()) + 1))   # a new step number
        b0 = time.perf_counter()
        ckpt.save(state, trainer)
        blocked = time.perf_counter() - b0
    for _ in range(n):
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - t0
    if ckpt is not None:
        ckpt.wait()
    return state, elapsed, blocked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="gpt100m")
    ap.add_argument("--steps", type=int, default=4, help="steps per timed window")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="mtjax-bench-ckpt-")
    out = {"config": args.config, "overrides": STEP_OVERRIDES + args.overrides, "device": jax.devices()[0].device_kind}
    try:
        trainer, ckpt = make(args.config, os.path.join(root, "async"), True, args.overrides)
        batch = trainer.put_batch(np.random.RandomState(0).randint(0, VOCAB, (trainer.cfg.train.global_batch,
                                                                              trainer.cfg.model.seq_len + 1)))
        state, _, _ = steps(trainer, trainer.init_state(), batch, 2, None)     # compile; moments non-zero
        plain, saving, blocked = [], [], []
        for _ in range(args.repeats):
            state, t, _ = steps(trainer, state, batch, args.steps, None)
            plain.append(t)
            state, t, b = steps(trainer, state, batch, args.steps, ckpt)
            saving.append(t)
            blocked.append(b)
        ckpt.close()

        sync_trainer, sync_ckpt = make(args.config, os.path.join(root, "sync"), False, args.overrides)
        params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        sync_ckpt.save(state, sync_trainer)
        sync_ckpt.wait()
        out["save_sync_s"] = time.perf_counter() - t0
        step = sync_ckpt.steps()[-1]
        step_dir = os.path.join(sync_ckpt.directory, str(step))
        out.update(parameters=params, size_bytes=dir_bytes(step_dir))
        out["bytes_per_parameter"] = out["size_bytes"] / params
        del state
        t0 = time.perf_counter()
        assert verify(step_dir) is None
        out["restore_verify_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        jax.block_until_ready(sync_ckpt.restore(step, sync_trainer))
        out["restore_read_s"] = time.perf_counter() - t0
        sync_ckpt.close()

        base = statistics.median(plain)
        out.update(steps_per_window=args.steps, window_plain_s=base, window_with_async_save_s=statistics.median(saving),
                   save_async_blocking_s=statistics.median(blocked))
        out["async_save_cost_s"] = out["window_with_async_save_s"] - base
        out["async_cost_over_sync_save"] = out["async_save_cost_s"] / out["save_sync_s"]
        out["step_s"] = base / args.steps
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for k, v in out.items():
        print(f"{k:28s} {v:.4g}" if isinstance(v, float) else f"{k:28s} {v}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

"""`python -m mtjax.train --config FILE [--cpu-devices N] [group.field=value ...]`

Parse, validate, build the mesh, data and trainer; restore the newest complete
checkpoint if there is one (checkpoint.resume); run the loop. Nothing is written
before the configuration, the data and the checkpoint plan have been checked.
SIGTERM or SIGINT ends the run at the next step with a checkpoint.
"""
from __future__ import annotations

import json
import os
import sys

from mtjax import cli


def main(argv: list[str]) -> int:
    args = cli.make_parser("python -m mtjax.train", "Train a GPT/Llama model on a (data, pipe, tensor) mesh.").parse_args(argv)
    cfg, mesh = cli.setup(args)
    import jax

    from mtjax.training.checkpoint import Checkpointer, plan_checkpoints
    from mtjax.training.data_setup import build_datasets
    from mtjax.training.trainer import Trainer

    plan = plan_checkpoints(cfg)                 # refuses to discard checkpoints before anything is built
    data = build_datasets(cfg)
    trainer = Trainer(cfg, mesh, data.vocab)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    checkpointer = None
    if cfg.checkpoint.enabled:
        plan.clear_if_starting_over()
        checkpointer = Checkpointer(cfg, plan.directory)
    try:
        return run(cfg, mesh, data, trainer, checkpointer, plan.directory, say)
    finally:
        if checkpointer is not None:       # orbax's threads must end, or the process would not exit
            checkpointer.close()


def run(cfg, mesh, data, trainer, checkpointer, directory: str, say) -> int:
    """Restore (when resuming), write the run's config, train; the exit status."""
    import jax

    from mtjax.training.loop import NonFiniteLoss, train
    from mtjax.training.metrics import MetricsWriter
    from mtjax.training.signals import StopRequest

    state = None
    if checkpointer is not None and cfg.checkpoint.resume:
        step = checkpointer.latest_valid(report=lambda line: say(f"warning: {line}", file=sys.stderr, flush=True))
        if step is not None:
            state = checkpointer.restore(step, trainer)
            say(f"resumed from checkpoint step {step} in {directory}", flush=True)
    start = int(state.step) if state is not None else 0
    if start >= cfg.train.steps:
        say(f"nothing to do: the checkpoint at step {start} has reached train.steps={cfg.train.steps}", flush=True)
        return 0
    main_process = jax.process_index() == 0
    if main_process:
        os.makedirs(cfg.train.run_dir, exist_ok=True)
        with open(os.path.join(cfg.train.run_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        print(f"mesh (data, pipe, tensor) = {tuple(mesh.devices.shape)} on {jax.device_count()} "
              f"{jax.devices()[0].platform} devices; vocab {data.vocab} (padded {trainer.padded_vocab}); "
              f"data {data.prefix}; run dir {cfg.train.run_dir}", flush=True)
    writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, cfg.train.progress, enabled=main_process,
                           resume_step=start if state is not None else None)
    try:
        with StopRequest() as stop:
            outcome = train(cfg, trainer, data, writer, state, checkpointer, stop)
    except NonFiniteLoss as e:
        say(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        writer.close()
    if outcome.stopped_by:
        where = f"checkpoint saved in {directory}" if checkpointer is not None else "no checkpoint (checkpoint.enabled=false)"
        say(f"stopped by {outcome.stopped_by} after step {outcome.step}; {where}", flush=True)
    return 0

if __name__ == "__main__":
    cli.run(main)

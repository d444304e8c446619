"""`python -m mtjax.train --config FILE [--cpu-devices N] [group.field=value ...]`

Parse and validate; lock the run's directories (one run per directory); find the checkpoint
`train.init_from` names, unless the run resumes its own; open the data and check it was made
by this run's tokenizer and its ids fit the vocabulary; build the trainer and compile its step,
refusing a step that cannot fit in memory; restore the newest valid checkpoint
(checkpoint.resume; refused if the model or the data differ), or else start from init_from's
weights; then, and only then, write anything and train. A run refused on the way leaves
nothing behind (`training/workspace.py`).

SIGTERM or SIGINT while training ends the run at the next step with a checkpoint; before
training, at once; a second signal ends it at once in any case (`mtjax.interrupts`).
"""
from __future__ import annotations

import json
import logging
import os
import sys

from mtjax import cli


def main(argv: list[str]) -> int:
    args = cli.make_parser("python -m mtjax.train", "Train a GPT/Llama model on a (data, pipe, tensor) mesh.").parse_args(argv)
    cfg, mesh = cli.setup(args)
    import jax

    from mtjax.inspect import compile_train_step
    from mtjax.checkpoint import Checkpointer, plan_checkpoints
    from mtjax.training.data_setup import build_datasets
    from mtjax.training.init_from import find_source
    from mtjax.training.memory_fit import check_fits
    from mtjax.training.trainer import Trainer
    from mtjax.training.workspace import Workspace

    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    # Orbax reports a failed save twice: by raising (the loop turns that into one line) and by
    # logging tracebacks from its threads; keep only the first.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    with Workspace(cfg) as workspace:           # this run's directories are its own until it exits
        plan = plan_checkpoints(cfg)             # refuses to discard checkpoints
        resumes = cfg.checkpoint.resume and bool(plan.existing)
        source = find_source(cfg) if cfg.train.init_from and not resumes else None   # checked before compiling
        data = build_datasets(cfg, workspace)    # checks the token ids fit the vocabulary
        trainer = Trainer(cfg, mesh, data.vocab)
        check_fits(compile_train_step(trainer))  # the first step would run out of memory: refuse now
        checkpointer = Checkpointer(cfg, plan.directory, data=data.identity) if cfg.checkpoint.enabled else None
        try:
            state, resumed = restore(cfg, checkpointer, trainer, source, say)
            plan.clear_if_starting_over()
            workspace.started()                  # from here on, what the run writes stays
            data.save_caches()
            status = run(cfg, mesh, data, trainer, checkpointer, state, resumed, plan.directory, say)
        except BaseException:
            if checkpointer is not None:         # orbax's threads must end, or the process would not exit
                checkpointer.close(quiet=True)   # without raising over the error on its way out
            raise
        if checkpointer is not None:
            checkpointer.close()
        return status


def restore(cfg, checkpointer, trainer, source, say):
    """(state, resumed): the newest valid checkpoint's state when resuming; else step 0 from the
    weights of train.init_from (`source`, or found now if every checkpoint of the run was
    damaged); else None, a fresh start."""
    from mtjax.training.init_from import find_source, initial_state
    step = None
    if checkpointer is not None and cfg.checkpoint.resume:
        step = checkpointer.latest_valid(report=lambda line: say(f"warning: {line}", file=sys.stderr, flush=True))
    if step is not None:
        state = checkpointer.restore(step, trainer)
        say(f"resumed from checkpoint step {step} in {checkpointer.directory}", flush=True)
        if cfg.train.init_from:
            say(f"train.init_from={cfg.train.init_from} is not read: the run has its own checkpoints, and resuming "
                f"from them wins (checkpoint.resume=true)", flush=True)
        return state, True
    if not cfg.train.init_from:
        return None, False
    source = source or find_source(cfg)
    state = initial_state(source, trainer)
    say(f"started from the weights of checkpoint step {source.step} in {source.directory} (train.init_from); "
        f"fresh optimizer state, step 0", flush=True)
    return state, False


def run(cfg, mesh, data, trainer, checkpointer, state, resumed: bool, directory: str, say) -> int:
    """Write the run's config, train from `state` (fresh when None; a checkpoint's when
    `resumed`); the exit status."""
    import jax

    from mtjax.training.loop import train
    from mtjax.training.metrics import MetricsWriter
    from mtjax.interrupts import arm_second_signal
    from mtjax.training.signals import StopRequest

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
              f"attention {trainer.plan.attention}; data {data.prefix}; run dir {cfg.train.run_dir}", flush=True)
    writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, cfg.train.progress, enabled=main_process,
                           resume_step=start if resumed else None)
    try:
        with StopRequest(checkpointer) as stop:
            outcome = train(cfg, trainer, data, writer, state, checkpointer, stop)
    finally:
        if stop.requested_once:
            arm_second_signal()          # closing the writer and the checkpointer: a second signal acts at once
        writer.close()
    if outcome.stopped_by:
        where = f"checkpoint saved in {directory}" if checkpointer is not None else "no checkpoint (checkpoint.enabled=false)"
        say(f"stopped by {outcome.stopped_by} after step {outcome.step}; {where}", flush=True)
    return 0

if __name__ == "__main__":
    cli.run(main)

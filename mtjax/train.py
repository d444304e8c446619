"""`python -m mtjax.train --config FILE [--cpu-devices N] [group.field=value ...]`

Parse, validate, build the mesh, data and trainer, run the loop. Nothing is
written before the configuration and data have been checked.
"""
from __future__ import annotations

import json
import os

from mtjax import cli


def main(argv: list[str]) -> int:
    args = cli.make_parser("python -m mtjax.train", "Train a GPT/Llama model on a (data, pipe, tensor) mesh.").parse_args(argv)
    cfg, mesh = cli.setup(args)
    import jax

    from mtjax.training.data_setup import build_datasets
    from mtjax.training.loop import train
    from mtjax.training.metrics import MetricsWriter
    from mtjax.training.trainer import Trainer

    data = build_datasets(cfg)
    trainer = Trainer(cfg, mesh, data.vocab)
    main_process = jax.process_index() == 0
    if main_process:
        os.makedirs(cfg.train.run_dir, exist_ok=True)
        with open(os.path.join(cfg.train.run_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        print(f"mesh (data, pipe, tensor) = {tuple(mesh.devices.shape)} on {jax.device_count()} "
              f"{jax.devices()[0].platform} devices; vocab {data.vocab} (padded {trainer.padded_vocab}); "
              f"data {data.prefix}; run dir {cfg.train.run_dir}", flush=True)
    writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, cfg.train.progress, enabled=main_process)
    try:
        train(cfg, trainer, data, writer)
    finally:
        writer.close()
    return 0


if __name__ == "__main__":
    cli.run(main)

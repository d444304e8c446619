"""Train a model: `python -m mtjax.train` from the command line, `mtjax.train(...)` from Python.

    python -m mtjax.train --config FILE [--cpu-devices N] [group.field=value ...]

    import mtjax
    result = mtjax.train("configs/tiny.yaml", overrides=["train.steps=20"])   # a mtjax.run.RunResult

Both make the same run (`mtjax.run`: its steps, checkpoints, resume and signals). The command
prints a refusal as one line `error: ...` and exits with a status (`mtjax.cli`); the function
raises it.

One name for both. `import mtjax.train` binds the package attribute `mtjax.train` to this
module, so a function of that name in the package would be hidden once anything imported the
command. Instead this module is callable: its class is a module type whose `__call__` is
`mtjax.run.train`, and `mtjax/__init__.py` imports it on first use. `mtjax.train` is then this
one object whichever import came first, and `mtjax.train.main` is the command.
"""
from __future__ import annotations

import sys
import types

from mtjax import cli


def main(argv: list[str]) -> int:
    parser = cli.make_parser("python -m mtjax.train", "Train a GPT/Llama model on a (data, pipe, context, tensor) mesh.")
    args = parser.parse_args(argv)
    cfg, mesh = cli.setup(args)
    from mtjax.run import run
    run(cfg, mesh)
    return 0


class _TrainModule(types.ModuleType):
    """This module, callable as `mtjax.train(config, overrides=())` (see the module docstring)."""

    def __call__(self, config, overrides=()):
        """Train as `python -m mtjax.train` does; returns a `mtjax.run.RunResult` (the last
        metrics, the run directory, ...). See `mtjax.run.train`.

            result = mtjax.train("configs/tiny.yaml", overrides=["train.steps=20"])
        """
        from mtjax.run import train
        return train(config, overrides)


if __name__ == "__main__":      # run as the command (its module object is runpy's or the caller's)
    cli.run(main)
else:
    sys.modules[__name__].__class__ = _TrainModule

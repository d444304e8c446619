"""What the validation modules share: a refusal is a ConfigError naming the key (one line, exit
status 2 at the command line; the first problem found wins), and two rules that hold in every
config group.

The no-effect rule (`no_effect`): a field set away from its default that the resolved layout (or
another field) makes inert is refused, never ignored and never a warning. Examples: sequence
parallelism at parallel.tensor 1, parallel.max_in_flight, virtual stages or a schedule other than
1f1b without a pipeline, schedule=interleaved at virtual_stages 1 (1F1B's table),
parallel.tensor_depth without tensor_grid=2.5d, a 2d grid at tensor 1, the distributed optimizer
at parallel.data 1, model.rope_* fields without their scaling, train.recompute_layers without
recompute=block. A user who sets a field asked for something; a
run that silently does otherwise is worse than one line saying why it cannot.

The device rule (`devices_hint`): a mesh that does not match the devices names the count needed
and how to get it: `--cpu-devices N` on CPU, or N GPUs.
"""
from __future__ import annotations

from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config


def check(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(key, problem)


def positive(cfg: Config, keys: list[str]) -> None:
    for key in keys:
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        check(value > 0, key, f"must be positive, got {value}")


def divides(small: int, big: int, key: str, what: str) -> None:
    check(big % small == 0, key, f"{what}")


def no_effect(ok: bool, key: str, setting: str, needs: str) -> None:
    """The no-effect rule (module doc): refuse `key` at `setting` unless `ok`, saying what it needs."""
    check(ok, key, f"{setting} needs {needs}: here it would have no effect (leave it at its default)")


def spelled(value) -> str:
    """A field's value as a config file or an override writes it: true/false for a bool."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def counted(count: int, noun: str) -> str:
    """'1 device', '2 devices'."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def devices_hint(count: int, processes: int = 1) -> str:
    """How to get `count` devices, for a mesh the devices do not fit; with several processes
    (`distributed.num_processes`) each simulates its share (--cpu-devices is per process)."""
    if processes > 1:
        if count % processes:
            return f"{count} devices do not split evenly over the {processes} processes"
        return (f"use --cpu-devices {count // processes} in each of the {processes} processes to simulate "
                f"{counted(count, 'device')} on CPU, or run on {counted(count, 'GPU')}")
    return (f"use --cpu-devices {count} to simulate {counted(count, 'device')} on CPU, or run on "
            f"{counted(count, 'GPU')}")


def was_written(cfg: Config, key: str) -> bool:
    """`key` ('group.field') is in the user's YAML files or overrides (`Config.written`), or away
    from its default: the one sign there is for a Config built in Python, which has no record."""
    return key in cfg.written or key in cfg.set_keys()


def micro_batch_source(cfg: Config) -> tuple[str, str]:
    """(the field a refusal of the micro-batch b names, the words saying where b came from): with
    train.micro_batches set, b = B/(m d) is that field's doing (train.micro_batch must then agree
    or be left out, `parallel.batch_split`), so naming train.micro_batch would send the
    user to a field they cannot change alone."""
    if cfg.train.micro_batches:
        return "train.micro_batches", " (b = global_batch/(micro_batches*data))"
    return "train.micro_batch", ""

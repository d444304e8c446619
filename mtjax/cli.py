"""What every command-line entry point shares: arguments, device simulation, joining a
multi-process job, one-line errors.

Bad input (a config error, a data error, a bad argument) prints one line
`error: ...` on stderr and exits with status 2, before anything is written; a fault (a full
disk, a read-only file system, an I/O error, from whichever library) one line and status 1.
The rules for arguments are in `mtjax.cli_checks`.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable

from mtjax import cli_checks
from mtjax.config.errors import ConfigError, RunFault, describe_fault, is_fault
from mtjax.interrupts import SIGNALS, Interrupted, raise_on_signals
from mtjax.orbax_noise import quiet_orbax_echoes

EXIT_BAD_INPUT = 2
EXIT_FAULT = 1
MAX_CPU_DEVICES = 1024        # simulated devices: XLA takes minutes to start many thousands


class _StoreOnce(argparse._StoreAction):
    """A value option given twice is refused: the second would silently replace the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_options_given", set())
        if option_string is not None and self.dest in given:
            raise ConfigError(option_string, "is given twice")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """Errors are one line (ConfigError) naming the flag. The rules of `cli_checks` hold for
    every option, in subcommands and groups too (they share this registry): int and float
    options are read within int32 and finite fp32, and a value option may be given once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("type", int, cli_checks.read_int)
        self.register("type", float, cli_checks.read_float)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self.check_options: Callable | None = None   # a tool's own rules between its options, run before --print-config

    def error(self, message: str):  # one line instead of usage + message
        flag, sep, problem = message.removeprefix("argument ").partition(": ")
        if message.startswith("argument ") and sep:
            raise ConfigError(flag, problem)           # `argument --seq-len: ...` -> `--seq-len: ...`
        raise ConfigError("arguments", message)

    def parse_args(self, args=None, namespace=None):
        # overrides may come before, between or after options (scripts/launch_local.sh appends its own);
        # argparse cannot intermix with subcommands, which take no overrides
        if self._subparsers is not None:
            return super().parse_args(args, namespace)
        ns = self.parse_intermixed_args(args, namespace)
        if self.check_options is not None:
            self.check_options(ns)
        if getattr(ns, "print_config", False):       # as --help: print and exit, before any backend starts
            from mtjax.config.load import load_config, to_json, to_yaml
            from mtjax.config.validate import validate_distributed, validate_portable
            check_cpu_devices(getattr(ns, "cpu_devices", None))    # a flag no run would take is refused here too
            cfg = load_config(config_path(ns), ns.overrides)
            validate_distributed(cfg)  # as a run does first, joining the job
            validate_portable(cfg, devices_named(ns, cfg))   # files and paths are another machine's
            print((to_json if getattr(ns, "json", False) else to_yaml)(cfg), end="")
            self.exit(0)
        return ns


def devices_named(ns, cfg) -> int | None:
    """The devices a run of this command line would have, where the line says so: `--gpus N`
    (inspect's target), or `--cpu-devices N` on each of the job's processes (one, or the explicit
    `distributed.num_processes`); None otherwise, and `--print-config` checks the config's own
    mesh (data -1 counting 1): a GPU job's device count is not this machine's."""
    if getattr(ns, "gpus", None):
        return ns.gpus
    n = getattr(ns, "cpu_devices", None)
    if not n:
        return None
    from mtjax.distributed import EXPLICIT, SINGLE, choose_mode
    mode = choose_mode(cfg)
    return n * cfg.distributed.num_processes if mode == EXPLICIT else n if mode == SINGLE else None


class _Once(argparse.Action):
    """An option that may be given once (a second --config would silently replace the first)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            raise ConfigError(option_string, "is given twice")
        setattr(namespace, self.dest, values)


def make_bare_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser whose errors are one line (ConfigError), without the config options: for tools
    that take no config."""
    return _Parser(prog=prog, description=description, allow_abbrev=False)   # `--cpu-device` is not `--cpu-devices`


def make_parser(prog: str, description: str, check_options: Callable | None = None) -> argparse.ArgumentParser:
    """The config options (--config, --cpu-devices, --print-config, overrides); `check_options(ns)`
    raises a ConfigError for a combination of the tool's own options no run takes, before
    --print-config prints."""
    p = make_bare_parser(prog, description)
    p.check_options = check_options
    p.add_argument("--config", action=_Once, metavar="FILE",
                   help="YAML config file (may name a `base:` file to extend); without it, the defaults")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="simulate N CPU devices (any mesh layout on one machine)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved, checked config as YAML (as JSON with --json, where the command has it) "
                        "and exit (nothing is compiled or written)")
    p.add_argument("overrides", nargs="*", metavar="group.field=value",
                   help="dotted config overrides, applied in order after the file (train.steps=20); "
                        "`python -m mtjax.config [GROUP | GROUP.FIELD]` lists the fields, their defaults and meaning")
    return p


def setup(args):
    """(Config, mesh) after one validation pass.

    Order matters: device simulation and `jax.distributed.initialize` both
    configure the backend, so they come before the first device query (in
    validation). With several processes, `--cpu-devices N` gives each N devices.
    """
    path = config_path(args)
    start_devices(args.cpu_devices)
    import jax

    from mtjax import distributed, job_faults
    from mtjax.config import load_config, validate
    from mtjax.mesh import make_mesh
    cfg = load_config(path, args.overrides)  # reads files only: the backend is not started yet
    distributed.initialize(cfg)
    job_faults.watch_for_faults()       # another process's fault ends this one too, in one line
    d, p, t = validate(cfg, jax.device_count())
    return cfg, make_mesh(d, p, t, context=cfg.parallel.context)


def config_path(args) -> str | None:
    if args.config is not None and not args.config.strip():
        raise ConfigError("--config", "must name a file")
    return args.config


def start_devices(cpu_devices: int | None) -> None:
    """`--cpu-devices N`: ask XLA for N host devices (before anything starts JAX's backend)."""
    from mtjax.mesh import simulate_cpu_devices
    check_cpu_devices(cpu_devices)
    if cpu_devices:
        simulate_cpu_devices(cpu_devices)


def check_cpu_devices(cpu_devices: int | None) -> None:
    if cpu_devices is not None and not 1 <= cpu_devices <= MAX_CPU_DEVICES:
        raise ConfigError("--cpu-devices", f"must be in [1, {MAX_CPU_DEVICES}], got {cpu_devices}")


def run(main: Callable[[list[str]], int], argv: list[str] | None = None) -> None:
    """Call main(argv) and exit with its status (`report`). Once it has returned, a first SIGINT
    or SIGTERM is ignored: what it wrote is complete, and a signal during the interpreter's
    teardown would only replace the status and its line with a silent 128 + the signal."""
    quiet_orbax_echoes()
    status = report(main, argv)
    for sig in SIGNALS:        # (after a signal, `mtjax.interrupts` keeps its exit-at-once armed: left so)
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, signal.SIG_IGN)
    sys.exit(status)


def report(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """main(argv)'s exit status, every way it can end in one line on stderr: a ConfigError or
    DataError (bad input) status 2; a fault (RunFault: a save that failed, ...; an OSError, a
    safetensors error or an error raised from one or saying one, from any library: a full disk,
    a read-only file system, permissions, I/O) status 1; the first SIGINT/SIGTERM 128 + its number
    (see `mtjax.interrupts`); a reader of stdout that left (`| head`) no line, 128 + SIGPIPE."""
    from mtjax.data.errors import DataError
    try:
        with raise_on_signals():
            status = main(sys.argv[1:] if argv is None else argv) or 0
            sys.stdout.flush()      # here, where a reader that left is seen, not in the interpreter's exit
            return status
    except (ConfigError, DataError) as e:
        return _say(f"error: {e}", EXIT_BAD_INPUT)
    except RunFault as e:
        return _say(f"error: {e}", EXIT_FAULT)
    except Interrupted as e:
        # The `with`/`finally` blocks have run. An interrupt can leave XLA's compiler threads
        # mid-work, and tearing the interpreter down under them can crash, so leave at once.
        _say(f"error: interrupted by {e}", e.exit_status, at_once=True)
    except Exception as e:
        if isinstance(e, BrokenPipeError) and _stdout_reader_left():
            return _reader_left()
        if not is_fault(e):
            raise
        return _say(f"error: {describe_fault(e)}", EXIT_FAULT)


EXIT_READER_LEFT = 128 + signal.SIGPIPE     # what a shell reports for a Unix tool that SIGPIPE ended


def _stdout_reader_left() -> bool:
    """Whether stdout is a pipe whose reader has gone (`... | head` has read its lines): poll
    reports an error on the write end. Another broken pipe (a socket) is a fault as before."""
    import select
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _reader_left() -> int:
    """No line: the reader has what it asked for. stdout goes to /dev/null, so the interpreter's
    last flush at exit does not fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)
    return EXIT_READER_LEFT


def _say(line: str, status: int, at_once: bool = False) -> int:
    line = " ".join(line.split())              # one line, whatever the message held
    from mtjax import job_faults
    job_faults.end_job(line, status)           # printed; in a job of several processes: told the others, left
    if at_once:
        sys.stdout.flush()
        os._exit(status)
    return status

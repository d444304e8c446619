"""Every command's `--help` says what each flag does and what it is when not given, and
`python -m mtjax` lists the commands.

Each command runs in-process with `--help` (nothing is compiled, nothing is written); the
parsers it builds are caught as they parse, and each of their arguments must have a meaning, and
each flag with a default value (not None, False or "") must show it as `default: VALUE`, the
value argparse would use (so the text cannot drift from the code).
"""
import argparse
import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys

import pytest

from mtjax import generate, inspect, train
from mtjax.commands import config, convert, pipeline, preprocess

COMMANDS = [
    (train.main, []), (inspect.main, []), (generate.main, []), (config.main, []), (preprocess.main, []),
    (pipeline.main, []), (pipeline.main, ["show"]), (convert.main, ["from-hf"]), (convert.main, ["to-hf"]),
]


def test_convert_help_points_to_its_commands_flags(capsys):
    with pytest.raises(SystemExit) as e:
        convert.main(["--help"])
    assert e.value.code == 0 and "from-hf --help" in capsys.readouterr().out


def parsers_of(main, argv: list[str]) -> tuple[list[argparse.ArgumentParser], str]:
    """The parsers `main(argv + ['--help'])` parses with, and what it printed."""
    seen, parse = [], argparse.ArgumentParser.parse_known_args

    def recorded(self, *args, **kwargs):
        seen.append(self)
        return parse(self, *args, **kwargs)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(argparse.ArgumentParser, "parse_known_args", recorded)
        try:
            status = main([*argv, "--help"])
        except SystemExit as e:
            status = e.code
    assert status == 0, (argv, status)
    return seen, out.getvalue()


def shows_a_default(action: argparse.Action) -> bool:
    default = action.default
    return not (default is None or default is False or default == "" or default is argparse.SUPPRESS)


@pytest.mark.parametrize("main,argv", COMMANDS, ids=lambda x: getattr(x, "__module__", None) or " ".join(x))
def test_every_flag_has_a_meaning_and_shows_its_default(main, argv):
    seen, out = parsers_of(main, argv)
    assert seen and out.startswith("usage: "), out
    for parser in seen:
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert (action.help or "").strip(), f"{parser.prog} {name}: no help text"
            if action.option_strings and shows_a_default(action):
                text = formatter._expand_help(action)
                assert f"default: {action.default}" in text, f"{parser.prog} {name}: default {action.default!r} " \
                                                             f"not in its help: {text!r}"


def test_python_m_mtjax_lists_the_commands_of_the_readme():
    """`python -m mtjax` (a subprocess: its `__main__` runs) lists every command README.md's
    Commands block shows, each a module that exists; it imports no JAX."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import runpy, sys; runpy.run_module('mtjax', run_name='__main__')"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": root}, check=False)
    listed = re.findall(r"^  (mtjax[\w.]*) ", done.stdout, re.M)
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read().split("## Commands", 1)[1]
    shown = re.findall(r"python -m (mtjax[\w.]*)", readme.split("```")[1])
    assert done.returncode == 0 and listed and sorted(listed) == sorted(set(shown)), (done.stdout, shown)
    assert all(importlib.util.find_spec(m) for m in listed)
    assert not re.search(r"\|\s+jax$", done.stderr, re.M), "python -m mtjax imported JAX"


@pytest.mark.parametrize("word,line", [
    ("train", "error: train: run it as python -m mtjax.train ...\n"),
    ("preprocess", "error: preprocess: run it as python -m mtjax.data.preprocess ...\n"),
    ("trian", "error: trian: not a command; python -m mtjax lists them\n"),
])
def test_a_command_named_after_python_m_mtjax_points_to_its_module(capsys, word, line):
    from mtjax.__main__ import main
    assert main([word, "--config", "x.yaml"]) == 2
    assert capsys.readouterr().err == line


def test_a_command_without_its_subcommand_names_the_subcommands(capsys):
    """`python -m mtjax.pipeline` alone names what it wants ({show}), not argparse's dest."""
    assert pipeline.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "{show}" in err and "command" not in err.split(":", 2)[2]

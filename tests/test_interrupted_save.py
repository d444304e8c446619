"""A signal while orbax writes a checkpoint ends in one line (issue 33, item 8).

Orbax starts a save by running an asyncio event loop in the main thread. A first SIGTERM that
raised `Interrupted` inside that loop closed it while tensorstore's writer threads still
reported to it, and each printed `RuntimeError: Event loop is closed` (hundreds of lines) before
the command's one line. `interrupts.deferred` holds the signal until orbax's call returns.

The signal is sent from inside that loop, once the writes have started, by wrapping the
coroutine orbax's save runs. How many writes are in flight then is a race (without the deferral
most tries printed 100 to 270 lines, some one), so the test also checks the cause: the signal
does not raise inside the loop (the wrapper goes on past `os.kill`), it is raised after it.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "hf" / "llama_plain"

INJECT = """
import asyncio, os, runpy, signal, sys, threading
from orbax.checkpoint._src.checkpointers import async_checkpointer as ac

real_run_sync = ac.asyncio_utils.run_sync


class SignalInsideTheSave:
    '''orbax's asyncio_utils, but SIGTERM arrives while the save's loop runs in the main thread.'''

    def __getattr__(self, name):
        return getattr(utils, name)

    @staticmethod
    def run_sync(coro):
        if threading.current_thread() is not threading.main_thread() or "_save" not in coro.__qualname__:
            return real_run_sync(coro)

        async def signalled():
            task = asyncio.ensure_future(coro)
            await asyncio.sleep(0.002)            # the writes have started
            os.kill(os.getpid(), signal.SIGTERM)     # raised here (in the loop) unless held
            open("held", "w").close()
            return await task
        return real_run_sync(signalled())


utils, ac.asyncio_utils = ac.asyncio_utils, SignalInsideTheSave()
sys.argv = ["mtjax.convert"] + sys.argv[1:]
runpy.run_module("mtjax.convert", run_name="__main__")
"""


def test_sigterm_inside_orbax_save_is_one_line_and_leaves_nothing(tmp_path):
    from orbax.checkpoint._src.checkpointers import async_checkpointer
    if not hasattr(getattr(async_checkpointer, "asyncio_utils", None), "run_sync"):
        pytest.skip("this orbax starts a save differently; the injection point is gone")
    (tmp_path / "inject.py").write_text(INJECT, encoding="utf-8")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, str(tmp_path / "inject.py"), "from-hf", "--hf-dir", str(FIXTURE),
                        "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 128 + 15, r.stderr
    assert r.stderr.strip() == "error: interrupted by SIGTERM", r.stderr
    assert (tmp_path / "held").exists(), "the signal raised inside orbax's event loop"
    assert sorted(os.listdir(tmp_path)) == ["held", "inject.py"]      # the staged output is removed

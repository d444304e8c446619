"""The notebooks run top to bottom and draw; `python -m mtjax.pipeline show --plot` draws too.

Each notebook runs in a fresh kernel (nbclient, the `python3` kernel: this Python's ipykernel),
from notebooks/, as `scripts/run_notebooks.py` runs it. A cell error fails the test, and so does
a notebook without an image among its outputs. The committed outputs must hold the pictures, but are
not compared with a new run: they are what `scripts/run_notebooks.py` last saved.
"""
import pathlib
import subprocess
import sys

import nbformat
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient

from mtjax.commands.pipeline import main as pipeline_main

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {"quickstart", "pipeline_schedules", "tensor_parallel", "memory", "finetune_and_generate"}
PNG = b"\x89PNG\r\n\x1a\n"


def images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
               for out in cell.get("outputs", []))


def test_every_notebook_is_here():
    assert {p.stem for p in NOTEBOOKS} == EXPECTED


def test_committed_with_their_pictures():
    """The notebooks read on the web without running: each is saved with its outputs, plots included
    (`python scripts/run_notebooks.py`)."""
    for path in NOTEBOOKS:
        assert images(nbformat.read(path, as_version=4)) >= 1, f"{path.name}: run scripts/run_notebooks.py and commit it"


def test_the_kernel_is_this_python():
    """The `python3` kernel nbclient starts is the Python running the tests (CI's virtual
    environment), whatever `python` is on PATH."""
    assert KernelManager(kernel_name="python3").format_kernel_cmd()[0] == sys.executable


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_draws(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:                       # what was saved must not count
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [out for cell in nb.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors
    assert images(nb) >= 1, f"{path.name} drew nothing"


SHOW = ["show", "--schedule", "zbv", "--stages", "4", "--micro-batches", "8"]


def test_show_plot_writes_a_png_and_prints_the_same(tmp_path, capsys):
    assert pipeline_main(SHOW) == 0
    text = capsys.readouterr().out
    assert pipeline_main(SHOW + ["--plot", str(tmp_path / "zbv.png")]) == 0
    assert capsys.readouterr().out == text
    assert (tmp_path / "zbv.png").read_bytes().startswith(PNG)


@pytest.mark.parametrize("where,message", [
    ("missing/zbv.png", "output directory does not exist"),
    ("zbv.txt", "give a file ending in .png, .svg, .pdf"),
    (".", "give a file ending in"),
    ("dir.png", "is a directory"),
])
def test_show_plot_refuses_a_bad_path(tmp_path, capsys, where, message):
    (tmp_path / "dir.png").mkdir()
    assert pipeline_main(SHOW + ["--plot", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --plot: ") and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.png"]


def test_show_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # `import matplotlib` raises ImportError
    assert pipeline_main(SHOW + ["--plot", str(tmp_path / "zbv.png")]) == 2
    err = capsys.readouterr().err
    assert err == "error: --plot: needs matplotlib: pip install 'mtjax[notebooks]'\n"
    assert not any(tmp_path.iterdir())


def test_the_package_does_not_import_matplotlib():
    code = ("import sys, mtjax, mtjax.plots, mtjax.pipeline.__main__, mtjax.inspect; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)

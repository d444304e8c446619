"""Re-execute the notebooks top to bottom and save them in place, with their outputs (plots included).

    python scripts/run_notebooks.py                       # every notebooks/*.ipynb
    python scripts/run_notebooks.py notebooks/memory.ipynb

Run it whenever a change alters what they show, and commit the result: the notebooks are kept
with their outputs so that they read on the web without running. Each runs in a fresh kernel
(`python3`, this Python's ipykernel) from the notebooks/ directory; the first cell error stops
it and nothing is saved for that notebook. Needs the `notebooks` extra
(`pip install -e '.[notebooks]'`).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
TIMEOUT_S = 600        # per cell


def execute(path: pathlib.Path):
    """The notebook at `path`, executed in a fresh kernel (nbclient raises CellExecutionError on
    the first failing cell)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def images(nb) -> int:
    """How many image/png outputs the notebook's cells hold."""
    return sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
               for out in cell.get("outputs", []))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: every notebooks/*.ipynb")
    paths = parser.parse_args(argv).notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    import nbformat
    for path in paths:
        start = time.perf_counter()
        nb = execute(path)
        nbformat.write(nb, path)
        print(f"{path}: {time.perf_counter() - start:.0f} s, {images(nb)} images", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

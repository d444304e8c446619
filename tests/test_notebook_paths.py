"""Committed notebooks hold no path of the machine that ran them: their text outputs (streams,
plain text, HTML, tracebacks) must not name an absolute directory such as /work/..., /tmp/...,
/home/... or this checkout's own path. Reads the JSON only; runs nothing."""
import json
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# an absolute path under a directory where machines keep checkouts, homes and temporary files
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|tmp|home|root|Users|var|private|mnt|opt|srv|scratch|data|nfs|"
                          r"lustre|gpfs|usr/local|content)/[\w.~-]", re.IGNORECASE)
TEXT_KINDS = ("text/plain", "text/html", "text/markdown", "text/latex", "application/json")


def output_texts(nb: dict):
    """(cell index, text) of every text an output holds (images are base64: not text)."""
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            parts = [out.get("text", "")] + out.get("traceback", [])
            parts += [out.get("data", {}).get(kind, "") for kind in TEXT_KINDS]
            for part in parts:
                yield i, part if isinstance(part, str) else "".join(map(str, part)) if isinstance(part, list) \
                    else json.dumps(part)


def machine_paths(text: str) -> list[str]:
    found = [m.group(0) for m in MACHINE_PATH.finditer(text)]
    for own in {str(ROOT), os.path.expanduser("~")} - {"/", ""}:
        found += [own] * text.count(own)
    return found


def test_the_pattern_finds_machine_paths():
    assert machine_paths("working in /work/main\n")
    assert machine_paths("saved to /tmp/mtjax_x/run and /home/me/x")
    assert machine_paths(f"at {ROOT}/notebooks")
    assert not machine_paths("runs/tiny, WORK/hf, s/t = 2, 1/sqrt(2l), http://example.org/tmp/x")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_outputs_hold_no_machine_path(path):
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    bad = [(i, p) for i, text in output_texts(nb) for p in machine_paths(text)]
    assert not bad, (f"{path.name}: outputs name machine paths {bad[:5]} (cell index, path); print paths "
                     "relative to the repository or to a named temporary directory, then scrub the outputs")

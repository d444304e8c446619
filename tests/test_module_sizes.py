"""Small files, small functions: no module under mtjax/ over MAX_FILE_LINES lines and no function
over MAX_FUNCTION_LINES, unless docs/design.md names it, with its reason, under "Size exceptions".

A function's length is its lines from `def` to its last line, its docstring included; nested
functions count in the function that holds them. Reads the source only: no import, no JAX.
"""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 60


def oversized() -> dict[str, str]:
    """{'path' or 'path:function': what is too long} over every module of the package."""
    found = {}
    for path in sorted((REPO / "mtjax").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found[rel] = f"{lines} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.setdefault(f"{rel}:{node.name}", f"{length} lines")
    return found


def documented_exceptions() -> set[str]:
    """The names listed (`path` or `path:function`, in backticks, one bullet each) in the
    "Size exceptions" section of docs/design.md, each followed by its reason."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    match = re.search(r"^## Size exceptions\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if match is None:
        return set()
    return {m.group(1) for m in re.finditer(r"^- `([^`]+)`: \S", match.group(1), re.M)}


def test_no_module_or_function_is_too_long_unless_justified():
    found, allowed = oversized(), documented_exceptions()
    unjustified = {name: size for name, size in found.items() if name not in allowed}
    assert not unjustified, ("over the size limits (split by concern, or justify under \"Size exceptions\" in "
                             f"docs/design.md): {unjustified}")
    assert allowed <= set(found), f"exceptions in docs/design.md that no longer apply: {sorted(allowed - set(found))}"

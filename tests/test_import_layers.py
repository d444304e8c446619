"""The import graph of `mtjax`, read from its source with `ast` (module-level and function-level
imports alike, nothing imported): no loop between modules, and no import from a lower layer up to
a higher one, with the layers as docs/design.md draws them ("Layers of the system", parsed here)."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mtjax"
DESIGN = ROOT / "docs" / "design.md"
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")     # what layer 0 (plain numpy) never imports


def module_files() -> dict[str, pathlib.Path]:
    """Every module's dotted name -> its file (a package by its __init__.py)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = module_files()


def _module_of(name: str) -> str | None:
    """The longest prefix of `name` that is a module of the package (None for outside imports)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str) -> set[str]:
    """The package's modules that `module` imports, anywhere in its file. `from pkg import name`
    counts pkg.name when that is a module, else pkg (its __init__). A package's __init__ that runs
    only because one of its modules is imported is not counted (the rule for __init__ covers it)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out |= {m for m in map(_module_of, names) if m is not None and m != module}
    out.discard("mtjax")   # the root package runs before any of its modules; it imports nothing eagerly
    return out


def heavy_imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    return {name for name in names if name.split(".")[0] in HEAVY}


def design_tables() -> tuple[list[tuple[int, str, list[str]]], list[str]]:
    """([(layer, name, module prefixes)], shims) from the two tables of the section."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("## Layers of the system", 1)[1].split("\n## ", 1)[0]
    layers, shims = [], []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            layers.append((int(cells[0]), cells[1], re.findall(r"`(mtjax[\w.]*)`", cells[2])))
        elif len(cells) == 2 and cells[0].startswith("`mtjax."):
            shims.append(cells[0].strip("`"))
    return layers, shims


LAYERS, SHIMS = design_tables()


def layer_of(module: str) -> int | None:
    """The layer of the row whose longest prefix names `module`; for a package's __init__, the
    lowest of its own and its modules' (importing any of them runs it). The root package is the
    exception: it is the public API, and imports only inside its functions
    (`test_the_root_package_imports_lazily`)."""
    best = max(((len(p), n) for n, _, prefixes in LAYERS for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    if best is None:
        return None
    if MODULES.get(module, pathlib.Path()).name == "__init__.py" and module != "mtjax":
        inner = [layer_of(m) for m in MODULES if m.startswith(module + ".") and m not in SHIMS]
        return min([best[1], *[n for n in inner if n is not None]])
    return best[1]


LIBRARY = sorted(m for m in MODULES if m not in SHIMS)
GRAPH = {m: imports(m) for m in MODULES}


def test_the_design_tables_parse():
    assert [n for n, _, _ in LAYERS] == list(range(len(LAYERS))) and len(LAYERS) >= 10, LAYERS
    assert "mtjax.pipeline.__main__" in SHIMS and "mtjax.config.__main__" in SHIMS, SHIMS
    assert LAYERS[-1][1] == "commands"


def test_every_module_has_a_layer():
    missing = [m for m in LIBRARY if layer_of(m) is None]
    assert not missing, f"place these in docs/design.md's layer table: {missing}"


def test_no_import_runs_up_the_layers():
    up = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
          for a in LIBRARY for b in sorted(GRAPH[a]) if b not in SHIMS and layer_of(b) > layer_of(a)]
    assert not up, "\n".join(up)


def test_nothing_imports_an_entry_shim():
    assert not [(a, b) for a in MODULES for b in GRAPH[a] if b in SHIMS]


def test_shims_only_forward_to_the_commands():
    """A shim imports nothing of mtjax: it runs its command module by name (`runpy`), so the
    package it stands in does not depend on the command layer."""
    for shim in SHIMS:
        if shim in MODULES:
            assert not GRAPH[shim], shim
            target = re.findall(r'runpy\.run_module\("(mtjax\.commands\.\w+)"', MODULES[shim].read_text(encoding="utf-8"))
            assert len(target) == 1 and target[0] in MODULES, (shim, target)


def test_no_module_loop():
    """Depth-first search for a cycle among the library's modules (shims excluded)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if n in SHIMS:
                continue
            if state.get(n) == "open":
                pytest.fail("module loop: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in LIBRARY:
        if m not in state:
            visit(m)


def test_layer_zero_is_plain_numpy():
    zero = [m for m in LIBRARY if layer_of(m) == 0]
    assert "mtjax.pipeline.schedules" in zero and "mtjax.parallel.grid_shape" in zero, zero
    assert not {m: heavy_imports(m) for m in zero if heavy_imports(m)}


def test_no_library_module_imports_a_command_line_helper():
    helpers = {m for m in MODULES if m in ("mtjax.cli", "mtjax.cli_checks", "mtjax.plots")
               or m.startswith("mtjax.commands")}
    top = LAYERS[-1][0]
    bad = [(a, sorted(GRAPH[a] & helpers)) for a in LIBRARY if layer_of(a) < top and GRAPH[a] & helpers]
    assert not bad, bad


def test_the_root_package_imports_lazily():
    """`import mtjax.<anything>` runs mtjax/__init__.py first: at module level it imports nothing of mtjax."""
    tree = ast.parse(MODULES["mtjax"].read_text(encoding="utf-8"))
    eager = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
             and ((n.module or "") if isinstance(n, ast.ImportFrom) else n.names[0].name).startswith("mtjax")]
    assert not eager, [ast.unparse(n) for n in eager]

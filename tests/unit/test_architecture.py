"""The layout rules of the house style, checked on the source: imports flow ops → workers → app,
no import cycles among modules, no module holding a third of the code, a docstring on each."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "workers", "ops")
LAYER = {"app": 0, "workers": 1, "ops": 2}


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Project modules imported anywhere in the file (function-level imports count too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, known) - {name} for name, path in mods.items()}


def test_imports_only_point_down_the_layers() -> None:
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in graph().items()
        for dep in deps
        if LAYER[dep.split(".")[0]] > LAYER[mod.split(".")[0]]
    ]
    assert wrong == []


def test_no_import_cycles() -> None:
    g = graph()
    # a package's __init__ importing its own submodules is not a cycle of logic
    for mod in g:
        g[mod] = {
            d
            for d in g[mod]
            if not (d.startswith(mod + ".") and (ROOT / mod.replace(".", "/")).is_dir())
        }
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g[node]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_no_module_holds_a_third_of_the_code() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    total = sum(sizes.values())
    assert max(sizes.values()) < total / 3, max(sizes.items(), key=lambda kv: kv[1])


def test_every_module_opens_with_a_docstring() -> None:
    missing = [
        name
        for name, path in modules().items()
        if path.read_text().strip() and ast.get_docstring(ast.parse(path.read_text())) is None
    ]
    assert missing == []


def test_only_settings_reads_the_environment() -> None:
    readers = [
        name
        for name, path in modules().items()
        if name != "app.core.settings"
        and ("os.environ" in path.read_text() or "os.getenv" in path.read_text())
    ]
    assert readers == []

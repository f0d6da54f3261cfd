"""docs/layout.md, the module map the README sends a newcomer to, checked against the tree: every
Python module of app/, workers/, ops/, emulator/ and bench/ is named there, and every path it names
exists.

A path is a backticked name with a `/` under one of the repository's top-level entries, or a bare
`name.py` inside a table row whose first cell is a folder (`app/ledger/`): the name is that
folder's. A module is named when its path is, or when its folder's row names its file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "layout.md"
MAPPED = ("app", "workers", "ops", "emulator", "bench")
DATA = ROOT / "emulator" / "data"
CODE = re.compile(r"`([^`\s]+)`")


def named_paths(text: str) -> dict[str, int]:
    """Every path the map names (relative to the repository root) and the line it is on."""
    tops = {entry.name for entry in ROOT.iterdir()}
    found: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if "|" in line else []
        first = CODE.findall(cells[0]) if cells else []
        folder = first[0] if len(first) == 1 and first[0].endswith("/") else ""
        for token in CODE.findall(line):
            if "/" in token and token.split("/")[0] in tops:
                found.setdefault(token, number)
            elif folder and token.endswith(".py") and "/" not in token:
                found.setdefault(folder + token, number)
    return found


def tree_modules() -> list[str]:
    """The Python modules the map must name: package markers (`__init__.py`) are their folder's,
    and emulator/data/ holds the demo's data (tokenizer code among it), not modules."""
    return sorted(
        path.relative_to(ROOT).as_posix()
        for top in MAPPED
        for path in (ROOT / top).rglob("*.py")
        if path.name != "__init__.py" and DATA not in path.parents
    )


def missing_modules(named: dict[str, int], modules: list[str]) -> list[str]:
    return [module for module in modules if module not in named]


def gone_paths(named: dict[str, int]) -> list[str]:
    return [
        f"docs/layout.md:{line} names `{path}`, which does not exist"
        for path, line in sorted(named.items(), key=lambda kv: kv[1])
        if not (ROOT / path).exists()
    ]


def test_every_module_is_named_in_the_map() -> None:
    missing = missing_modules(named_paths(MAP.read_text()), tree_modules())
    assert not missing, "modules docs/layout.md does not name (add each to its folder's row):\n" + (
        "\n".join(missing)
    )


def test_every_path_the_map_names_exists() -> None:
    gone = gone_paths(named_paths(MAP.read_text()))
    assert not gone, "\n".join(gone)


def test_the_map_check_resolves_bare_names_in_a_folders_row() -> None:
    text = "| `app/ledger/` | queries: `claims.py` (claims), `nowhere.py` |\n| x | `ops/cli.py` |"
    named = named_paths(text)
    assert named == {
        "app/ledger/": 1,
        "app/ledger/claims.py": 1,
        "app/ledger/nowhere.py": 1,
        "ops/cli.py": 2,
    }
    assert gone_paths(named) == [
        "docs/layout.md:1 names `app/ledger/nowhere.py`, which does not exist"
    ]
    assert missing_modules(named, ["app/ledger/claims.py", "app/ledger/queue.py"]) == [
        "app/ledger/queue.py"
    ]

"""app.ledger imports what it re-exports on first use: the names it declares for type checkers
are exactly the ones it resolves, each from the module it names."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import app.ledger as ledger

INIT = Path(ledger.__file__)


def declared() -> dict[str, str]:
    """name -> module of the `if TYPE_CHECKING:` re-exports."""
    tree = ast.parse(INIT.read_text(encoding="utf-8"))
    (block,) = [n for n in tree.body if isinstance(n, ast.If)]
    found: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names:
            assert alias.asname == alias.name, "re-exported as itself"
            found[alias.name] = node.module
    return found


def test_the_lazy_exports_are_the_declared_ones() -> None:
    assert declared() == ledger._EXPORTS


def test_each_name_resolves_to_its_modules() -> None:
    for name, module in ledger._EXPORTS.items():
        if module == ledger.__name__:  # a submodule of the package, e.g. counters
            expected = importlib.import_module(f"{module}.{name}")
        else:
            expected = getattr(importlib.import_module(module), name)
        assert getattr(ledger, name) is expected, name


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        ledger.no_such_query  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "no_such_query" in str(exc)
    else:
        raise AssertionError("an unknown name resolved")

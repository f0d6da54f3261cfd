"""CLI start-up: loading the `tokenmill` group, or asking a command for --help, imports none
of the heavy libraries; each command imports them when it runs (checked in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.ledger.migrate import declared_head, head_revision

ROOT = Path(__file__).resolve().parents[2]
# what start-up must not load: each costs tens to hundreds of milliseconds
HEAVY = (
    "pyarrow",
    "alembic",
    "httpx",
    "rich",
    "transformers",
    "celery",
    "kombu",
    "sqlalchemy",
    "pydantic",
    "numpy",
    "fsspec",
    "prometheus_client",
    "matplotlib",
)


def loaded_after(code: str) -> list[str]:
    """The HEAVY modules imported by running code in a fresh interpreter."""
    script = textwrap.dedent(code) + textwrap.dedent(
        f"""
        import json, sys
        print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_loads_no_heavy_library() -> None:
    assert loaded_after("import ops.cli") == []


@pytest.mark.parametrize("args", [["--help"], ["status", "--help"], ["servers", "--help"]])
def test_help_loads_no_heavy_library(args: list[str]) -> None:
    code = f"""
        import contextlib, io
        from ops.cli import cli
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                cli({args!r}, prog_name="tokenmill")
            except SystemExit as exc:
                assert exc.code == 0, exc.code
        assert "Usage: tokenmill" in out.getvalue(), out.getvalue()
    """
    assert loaded_after(code) == []


def test_a_command_still_loads_what_it_needs() -> None:
    """The check above can fail: running `config` loads pydantic (the settings)."""
    code = """
        import contextlib, io
        from ops.cli import cli
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                cli(["config"], prog_name="tokenmill")
            except SystemExit as exc:
                assert exc.code == 0, exc.code
    """
    assert "pydantic" in loaded_after(code)


def test_the_declared_head_is_alembics_head() -> None:
    """The quick schema check reads the head from the migration scripts' source; it must be
    the revision alembic computes, or None (then alembic decides)."""
    assert declared_head() in (head_revision(), None)
    assert declared_head() is not None  # the scripts are plain enough to be read

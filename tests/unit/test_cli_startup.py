"""CLI start-up: loading the `tokenmill` group, or asking a command for --help, imports none
of the heavy libraries; each command imports them when it runs (checked in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.ledger import migrate

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
    assert migrate.declared_head() in (migrate.head_revision(), None)
    assert migrate.declared_head() is not None  # the scripts are plain enough to be read


def test_a_command_loads_only_its_own_module(tmp_path: Path) -> None:
    """`tokenmill status` on a ledger that exists: its own command module, SQLAlchemy Core and
    the settings; not the other commands, the ORM, rich, alembic or the tokenizer code."""
    status = f"""
        import contextlib, io, os, sys
        os.environ["TOKENMILL_DATA_DIR"] = {str(tmp_path)!r}
        from ops.cli import cli
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                cli(["status"], prog_name="tokenmill")
            except SystemExit as exc:
                assert exc.code == 0, exc.code
    """
    assert "alembic" in loaded_after(status)  # the first one creates the ledger
    check = """
        others = [m for m in ("ops.demo_cmd", "ops.pipeline_cmd", "ops.views.report_page",
                              "ops.fleet_cmd", "app.prompts.chat_path", "app.prompts.tokenization",
                              "app.ledger.outcomes", "sqlalchemy.orm") if m in sys.modules]
        assert others == [], others
    """
    assert loaded_after(status + check) == ["pydantic", "sqlalchemy"]

"""`tokenmill --log-format json` (or TOKENMILL_LOG_FORMAT=json) through the real CLI: stderr
holds only JSON log lines, stdout the `--json` output (the worker's side: test_flower.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.procs import clean_env, tokenmill

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("args", "settings"),
    [(["--log-format", "json"], {}), ([], {"TOKENMILL_LOG_FORMAT": "json"})],
    ids=["option", "setting"],
)
def test_status_logs_json_lines_only(
    tmp_path: Path, args: list[str], settings: dict[str, str]
) -> None:
    env = clean_env(tmp_path / "data", **settings)
    # `--json`: the table of plain `status` is human output on stderr (the rich console)
    result = tokenmill([*args, "--log-level", "INFO", "status", "--json"], env, timeout_s=60)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, "the embedded ledger's first use logs its upgrade at INFO"
    entries = [json.loads(line) for line in lines]
    assert all({"ts", "level", "logger", "message"} <= e.keys() for e in entries)
    assert any(e["logger"] == "app.ledger.migrate" and e["level"] == "INFO" for e in entries)
    assert json.loads(result.stdout) == []  # a fresh ledger: no runs


def test_text_is_the_default(tmp_path: Path) -> None:
    result = tokenmill(["--log-level", "INFO", "status"], clean_env(tmp_path / "data"))
    assert result.returncode == 0, result.stderr
    assert " INFO app.ledger.migrate: " in result.stderr

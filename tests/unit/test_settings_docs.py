"""The settings table of docs/configuration.md is the settings: every field of
app.core.settings.Settings has its row, every row names real settings, and a number the table
gives as a default is the field's default."""

from __future__ import annotations

import re
from pathlib import Path

from app.core.settings import Settings

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def settings_rows() -> list[tuple[list[str], str]]:
    """(variables, default cell) of each row of docs/configuration.md's settings table."""
    section = CONFIGURATION.read_text(encoding="utf-8")
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`(TOKENMILL_[A-Z0-9_]+)`", cells[0]) if len(cells) >= 3 else []
        if names:
            rows.append((names, cells[1]))
    return rows


def test_every_setting_has_a_row_and_every_row_is_a_setting() -> None:
    documented = [name for names, _ in settings_rows() for name in names]
    fields = {f"TOKENMILL_{name.upper()}" for name in Settings.model_fields}
    assert sorted(fields - set(documented)) == [], "settings missing from the table"
    assert sorted(set(documented) - fields) == [], "rows naming no setting"
    assert len(documented) == len(set(documented)), "a setting with two rows"


def test_the_numbers_the_table_gives_are_the_defaults() -> None:
    checked = 0
    for names, cell in settings_rows():
        values = [v.strip() for v in cell.split(" / ")]
        if len(values) != len(names) or not all(re.fullmatch(r"\d+(\.\d+)?", v) for v in values):
            continue  # a default said in words ("unset", "a folder in the data dir", ...)
        for name, value in zip(names, values, strict=True):
            default = Settings.model_fields[name.removeprefix("TOKENMILL_").lower()].default
            assert float(value) == float(default), f"{name}: the table says {value}"
            checked += 1
    assert checked >= 30  # most defaults are numbers

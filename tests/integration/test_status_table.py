"""`tokenmill status` as an operator reads it in an 80-column terminal or a pipe: run names and
numbers are never cut and no column is dropped (a table too wide for 80 columns is printed
wider), and the waiting column appears only when a run has later turns."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import update

from app.ledger import items
from app.ledger.database import make_engine
from app.ledger.migrate import upgrade
from tests.support.procs import clean_env, tokenmill
from tests.support.runs import add_item, make_run

LONG_RUN = "kimi-k25-regen-2026-11-30-shard-07"


def status_lines(data_dir: Path) -> list[str]:
    result = tokenmill(["status"], clean_env(data_dir, COLUMNS="80"))
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_names_and_numbers_are_whole_and_waiting_shows_only_when_used(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    upgrade(engine)
    with engine.begin() as conn:
        run = make_run(conn, LONG_RUN)
        for i in range(12):
            add_item(conn, run.id, f"k{i}", completion_tokens=1_234_567)
        add_item(conn, run.id, "p", status="pending")
    lines = status_lines(tmp_path)
    header = " ".join(" ".join(lines[: lines.index(next(x for x in lines if "───" in x))]).split())
    for name in ("run", "total", "pend", "queued", "leased", "done", "failed", "trunc", "tokens"):
        assert name in header.split(), f"column {name} missing from {header!r}"
    row = next(line for line in lines if LONG_RUN in line)
    assert row.split() == [LONG_RUN, "13", "1", "0", "0", "12", "0", "0", str(12 * 1_234_567)]
    assert "wait" not in "".join(lines)

    with engine.begin() as conn:
        conn.execute(update(items).where(items.c.item_key == "p").values(status="waiting"))
    lines = status_lines(tmp_path)
    assert "wait" in "".join(lines)
    row = next(line for line in lines if LONG_RUN in line)
    assert row.split() == [LONG_RUN, "13", "1", "0", "0", "0", "12", "0", "0", "14814804"]

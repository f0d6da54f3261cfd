"""The report's named queries on SQLite and real Postgres, with exact numbers, and a whole
report built from each database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine

from app.ledger import dashboard_queries as dq
from app.ledger import run_queries
from ops.views.report_page import build_report
from tests.support.runs import add_event, add_item, make_run, seed_report_run

T = datetime(2031, 5, 4, 12, 0, 0, tzinfo=UTC)
TOO_LONG = "HTTP 400: too long " + "x" * 300


def at(seconds: float) -> datetime:
    return T + timedelta(seconds=seconds)


def seed(db: Engine) -> None:
    with db.begin() as conn:
        run = make_run(conn, "r")
        add_item(
            conn,
            run.id,
            "d1",
            completion_tokens=100,
            latency_s=1.5,
            started_at=at(0),
            finished_at=at(10),
        )
        add_item(
            conn,
            run.id,
            "d2",
            server="gpu-b",
            prompt_tokens=30,
            completion_tokens=512,
            finish_reason="length",
            latency_s=9.0,
            started_at=at(5),
            finished_at=at(20),
        )
        add_item(
            conn,
            run.id,
            "f1",
            status="failed",
            server="gpu-b",
            prompt_tokens=50,
            finished_at=at(25),
            error=TOO_LONG,
        )
        add_item(conn, run.id, "f2", status="failed", finished_at=at(26), error=TOO_LONG)
        add_item(conn, run.id, "f3", status="failed", finished_at=at(27), error="timeout")
        add_item(conn, run.id, "f4", status="failed", finished_at=at(28), error=None)
        add_item(conn, run.id, "p1", status="pending")
        add_item(conn, run.id, "l1", status="leased", started_at=at(29))
        other = make_run(conn, "other")
        add_item(conn, other.id, "o1", completion_tokens=7, finished_at=at(1), latency_s=0.1)
        for kind, server, seconds in (
            ("paused", "gpu-a", -100),
            ("resumed", "gpu-a", -90),
            ("paused", "gpu-b", -50),
            ("state", "gpu-b", -40),
            ("resumed", "gpu-b", 15),
            ("paused", "gpu-a", 20),
            ("paused", "gpu-a", 200),
            ("paused", None, 30),
        ):
            add_event(conn, kind, server, at(seconds))


def test_item_stats_stream_in_pages_without_token_arrays(db: Engine) -> None:
    seed(db)
    with db.connect() as conn:
        run = run_queries.get_run(conn, "r")
        stream = list(dq.iter_item_stats(conn, run.id, page_size=2))
        pending = list(dq.iter_item_stats(conn, run.id, statuses=("pending", "leased")))
    assert [s.id for s in stream] == [1, 2, 3, 4, 5, 6]
    assert stream[0] == dq.ItemStats(
        id=1,
        status="done",
        server="gpu-a",
        finish_reason="stop",
        prompt_tokens=10,
        completion_tokens=100,
        latency_s=1.5,
        started_at=at(0),
        finished_at=at(10),
    )
    assert (stream[2].status, stream[2].completion_tokens, stream[2].finished_at) == (
        "failed",
        None,
        at(25),
    )
    assert [s.id for s in pending] == [7, 8]


def test_ranges_and_failure_reasons(db: Engine) -> None:
    seed(db)
    with db.connect() as conn:
        run = run_queries.get_run(conn, "r")
        ranges = dq.item_ranges(conn, run.id)
        reasons = dq.failure_reasons(conn, run.id, chars=20)
        nothing = dq.item_ranges(conn, 999)
    assert ranges == dq.ItemRanges(
        first_started_at=at(0),
        first_finished_at=at(10),
        last_finished_at=at(28),
        min_latency_s=1.5,
        max_latency_s=9.0,
        max_completion_tokens=512,
    )
    assert reasons == [("HTTP 400: too long x", 2), ("(no error recorded)", 1), ("timeout", 1)]
    assert nothing == dq.ItemRanges(None, None, None, None, None, None)


def test_server_events_include_the_state_before_the_window(db: Engine) -> None:
    seed(db)
    with db.connect() as conn:
        found = dq.server_events(conn, kinds=("paused", "resumed"), since=at(0), until=at(100))
    assert [(e.kind, e.server, e.at) for e in found] == [
        ("resumed", "gpu-a", at(-90)),
        ("paused", "gpu-b", at(-50)),
        ("resumed", "gpu-b", at(15)),
        ("paused", "gpu-a", at(20)),
    ]


def test_build_report_from_each_database(db: Engine, tmp_path: Path) -> None:
    with db.begin() as conn:
        seed_report_run(conn, T, items_per_server=40)
        add_event(conn, "paused", "gpu-idle", T)  # a server that never served the run
    result = build_report(db, "rep", tmp_path / "out")
    assert result.items == 80 and result.index == tmp_path / "out" / "index.html"
    for image in result.images:
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = result.index.read_text()
    assert "<h1>Run rep</h1>" in page and page.count("<img ") == 5
    assert "<td>gpu-b</td><td>2031-05-04 12:08:00</td><td>2031-05-04 12:12:00</td>" in page
    assert "gpu-idle" not in page


def test_a_run_with_nothing_finished_still_gets_a_page(db: Engine, tmp_path: Path) -> None:
    with db.begin() as conn:
        run = make_run(conn, "fresh")
        add_item(conn, run.id, "p1", status="pending")
    result = build_report(db, "fresh", tmp_path / "out")
    assert result.items == 0 and len(result.images) == 5
    page = result.index.read_text()
    assert "The run is not finished: 1 of 1 items remain." in page
    assert "No failed items." in page

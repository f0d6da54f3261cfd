"""The `status --watch` dashboard on SQLite and real Postgres: exact numbers from its named
queries, the picture they add up to, and the rows rich renders from it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console
from sqlalchemy import Engine

from app.core.errors import NotFound
from app.ledger import dashboard_queries as dq
from app.ledger import run_queries
from ops.views.dashboard import duration, render_dashboard, watch
from tests.support.runs import seed_fleet

T = datetime(2031, 5, 4, 12, 0, 0, tzinfo=UTC)


def ago(seconds: float) -> datetime:
    return T - timedelta(seconds=seconds)


@pytest.fixture
def fleet(db: Engine) -> Engine:
    with db.begin() as conn:
        seed_fleet(conn, T)
    return db


# seed_fleet: r1 has 10 items (5 done, one of them truncated; 1 failed; 3 leased; 1 pending),
# r2 one done item; gpu-a is paused by the operator, gpu-b is down, gpu-c only has a lease.


def test_named_queries_give_exact_numbers(fleet: Engine) -> None:
    with fleet.connect() as conn:
        assert dq.servers_seen(conn) == ["gpu-a", "gpu-b", "gpu-c"]
        expected = [(1, "gpu-a", 3, 600), (1, "gpu-b", 2, 512), (2, "gpu-a", 1, 50)]
        for servers in (None, ["gpu-a", "gpu-b", "gpu-c"]):
            recent = dq.recent_completions(conn, since=ago(60), servers=servers)
            assert sorted((r.run_id, r.server, r.finished, r.output_tokens) for r in recent) == (
                expected
            )
        only_b = dq.recent_completions(conn, since=ago(60), servers=["gpu-b"])
        assert [(r.server, r.finished) for r in only_b] == [("gpu-b", 2)]
        assert dq.inflight_by_server(conn) == {"gpu-a": 2, "gpu-c": 1}
        assert dq.recent_latencies(conn, "gpu-a") == [1.0, 0.5, 2.0, 3.0, 4.0]
        assert dq.recent_latencies(conn, "gpu-a", limit=2) == [1.0, 0.5]
        assert dq.recent_latencies(conn, "gpu-b") == [10.0]  # the failed item has none
        assert dq.recent_latencies(conn, "gpu-c") == []


def test_percentile_is_nearest_rank() -> None:
    values = [1.0, 0.5, 2.0, 3.0, 4.0]
    assert dq.percentile(values, 50) == 2.0
    assert dq.percentile(values, 95) == 4.0
    assert dq.percentile(values, 0) == 0.5
    assert dq.percentile([7.0], 95) == 7.0
    assert dq.percentile([], 50) is None


def test_gather_dashboard_adds_up(fleet: Engine) -> None:
    with fleet.connect() as conn:
        board = dq.gather_dashboard(conn, now=T)
    r1, r2 = board.runs
    assert (r1.counts.total, r1.counts.done, r1.counts.failed, r1.counts.leased) == (10, 5, 1, 3)
    assert (r1.counts.truncated, r1.counts.output_tokens) == (1, 1512)
    assert (r1.finished, r1.remaining, r1.recent_finished, r1.recent_tokens) == (6, 4, 5, 1112)
    assert r1.tokens_per_s == pytest.approx(1112 / 60)
    assert r1.eta_s == pytest.approx(4 * 60 / 5)  # 4 left at 5 per minute: 48 s
    assert (r2.remaining, r2.eta_s, r2.tokens_per_s) == (0, 0.0, pytest.approx(50 / 60))
    assert board.runs_not_shown == 0
    a, b, c = board.servers
    assert (a.name, a.in_flight, a.recent_tokens, a.latency_p50_s, a.latency_p95_s) == (
        "gpu-a",
        2,
        650,
        2.0,
        4.0,
    )
    assert a.info is not None and a.info.paused and a.info.paused_by == "operator"
    assert a.info.workers == ["w1@h", "w2@h"]
    assert (b.name, b.in_flight, b.recent_tokens, b.latency_p50_s) == ("gpu-b", 0, 512, 10.0)
    assert b.info is not None and b.info.state == "down"
    assert (c.name, c.info, c.in_flight, c.latency_p50_s) == ("gpu-c", None, 1, None)
    assert len(board.events) == 8
    assert board.events[-1].message == "gpu-a paused by operator: maintenance"


def test_gather_dashboard_for_one_run_and_a_capped_list(fleet: Engine) -> None:
    with fleet.connect() as conn:
        only = dq.gather_dashboard(conn, run_name="r2", now=T)
        capped = dq.gather_dashboard(conn, now=T, max_runs=1)
        stalled = dq.gather_dashboard(conn, run_name="r1", now=T + timedelta(hours=1))
        with pytest.raises(NotFound):
            dq.gather_dashboard(conn, run_name="nope", now=T)
    assert [r.counts.run for r in only.runs] == ["r2"]
    assert [r.counts.run for r in capped.runs] == ["r2"] and capped.runs_not_shown == 1
    (r1,) = stalled.runs  # nothing finished in the last minute: no rate, no ETA
    assert (r1.recent_finished, r1.tokens_per_s, r1.eta_s) == (0, 0.0, None)


def test_render_shows_every_row(fleet: Engine) -> None:
    with fleet.connect() as conn:
        board = dq.gather_dashboard(conn, now=T)
    console = Console(record=True, width=200, color_system=None)
    console.print(render_dashboard(board, interval_s=0.5))
    text = console.export_text()
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert "tokenmill status  2031-05-04 12:00:00 UTC  every 0.5s" in text
    for expected in ("6/10  60%", " 5 ", "1,512", " 19 ", " 48s"):
        assert expected in lines["r1"], (expected, lines["r1"])
    assert "1/1 100%" in lines["r2"] and "done" in lines["r2"]
    gpu_a = lines["gpu-a"].split()
    assert gpu_a[:5] == ["gpu-a", "healthy", "yes", "(operator)", "2"]
    assert gpu_a[5:9] == ["2", "11", "2.0s", "4.0s"]  # in flight, tok/s, p50, p95
    assert "12s ago ok" in lines["gpu-a"]
    assert "down" in lines["gpu-b"] and "3s ago failed" in lines["gpu-b"]
    assert "connection refused" in lines["gpu-b"] and "second line" not in text
    assert "unregistered" in lines["gpu-c"]
    assert "gpu-a paused by operator: maintenance" in text
    assert "gpu-b event 9" in text and "gpu-b event 2" not in text  # only the latest 8


def test_watch_redraws_then_stops_on_ctrl_c(fleet: Engine) -> None:
    console = Console(record=True, width=200, color_system=None, force_terminal=True)
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            raise KeyboardInterrupt

    watch(fleet, run_name="r1", interval_s=0.25, console=console, sleep=nap)
    assert naps == [0.25, 0.25, 0.25]  # two redraws, then Ctrl-C ends it quietly
    assert "gpu-a" in console.export_text()


def test_duration() -> None:
    assert [duration(s) for s in (None, 0, 48, 200, 7500, 400_000)] == [
        "—",
        "0s",
        "48s",
        "3m 20s",
        "2h 05m",
        "4d 15h",
    ]


def test_render_at_80_columns_keeps_names_and_leaves_columns_out_in_order(fleet: Engine) -> None:
    with fleet.connect() as conn:
        board = dq.gather_dashboard(conn, now=T)
    console = Console(record=True, width=80, color_system=None)
    console.print(render_dashboard(board, interval_s=0.5, width=80))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert {"r1", "r2", "gpu-a", "gpu-b", "gpu-c"} <= set(lines)
    assert "…" not in text.replace("… ", "")  # nothing cut to an ellipsis
    assert "(left out at this width: progress" in text
    assert "(left out at this width: workers" in text
    # gpu-b's probe failed: its error is current, folded at a space, not cut
    assert "connection refused" in " ".join(text.split())


def test_a_run_of_another_priority_says_so_beside_its_name(fleet: Engine) -> None:
    with fleet.begin() as conn:
        run_queries.set_priority(conn, "r2", 10)
    with fleet.connect() as conn:
        board = dq.gather_dashboard(conn, now=T)
    console = Console(record=True, width=200, color_system=None)
    console.print(render_dashboard(board, interval_s=0.5))
    text = console.export_text()
    assert "r2 (priority 10)" in text
    assert "r1 (priority" not in text  # the default priority is not shown

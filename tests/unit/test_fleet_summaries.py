"""The views of a large fleet stay readable: `tokenmill servers` and the dashboard put a summary
line over the servers table, and the dashboard draws at most SERVER_ROWS_SHOWN servers, those
that need a look first."""

from __future__ import annotations

from app.ledger import dashboard_queries, registry
from ops.fleet_cmd import servers_summary
from ops.views import dashboard


def server(
    name: str, state: str = "healthy", *, paused: bool = False, workers: int = 1
) -> registry.ServerInfo:
    return registry.ServerInfo(
        name=name,
        url=f"http://{name}",
        state=state,
        state_since=None,
        paused=paused,
        paused_by="operator" if paused else None,
        pause_reason=None,
        consecutive_failures=0,
        consecutive_successes=0,
        last_probe_at=None,
        last_probe_ok=None,
        last_probe_latency_s=None,
        last_error=None,
        fingerprint=None,
        restart_command=None,
        workers=[f"{name}@w{i}" for i in range(workers)],
    )


def fleet(count: int) -> list[registry.ServerInfo]:
    """count servers; every tenth down (and paused), every 25th suspect."""
    return [
        server(
            f"gpu-{i:03d}:30000",
            "down" if i % 10 == 3 else "suspect" if i % 25 == 7 else "healthy",
            paused=i % 10 == 3,
        )
        for i in range(count)
    ]


def test_servers_prints_a_summary_line() -> None:
    rows = [(s, 64) for s in fleet(256)]
    assert servers_summary(rows) == (
        "256 servers: 220 healthy, 26 down, 10 suspect; 26 paused; 256 workers; 16,384 leased"
    )


def test_the_dashboard_titles_its_servers_and_shows_those_that_need_a_look() -> None:
    rows = [dashboard_queries.ServerRow(s.name, s, 64, 0, 60.0, None, None) for s in fleet(256)]
    assert dashboard.servers_title(rows) == (
        "servers: 256 (220 healthy, 26 down, 10 suspect); 26 paused; 16,384 in flight"
    )
    shown, not_shown = dashboard._shown(rows)
    assert len(shown) == dashboard.SERVER_ROWS_SHOWN and not_shown == 256 - len(shown)
    # the 36 down or suspect servers outnumber the rows: only they are drawn, in their order
    assert all(row.info is not None and row.info.state != "healthy" for row in shown)
    assert [row.name for row in shown] == sorted(row.name for row in shown)


def test_a_small_fleet_is_drawn_whole_in_its_order() -> None:
    rows = [dashboard_queries.ServerRow(s.name, s, 1, 0, 60.0, None, None) for s in fleet(12)]
    assert dashboard._shown(rows) == (rows, 0)

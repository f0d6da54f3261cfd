"""`servers` as an operator reads the two numbers beside each server, and the shares of one
server registered twice: `leased` (items, with the workers' backlogs) apart from the window
(requests), the server's load aged once it is stale; and one URL under two names is one server,
whose workers share one capacity."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from app.ledger import common, database, migrate, registry, windows
from tests.support.procs import clean_env, tokenmill


def window(server: str, owner: str, *, read_s_ago: float) -> windows.WindowRow:
    return windows.WindowRow(
        server=server,
        owner=owner,
        mode="auto",
        size=136,
        max_running=128,
        running=120,
        queued=4,
        reason="loads",
        changed_at=common.utcnow(),
        loads_at=common.utcnow() - timedelta(seconds=read_s_ago),
    )


def test_one_url_registered_under_two_names_is_one_server_with_one_share(
    tmp_path: Path,
) -> None:
    engine = database.make_engine(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    migrate.upgrade(engine)
    with engine.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://node-a:30000")
        registry.upsert_server(conn, "gpu-a:30000", "http://node-a:30000")  # the same server
        registry.upsert_server(conn, "gpu-b", "http://node-b:30000")
        for server, owner in (("gpu-a", "w1"), ("gpu-a:30000", "w2"), ("gpu-b", "w3")):
            windows.record_window(conn, window(server, owner, read_s_ago=0))
        fresh_s = windows.FRESH_S
        assert windows.sharing_owners(conn, "gpu-a", fresh_s=fresh_s) == ["w1", "w2"]
        assert windows.sharing_owners(conn, "gpu-a:30000", fresh_s=fresh_s) == ["w1", "w2"]
        assert windows.sharing_owners(conn, "gpu-b", fresh_s=fresh_s) == ["w3"]


def test_servers_names_leased_items_and_window_requests_and_ages_a_stale_load(
    tmp_path: Path,
) -> None:
    engine = database.make_engine(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    migrate.upgrade(engine)
    with engine.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://node-a:30000")
        registry.upsert_server(conn, "gpu-b", "http://node-b:30000")
        windows.record_window(conn, window("gpu-a", "w1", read_s_ago=1))
        windows.record_window(conn, window("gpu-b", "w2", read_s_ago=600))
    shown = tokenmill(["servers"], clean_env(tmp_path, COLUMNS="220"))
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "leased" in text.splitlines()[0] and "in flight" not in text
    rows = [line.rstrip() for line in text.splitlines()]
    # gpu-a's reading is fresh: not aged; gpu-b's is stale
    assert text.count("auto: 136 requests (max_running 128)") == 2, text
    assert sum(row.endswith("server: running 120 · queued 4") for row in rows) == 2, text
    assert sum(row.endswith("read 10m ago") for row in rows) == 1, text

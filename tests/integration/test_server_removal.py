"""Servers leave the registry on the real ledger: `servers remove` drops a stray and refuses a
busy server naming its workers and leases; a worker's own registration of a server it never
reached goes when it stops; `events --run` keeps to the fleet events of the run's lifetime."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import Engine

from app.core.constants import EVENT_SERVER_REMOVED
from app.core.errors import NotFound, ServerBusy
from app.ledger import common, registry, run_queries
from tests.support.runs import add_event, add_item, add_server, make_run
from workers.control.server_removal import drop_stray, remove_server


def nobody(names: list[str]) -> set[str]:
    return set()


def everybody(names: list[str]) -> set[str]:
    return set(names)


def cannot_tell(names: list[str]) -> set[str]:
    raise RuntimeError("no remote control on this broker")


def names(db: Engine) -> list[str]:
    with db.connect() as conn:
        return [s.name for s in registry.list_servers(conn)]


def test_a_stray_is_removed_and_the_timeline_says_so(pg_engine: Engine) -> None:
    with pg_engine.begin() as conn:
        add_server(conn, "gpu-a:30001", state="down", probe_ok=False)
        add_server(conn, "gpu-a:30000")
    removed = remove_server(pg_engine, "gpu-a:30001", nobody)
    assert removed.url == "http://gpu-a:30001:30000"
    assert names(pg_engine) == ["gpu-a:30000"]
    with pg_engine.connect() as conn:
        events = registry.list_events(conn, server="gpu-a:30001")
    assert [e.kind for e in events][-1] == EVENT_SERVER_REMOVED
    with pytest.raises(NotFound, match="known: gpu-a:30000"):
        remove_server(pg_engine, "gpu-a:30001", nobody)


def test_a_busy_server_is_refused_naming_its_workers_and_leases(pg_engine: Engine) -> None:
    with pg_engine.begin() as conn:
        add_server(conn, "gpu-b", workers=["gpu-b@n1", "gpu-b-2@n1"])
        run = make_run(conn, "r1")
        add_item(conn, run.id, "k1", status="leased", server="gpu-b")
        add_item(conn, run.id, "k2", status="leased", server="gpu-b")
    with pytest.raises(ServerBusy) as refused:
        remove_server(pg_engine, "gpu-b", everybody)
    message = str(refused.value)
    assert "workers gpu-b-2@n1, gpu-b@n1 serve it" in message
    assert "items are leased to it (2 of run r1)" in message
    assert names(pg_engine) == ["gpu-b"]
    # listed workers that no longer answer (killed) do not hold it; the leases still do
    with pytest.raises(ServerBusy) as leased:
        remove_server(pg_engine, "gpu-b", nobody)
    assert "serve it" not in str(leased.value) and "2 of run r1" in str(leased.value)
    # a broker that cannot say which run: every listed worker counts
    with pytest.raises(ServerBusy, match="could not say whether they run"):
        remove_server(pg_engine, "gpu-b", cannot_tell)


def test_a_workers_own_registration_goes_only_if_it_never_reached_the_server(
    pg_engine: Engine,
) -> None:
    with pg_engine.begin() as conn:
        registry.claim_server(
            conn, "gpu-c:30001", url="http://gpu-c:30001", worker_url="x", node="gpu-c"
        )
        registry.claim_server(
            conn, "gpu-c:30000", url="http://gpu-c:30000", worker_url="x", node="gpu-c"
        )
        registry.set_fingerprint(conn, "gpu-c:30000", {"model_path": "m"})
        registry.claim_server(conn, "gpu-d", url="http://gpu-d:1", worker_url="x", node="gpu-d")
        run = make_run(conn, "r2")
        add_item(conn, run.id, "k", status="failed", server="gpu-d")
    assert drop_stray(pg_engine, "gpu-c:30001")
    assert not drop_stray(pg_engine, "gpu-c:30000")  # it answered: not a stray
    assert not drop_stray(pg_engine, "gpu-d")  # an item was sent to it: history
    assert names(pg_engine) == ["gpu-c:30000", "gpu-d"]


def test_events_of_a_run_leave_out_the_fleet_before_it(pg_engine: Engine) -> None:
    now = common.utcnow()
    with pg_engine.begin() as conn:
        add_event(conn, "state", "gpu-a", now - timedelta(hours=2), "before the run")
        make_run(conn, "r3")
        add_event(conn, "state", "gpu-a", now + timedelta(seconds=1), "during the run")
        run_id = run_queries.get_run(conn, "r3").id
        shown = [e.message for e in registry.list_events(conn, run_id=run_id)]
    assert "during the run" in shown and "before the run" not in shown

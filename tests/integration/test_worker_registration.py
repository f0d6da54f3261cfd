"""A worker's registration in the real ledger: a new server at the fleet URL, a registered one
keeps the control plane's URL with the worker's own beside it, a new node takes a server over."""

from __future__ import annotations

from sqlalchemy import Engine

from app.core.settings import Settings
from app.ledger import registry
from workers.engine.identity import WorkerIdentity, claim


def worker(node: str, **values: str) -> tuple[Settings, WorkerIdentity]:
    settings = Settings.model_validate(
        {"sglang_url": "http://localhost:30000", "node_name": node, **values}
    )
    return settings, WorkerIdentity.of(settings)


def nobody(names: list[str]) -> set[str]:
    return set()


def test_a_new_server_is_registered_with_its_node(db: Engine) -> None:
    settings, mine = worker("gpu-a")  # ledger and broker embedded: one machine
    claimed = claim(settings, db, mine, nobody)
    assert (claimed.name, claimed.url, claimed.worker_url, claimed.node) == (
        "gpu-a:30000",
        "http://localhost:30000",
        "http://localhost:30000",
        "gpu-a",
    )


def test_a_registered_url_is_never_overwritten_by_a_worker(db: Engine) -> None:
    with db.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://gpu-a:30000")
    settings, mine = worker("gpu-a", server_name="gpu-a")
    claim(settings, db, mine, nobody)
    with db.begin() as conn:  # worker_ready registers again (and with its worker)
        registry.claim_server(
            conn,
            "gpu-a",
            url="http://localhost:30000",
            worker_url="http://localhost:30000",
            node=None,
        )
        registry.add_worker(conn, "gpu-a", mine.worker_name)
        server = registry.get_server(conn, "gpu-a")
    assert server.url == "http://gpu-a:30000"
    assert server.worker_url == "http://localhost:30000"
    assert (server.node, server.workers) == ("gpu-a", ["gpu-a@gpu-a"])
    # the operator's `servers add` is the one that changes it
    with db.begin() as conn:
        assert registry.upsert_server(conn, "gpu-a", "http://10.0.0.7:30000").url == (
            "http://10.0.0.7:30000"
        )


def test_a_node_taking_a_server_over_forgets_the_old_nodes_workers(db: Engine) -> None:
    settings, first = worker("gpu-a", server_name="gpu")
    claim(settings, db, first, nobody)
    with db.begin() as conn:
        registry.add_worker(conn, "gpu", first.worker_name)
    settings, second = worker("gpu-b", server_name="gpu")
    claimed = claim(settings, db, second, nobody)  # gpu@gpu-a does not answer: gone
    assert (claimed.node, claimed.workers) == ("gpu-b", [])

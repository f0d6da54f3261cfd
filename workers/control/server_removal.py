"""Taking a server out of the registry: `tokenmill servers remove` (refused while workers serve
it or items are leased to it), and a worker's own stray registration when its start came to
nothing (it registered the server, which never answered and never served an item).

A removed server's items keep their history; its pause flag and probes go with its row.
"""

from __future__ import annotations

import logging

from sqlalchemy import Engine

from app.core.constants import EVENT_SERVER_REMOVED
from app.core.errors import ServerBusy
from app.ledger import event_log, registry
from workers.control.pausing import AliveWorkers

log = logging.getLogger(__name__)


def remove_server(db: Engine, name: str, alive: AliveWorkers) -> registry.ServerInfo:
    """Drop server name from the registry; ServerBusy naming its running workers and the
    runs of its leased items when it has any. Listed workers that do not answer a ping are
    gone (killed ones never unlist themselves); when the broker cannot tell, every listed
    worker counts as running."""
    with db.connect() as conn:
        server = registry.get_server(conn, name)  # NotFound names the known ones
        leases = registry.leases_by_run(conn, name)
    try:
        running = sorted(alive(server.workers)) if server.workers else []
        unsure = ""
    except Exception as exc:  # a broker without remote control: assume they run
        running = sorted(server.workers)
        unsure = f" (the broker could not say whether they run: {exc})"
    problems = []
    if running:
        problems.append(f"workers {', '.join(running)} serve it{unsure}")
    if leases:
        held = ", ".join(f"{n} of run {run}" for run, n in leases.items())
        problems.append(f"items are leased to it ({held})")
    if problems:
        raise ServerBusy(
            f"server {name} is not removed: {'; '.join(problems)}. Stop its workers first "
            "(their leases go back to the queue, or expire and `tokenmill reconcile` takes "
            "them back), then remove it"
        )
    with db.begin() as conn:
        registry.delete_server(conn, name)
        event_log.record_event(
            conn,
            EVENT_SERVER_REMOVED,
            f"server {name} at {server.url} removed from the registry",
            server=name,
            details={"url": server.url, "worker_url": server.worker_url, "node": server.node},
        )
    return server


def drop_stray(db: Engine, name: str) -> bool:
    """A worker that registered server name itself, stopping: drop the registration when the
    server never answered (no fingerprint, no healthy probe), no worker is listed for it and
    no item was ever sent to it: a wrong URL or name left nothing behind. True if dropped."""
    with db.begin() as conn:
        server = registry.find_server(conn, name)
        if server is None or server.workers or server.fingerprint is not None:
            return False
        if server.last_probe_ok:
            return False
        if registry.has_served(conn, name):
            return False
        registry.delete_server(conn, name)
        event_log.record_event(
            conn,
            EVENT_SERVER_REMOVED,
            f"server {name} at {server.url} removed: the worker that registered it stopped "
            "without ever reaching it",
            server=name,
            details={"url": server.url, "worker_url": server.worker_url, "node": server.node},
        )
    log.warning(
        "server %s at %s was never reached by this worker: its registration is removed",
        name,
        server.url,
        extra={"action": "server_removed"},
    )
    return True

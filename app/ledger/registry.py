"""The ledger's server registry and event timeline: named queries on `servers` and `events`.

Servers are first-class: their health state, durable pause flag (and who set it), probe
results, fingerprint, restart command and bound workers all live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, update

from app.core.constants import (
    EVENT_ENQUEUE_STOPPED,
    EVENT_ENQUEUED,
    EVENT_STATE,
    PAUSED_BY_WATCHDOG,
    PauseReason,
)
from app.core.errors import NotFound
from app.core.models import ItemStatus
from app.ledger import claims, common, database, event_log, run_queries

MAX_WORKERS_LISTED = 32


@dataclass(frozen=True)
class ServerInfo:
    name: str
    url: str
    state: str
    state_since: datetime | None
    paused: bool
    paused_by: PauseReason | None
    pause_reason: str | None
    consecutive_failures: int
    consecutive_successes: int
    last_probe_at: datetime | None
    last_probe_ok: bool | None
    last_probe_latency_s: float | None
    last_error: str | None
    fingerprint: dict[str, Any] | None
    restart_command: list[str] | None
    workers: list[str]
    # the last parity check per run name (see `record_parity`)
    parity: dict[str, Any] | None = None
    # the URL its workers send to (often loopback), and the node they run on
    worker_url: str | None = None
    node: str | None = None

    def differing_runs(self) -> list[str]:
        """Runs whose stored prompts this server renders differently (last check)."""
        return sorted(r for r, p in (self.parity or {}).items() if p.get("status") == "differs")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "worker_url": self.worker_url,
            "node": self.node,
            "state": self.state,
            "state_since": self.state_since.isoformat() if self.state_since else None,
            "paused": self.paused,
            "paused_by": self.paused_by,
            "pause_reason": self.pause_reason,
            "consecutive_failures": self.consecutive_failures,
            "consecutive_successes": self.consecutive_successes,
            "last_probe_at": self.last_probe_at.isoformat() if self.last_probe_at else None,
            "last_probe_ok": self.last_probe_ok,
            "last_probe_latency_s": self.last_probe_latency_s,
            "last_error": self.last_error,
            "fingerprint": self.fingerprint,
            "restart_command": self.restart_command,
            "workers": self.workers,
            "parity": self.parity,
        }


def _server(row: Any) -> ServerInfo:
    return ServerInfo(
        name=row.name,
        url=row.url,
        state=row.state,
        state_since=common.as_utc(row.state_since),
        paused=bool(row.paused),
        paused_by=row.paused_by,
        pause_reason=row.pause_reason,
        consecutive_failures=row.consecutive_failures,
        consecutive_successes=row.consecutive_successes,
        last_probe_at=common.as_utc(row.last_probe_at),
        last_probe_ok=row.last_probe_ok,
        last_probe_latency_s=row.last_probe_latency_s,
        last_error=row.last_error,
        fingerprint=row.fingerprint,
        restart_command=row.restart_command,
        workers=list(row.workers or []),
        parity=row.parity,
        worker_url=row.worker_url,
        node=row.node,
    )


def find_server(conn: Connection, name: str) -> ServerInfo | None:
    row = conn.execute(select(common.servers).where(common.servers.c.name == name)).first()
    return None if row is None else _server(row)


def get_server(conn: Connection, name: str) -> ServerInfo:
    server = find_server(conn, name)
    if server is None:
        known = ", ".join(s.name for s in list_servers(conn)) or "none registered"
        raise NotFound(f"no server named {name!r} (known: {known})")
    return server


def list_servers(conn: Connection) -> list[ServerInfo]:
    return [
        _server(r) for r in conn.execute(select(common.servers).order_by(common.servers.c.name))
    ]


def pause_flag(conn: Connection, name: str) -> tuple[bool, str | None]:
    """(paused, paused_by) of a server; an unregistered server is not paused."""
    row = conn.execute(
        select(common.servers.c.paused, common.servers.c.paused_by).where(
            common.servers.c.name == name
        )
    ).first()
    return (False, None) if row is None else (bool(row.paused), row.paused_by)


def _insert_server(conn: Connection, name: str, url: str, **values: Any) -> None:
    now = common.utcnow()
    conn.execute(
        insert(common.servers).values(
            name=name,
            url=url,
            state="unknown",
            state_since=now,
            paused=False,
            consecutive_failures=0,
            consecutive_successes=0,
            workers=[],
            created_at=now,
            updated_at=now,
            **values,
        )
    )


def upsert_server(
    conn: Connection, name: str, url: str, *, restart_command: list[str] | None = None
) -> ServerInfo:
    """Register a server by name, or update its URL (and restart command when given): the
    operator's view of where the control plane reaches it."""
    now = common.utcnow()
    exists = conn.execute(select(common.servers.c.id).where(common.servers.c.name == name)).first()
    if exists is None:
        _insert_server(conn, name, url, restart_command=restart_command)
    else:
        values: dict[str, Any] = {"url": url, "updated_at": now}
        if restart_command is not None:
            values["restart_command"] = restart_command
        conn.execute(update(common.servers).where(common.servers.c.name == name).values(**values))
    return get_server(conn, name)


def claim_server(
    conn: Connection, name: str, *, url: str, worker_url: str, node: str | None
) -> ServerInfo:
    """A worker's registration of the server it serves: url is registered only when the server
    is new, a registered one keeps its URL; worker_url (what the worker sends to) and the node
    are recorded beside it. A server taken over by another node forgets the old node's workers."""
    before = find_server(conn, name)
    if before is None:
        _insert_server(conn, name, url, worker_url=worker_url, node=node)
        return get_server(conn, name)
    values: dict[str, Any] = {"worker_url": worker_url, "updated_at": common.utcnow()}
    if node is not None:
        values["node"] = node
        if before.node is not None and before.node != node:
            values["workers"] = []
    conn.execute(update(common.servers).where(common.servers.c.name == name).values(**values))
    return get_server(conn, name)


def leases_by_run(conn: Connection, name: str) -> dict[str, int]:
    """Run name → how many of its items are leased to this server now (the server's index)."""
    stmt = (
        select(common.runs.c.name, func.count())
        .select_from(common.items.join(common.runs, common.runs.c.id == common.items.c.run_id))
        .where(common.items.c.server == name, common.items.c.status == ItemStatus.LEASED.value)
        .group_by(common.runs.c.name)
        .order_by(common.runs.c.name)
    )
    return {str(run): int(n) for run, n in conn.execute(stmt)}


def has_served(conn: Connection, name: str) -> bool:
    """Whether any item was ever sent to this server (one probe of the server's index)."""
    stmt = select(common.items.c.id).where(common.items.c.server == name).limit(1)
    return conn.execute(stmt).first() is not None


def delete_server(conn: Connection, name: str) -> bool:
    """Drop a server from the registry (its items keep their history); False if it was not
    there."""
    return bool(conn.execute(delete(common.servers).where(common.servers.c.name == name)).rowcount)


def set_workers(conn: Connection, name: str, workers: list[str]) -> None:
    conn.execute(
        update(common.servers)
        .where(common.servers.c.name == name)
        .values(workers=workers[-MAX_WORKERS_LISTED:], updated_at=common.utcnow())
    )


def add_worker(conn: Connection, name: str, worker: str) -> None:
    current = get_server(conn, name).workers
    if worker not in current:
        set_workers(conn, name, [*current, worker])


def remove_worker(conn: Connection, name: str, worker: str) -> None:
    current = get_server(conn, name).workers
    if worker in current:
        set_workers(conn, name, [w for w in current if w != worker])


def set_paused(
    conn: Connection, name: str, paused: bool, *, by: PauseReason | None, reason: str | None
) -> bool:
    """Set the durable pause flag; return True when it changed."""
    before = get_server(conn, name)
    conn.execute(
        update(common.servers)
        .where(common.servers.c.name == name)
        .values(
            paused=paused,
            paused_by=by if paused else None,
            pause_reason=reason if paused else None,
            updated_at=common.utcnow(),
        )
    )
    return before.paused != paused or (paused and before.paused_by != by)


def record_probe(
    conn: Connection,
    name: str,
    *,
    expected: str | None = None,
    state: str,
    failures: int,
    successes: int,
    ok: bool,
    latency_s: float | None,
    error: str | None,
) -> bool:
    """The watchdog's probe: its last probe, and its state machine's verdict `state` stepped
    from `expected` (the state it read; None: the state now) with its counters. False when
    another writer changed the state since it read it: the verdict does not stand (the
    counters start again)."""
    if expected is None:
        expected = str(get_server(conn, name).state)
    if state != expected:
        stands = change_state(conn, name, expected=expected, to=state, error=error, by="watchdog")
    else:
        now = conn.execute(
            select(common.servers.c.state).where(common.servers.c.name == name)
        ).scalar()
        stands = now == expected
    values = _probe_values(ok, latency_s, error)
    if stands:
        values.update(consecutive_failures=failures, consecutive_successes=successes)
    else:
        values.update(consecutive_failures=0, consecutive_successes=0)
    conn.execute(update(common.servers).where(common.servers.c.name == name).values(**values))
    return stands


def _probe_values(ok: bool, latency_s: float | None, error: str | None) -> dict[str, Any]:
    """The columns a probe sets besides the state: the last probe's time, result and error."""
    now = common.utcnow()
    values: dict[str, Any] = {
        "last_probe_at": now,
        "last_probe_ok": ok,
        "last_probe_latency_s": latency_s,
        "updated_at": now,
    }
    if error is not None:
        values["last_error"] = error[:1000]
    return values


# the states a probe's error is shown beside in the timeline
_STATES_WITH_ERRORS = ("suspect", "down", "auth", "draining")


def change_state(
    conn: Connection, name: str, *, expected: str, to: str, error: str | None, by: str
) -> bool:
    """The one writer of a server's state changes, whoever probed (the watchdog, a worker or
    `tokenmill run`, a restart): the state moves from `expected` to `to` only if it still is
    `expected` (a conditional UPDATE: of two writers that saw the same change one records it),
    and the change goes on the timeline (a `state` event naming the writer) in the same
    transaction. False when the state was not `expected` any more: nothing is written."""
    now = common.utcnow()
    stmt = (
        update(common.servers)
        .where(common.servers.c.name == name, common.servers.c.state == expected)
        .values(state=to, state_since=now, updated_at=now)
    )
    if expected == to or conn.execute(stmt).rowcount != 1:
        return False
    message = f"{name}: {expected} → {to}"
    if error and to in _STATES_WITH_ERRORS:
        message += f" ({error})"
    event_log.record_event(
        conn,
        EVENT_STATE,
        message,
        server=name,
        details={"from": expected, "to": to, "error": error, "by": by},
    )
    return True


def note_probe(
    conn: Connection,
    name: str,
    *,
    state: str,
    ok: bool,
    latency_s: float | None,
    error: str | None,
    by: str,
) -> str | None:
    """A probe made by `tokenmill run`, a worker or a restart (not the watchdog's state
    machine): the last probe, its time and result, and the state it saw, changed through
    change_state; the state before (None: the server is not registered, nothing is written).

    What such a probe sees does not overrule what the ledger knows: a healthy one of a server
    the watchdog paused, or found suspect, keeps the watchdog's state (a hung scheduler keeps
    /health at 200; the watchdog's own generation checks and thresholds decide); a 503 from a
    server that is down or recovering is one starting, not draining; a recovering one of a
    healthy server stays healthy (recovering is the way up from down)."""
    row = conn.execute(
        select(common.servers.c.state, common.servers.c.paused, common.servers.c.paused_by).where(
            common.servers.c.name == name
        )
    ).first()
    if row is None:
        return None
    before = str(row.state)
    kept = (
        (state == "healthy" and row.paused and row.paused_by == PAUSED_BY_WATCHDOG)
        or (state == "healthy" and before == "suspect")
        or (state == "draining" and before in ("down", "recovering"))
        or (state == "recovering" and before == "healthy")
    )
    if not kept:
        change_state(conn, name, expected=before, to=state, error=error, by=by)
    values = _probe_values(ok, latency_s, error)
    conn.execute(update(common.servers).where(common.servers.c.name == name).values(**values))
    return before


def set_fingerprint(conn: Connection, name: str, fingerprint: dict[str, Any]) -> None:
    conn.execute(
        update(common.servers)
        .where(common.servers.c.name == name)
        .values(fingerprint=fingerprint, updated_at=common.utcnow())
    )


def record_parity(conn: Connection, name: str, run_name: str, result: dict[str, Any]) -> None:
    """Keep a server's last parity check of a run: {"status", "checked", "mismatched", "at"}."""
    row = conn.execute(select(common.servers.c.parity).where(common.servers.c.name == name)).first()
    if row is None:
        return
    parity = dict(row.parity or {})
    parity[run_name] = result
    conn.execute(
        update(common.servers)
        .where(common.servers.c.name == name)
        .values(parity=parity, updated_at=common.utcnow())
    )


def parity_status(conn: Connection, name: str, run_name: str) -> str | None:
    """The status of the server's last parity check of the run (None: never checked, or the
    server is not registered)."""
    row = conn.execute(select(common.servers.c.parity).where(common.servers.c.name == name)).first()
    if row is None or not row.parity:
        return None
    status = (row.parity.get(run_name) or {}).get("status")
    return str(status) if status is not None else None


def stopped_enqueues(conn: Connection, run_ids: list[int]) -> set[int]:
    """Runs whose last enqueue stopped before the end of its input (a render server stayed
    down): their last enqueue event is `enqueue_stopped`, not `enqueued`."""
    if not run_ids:
        return set()
    latest = (
        select(common.events.c.run_id, func.max(common.events.c.id).label("last"))
        .where(
            common.events.c.run_id.in_(run_ids),
            common.events.c.kind.in_([EVENT_ENQUEUED, EVENT_ENQUEUE_STOPPED]),
        )
        .group_by(common.events.c.run_id)
        .subquery()
    )
    stmt = select(common.events.c.run_id).join(latest, common.events.c.id == latest.c.last)
    stmt = stmt.where(common.events.c.kind == EVENT_ENQUEUE_STOPPED)
    return {int(r) for r in conn.execute(stmt).scalars()}


def active_runs(conn: Connection, server: str | None = None) -> list[tuple[int, str, bool]]:
    """(run id, run name, require_parity) of runs that still have unfinished items; with server,
    only the runs its fleet workers may serve (not one `tokenmill run` drives, nor one bound
    to other servers by `enqueue --servers`)."""
    unfinished = (
        select(common.items.c.run_id)
        .where(
            common.items.c.run_id == common.runs.c.id,
            common.items.c.status.in_(
                [ItemStatus.PENDING.value, ItemStatus.QUEUED.value, ItemStatus.LEASED.value]
            ),
        )
        .exists()
    )
    stmt = select(
        common.runs.c.id,
        common.runs.c.name,
        common.runs.c.require_parity,
        common.runs.c.driver,
        common.runs.c.servers,
    )
    return [
        (r.id, r.name, bool(r.require_parity))
        for r in conn.execute(stmt.where(unfinished).order_by(common.runs.c.id))
        if server is None
        or (r.driver != run_queries.DRIVER_RUN and (r.servers is None or server in r.servers))
    ]


@dataclass(frozen=True)
class ServerLoad:
    leased: int
    oldest_lease_at: datetime | None
    last_finished_at: datetime | None


def server_load(conn: Connection, name: str) -> ServerLoad:
    """Items leased to a server now, the oldest of those leases, and its latest completion.

    Both read only active or newest rows: the leases, and the last entry of the partial index
    of done items by (server, finished_at), whatever the planner's statistics say."""
    database.pin_index_plans(conn)
    leased, oldest = conn.execute(
        select(func.count(), func.min(common.items.c.started_at)).where(
            common.items.c.server == name, common.items.c.status == ItemStatus.LEASED.value
        )
    ).one()
    last = conn.execute(
        select(common.items.c.finished_at)
        .where(
            common.items.c.server == name,
            common.items.c.status == ItemStatus.DONE.value,
            common.items.c.finished_at.is_not(None),
        )
        .order_by(common.items.c.finished_at.desc())
        .limit(1)
    ).scalar()
    return ServerLoad(int(leased), common.as_utc(oldest), common.as_utc(last))


def is_stalled(load: ServerLoad, *, now: datetime, stall_s: float) -> bool:
    """Work has waited on the server for stall_s and nothing finished in that time."""
    if load.leased == 0 or load.oldest_lease_at is None:
        return False
    horizon = now - timedelta(seconds=stall_s)
    if load.oldest_lease_at > horizon:
        return False
    return load.last_finished_at is None or load.last_finished_at < horizon


def active_run_fingerprints(conn: Connection) -> list[tuple[int, str, dict[str, Any]]]:
    """(run id, run name, pinned fingerprint) of runs that still have unfinished items: an
    indexed probe per run and status (never a semi-join the planner could turn into a scan);
    archived runs are finished."""
    unfinished = (ItemStatus.PENDING.value, ItemStatus.QUEUED.value, ItemStatus.LEASED.value)
    stmt = select(common.runs.c.id, common.runs.c.name, common.runs.c.fingerprint).where(
        common.runs.c.fingerprint.is_not(None), common.runs.c.archived_at.is_(None)
    )
    return [
        (r.id, r.name, dict(r.fingerprint))
        for r in conn.execute(stmt).all()
        if claims.run_has_items(conn, r.id, unfinished)
    ]


def active_run_pins(conn: Connection) -> list[tuple[str, dict[str, Any] | None, str | None]]:
    """(run name, pinned fingerprint or None, `--weight-version` or None) of every run that
    still has unfinished items (an indexed probe per run, as active_run_fingerprints)."""
    unfinished = (ItemStatus.PENDING.value, ItemStatus.QUEUED.value, ItemStatus.LEASED.value)
    stmt = select(
        common.runs.c.id,
        common.runs.c.name,
        common.runs.c.fingerprint,
        common.runs.c.weight_version,
    ).where(common.runs.c.archived_at.is_(None))
    return [
        (r.name, dict(r.fingerprint) if r.fingerprint else None, r.weight_version)
        for r in conn.execute(stmt.order_by(common.runs.c.id)).all()
        if claims.run_has_items(conn, r.id, unfinished)
    ]


# --- events -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EventInfo:
    at: datetime
    kind: str
    run: str | None
    server: str | None
    message: str
    details: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat(),
            "kind": self.kind,
            "run": self.run,
            "server": self.server,
            "message": self.message,
            "details": self.details,
        }


def list_events(
    conn: Connection, *, run_id: int | None = None, server: str | None = None, limit: int = 200
) -> list[EventInfo]:
    """The latest events, oldest first; a run's view includes the server-wide events from
    the run's creation on (not the fleet's history before it)."""
    stmt = (
        select(common.events, common.runs.c.name.label("run_name"))
        .select_from(
            common.events.outerjoin(common.runs, common.events.c.run_id == common.runs.c.id)
        )
        .order_by(common.events.c.id.desc())
        .limit(limit)
    )
    if run_id is not None:
        created = (
            select(common.runs.c.created_at).where(common.runs.c.id == run_id).scalar_subquery()
        )
        fleet_since = common.events.c.run_id.is_(None) & (common.events.c.at >= created)
        stmt = stmt.where((common.events.c.run_id == run_id) | fleet_since)
    if server is not None:
        stmt = stmt.where(common.events.c.server == server)
    rows = list(conn.execute(stmt))
    rows.reverse()
    return [
        EventInfo(
            at=common.as_utc(r.at) or common.utcnow(),
            kind=r.kind,
            run=r.run_name,
            server=r.server,
            message=r.message,
            details=r.details,
        )
        for r in rows
    ]

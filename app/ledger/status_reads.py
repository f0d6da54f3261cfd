"""The read models of `tokenmill status` and `tokenmill servers`: each run's counts with what
the status table says beside them (servers rendering it differently, an enqueue that stopped
early, image items no server takes, servers that do not serve a run and why, failures by
reason, agentic chain endings), and a server's current error."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection

from app.ledger import claims, event_log, reads, registry, retries, run_queries


@dataclass(frozen=True)
class RunsStatus:
    """What `tokenmill status` shows of some runs, read in one transaction."""

    runs: list[run_queries.RunInfo]
    counts: list[reads.RunCounts]
    # run name → the servers whose last parity check of it found a difference
    differing: dict[str, list[str]]
    # names of the runs whose last enqueue stopped before the end of its input
    stopped: set[str]
    # names of the runs whose image items wait for a server that understands images
    unserved: list[str]
    # run name → server → why its workers last found they do not serve the run (its pinned
    # fingerprint or limits); only runs with work left
    not_served: dict[str, dict[str, str]]
    # run name → (reason, count), the most common first; only runs with failed items
    failed: dict[str, list[tuple[str, int]]]
    # run name → (ending → count) of its agentic chains; only `--turns all` runs
    endings: dict[str, dict[str, int]]


def read_status(conn: Connection, run_name: str | None) -> RunsStatus:
    """The status of one run (`run_name`) or of every run."""
    runs = [run_queries.get_run(conn, run_name)] if run_name else run_queries.list_runs(conn)
    counts = [reads.run_counts(conn, r) for r in runs]
    servers = registry.list_servers(conn)
    stopped = registry.stopped_enqueues(conn, [r.id for r in runs])
    return RunsStatus(
        runs=runs,
        counts=counts,
        differing=differing_servers(servers),
        stopped={r.name for r in runs if r.id in stopped},
        unserved=unserved_images(conn, servers, runs, counts),
        not_served=runs_not_served(conn, runs, counts),
        # read for the runs that have failed items only (their counters say so)
        failed={
            r.name: retries.failed_by_reason(conn, r.id)
            for r, c in zip(runs, counts, strict=True)
            if c.failed
        },
        endings={
            r.name: reads.chain_endings(conn, r.id) for r in runs if r.generation.turns.chains
        },
    )


def runs_not_served(
    conn: Connection, runs: list[run_queries.RunInfo], counts: list[reads.RunCounts]
) -> dict[str, dict[str, str]]:
    """Run name → server → why the server's workers last found they do not serve the run,
    for the runs with work left that pinned a fingerprint (no other was refused by a server)."""
    left = {
        r.id: r.name
        for r, c in zip(runs, counts, strict=True)
        if r.fingerprint is not None and not c.finished
    }
    out: dict[str, dict[str, str]] = {}
    for server, by_run in _refusals(conn, left).items():
        for run, message in by_run.items():
            out.setdefault(run, {})[server] = refusal_reason(message)
    return out


def refusals_by_server(conn: Connection) -> dict[str, dict[str, str]]:
    """Server → active run → the event in which its workers last found they do not serve the
    run (the server's fingerprint or limits), for `tokenmill servers`. Runs that pinned a
    fingerprint only: a run none pinned was refused by no server."""
    active = {run_id: name for run_id, name, _ in registry.active_run_fingerprints(conn)}
    return _refusals(conn, active)


def _refusals(conn: Connection, names: dict[int, str]) -> dict[str, dict[str, str]]:
    """Server → run name → its latest refusal's message, for the runs of names (id → name)."""
    return {
        server: {names[run_id]: message for run_id, message in by_run.items()}
        for server, by_run in event_log.runs_refused(conn, list(names)).items()
    }


def refusal_reason(message: str) -> str:
    """A refusal event's message without the `server X does not serve run R: ` it opens with."""
    head, sep, rest = message.partition(": ")
    return rest if sep and head.startswith("server ") else message


def differing_servers(servers: list[registry.ServerInfo]) -> dict[str, list[str]]:
    """Run name → the servers whose last parity check of it found a difference."""
    out: dict[str, list[str]] = {}
    for server in servers:
        for run in server.differing_runs():
            out.setdefault(run, []).append(server.name)
    return out


def unserved_images(
    conn: Connection,
    servers: list[registry.ServerInfo],
    runs: list[run_queries.RunInfo],
    counts: list[reads.RunCounts],
) -> list[str]:
    """The runs with image items to claim while every registered server whose fingerprint is
    known understands no images (such servers never take them); none when one does."""
    known = [s.fingerprint for s in servers if s.fingerprint]
    if not known or any("images" in fingerprint for fingerprint in known):
        return []
    waiting = {c.run for c in counts if c.pending or c.queued}
    return [r.name for r in runs if r.name in waiting and claims.image_items_left(conn, r.id)]


def current_error(server: registry.ServerInfo) -> str:
    """The server's last error while it is current (its last probe failed); a healthy
    server's old "Connection refused" is history, in `tokenmill events`."""
    if server.last_probe_ok is not False or not server.last_error:
        return ""
    return server.last_error.splitlines()[0]

"""The watchdog: probes every server, moves it through the health states, pauses the workers
of a server that is down or stalled and resumes them once it is healthy with the same
fingerprint the runs pinned. Runs as a periodic task on the never-paused control queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Engine

from app.core.constants import (
    EVENT_FINGERPRINT_MISMATCH,
    PAUSED_BY_FINGERPRINT,
    PAUSED_BY_PARITY,
    PAUSED_BY_WATCHDOG,
    PAUSED_BY_WEIGHTS,
)
from app.core.contracts import ServerFingerprint
from app.core.errors import AuthRequired, GenerationError
from app.core.settings import Settings
from app.ledger import common, database, event_log, registry
from app.sglang.client import SGLangClient, client_for
from app.sglang.draining import refused_at_once
from workers.control.health import Health, Thresholds, Verdict, step
from workers.control.parity import ParityGate
from workers.control.pausing import WorkerControl, pause_server, resume_server
from workers.control.weights import judge, note_weights

log = logging.getLogger(__name__)


# servers probed at once in a round: 256 servers whose generation check takes 1 s are probed in
# 4 s of the 10 s period (bench/fleet_control.py); each probe holds a database connection only
# for its verdict's short transactions, after its HTTP answer
PROBES_AT_ONCE = 64


@dataclass(frozen=True)
class Probe:
    ok: bool
    latency_s: float | None
    error: str | None
    # /model_info as the healthy probe read it: its weights are checked on every probe
    model: dict[str, Any] | None = None
    # 503 at once (starting, or draining after SIGTERM), not after a failed generation check
    refused_at_once: bool = False
    # /model_info refused our key (401/403)
    auth: bool = False


class Prober(Protocol):
    def probe(self, server: registry.ServerInfo) -> Probe: ...

    def fingerprint(self, server: registry.ServerInfo) -> ServerFingerprint: ...


class HttpProber:
    """Probes `/health_generate` with a client timeout above SGLang's own 20 s.

    Health routes need no API key, so a healthy answer is followed by `/model_info`, which
    does: a server that refuses our key is reported down (with the 401) instead of healthy
    while every generate request bounces off it.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def _client(self, server: registry.ServerInfo) -> SGLangClient:
        return client_for(server.url, self.settings)

    def probe(self, server: registry.ServerInfo) -> Probe:
        model = None
        with self._client(server) as client:
            result = client.health("/health_generate")
            if result.ok:
                try:
                    model = client.model_info()
                except AuthRequired as exc:
                    return Probe(False, result.latency_s, str(exc), auth=True)
                except GenerationError:
                    pass
            at_once = refused_at_once(result.status_code, result.latency_s)
            if at_once:
                # a draining server refuses its liveness route too; one whose /health still
                # answers 200 is alive but generates nothing (a hung scheduler): down
                at_once = not client.health("/health").ok
        error = None
        if not result.ok:
            error = result.error or f"HTTP {result.status_code}"
        return Probe(result.ok, result.latency_s, error, model, refused_at_once=at_once)

    def fingerprint(self, server: registry.ServerInfo) -> ServerFingerprint:
        with self._client(server) as client:
            return client.fingerprint()

    def started_at(self, server: registry.ServerInfo) -> float | None:
        """When the server's process started (`startup_time` in /server_info); None: it does
        not say, or does not answer now."""
        try:
            with self._client(server) as client:
                value = client.server_info().get("startup_time")
        except GenerationError:
            return None
        return float(value) if isinstance(value, int | float) else None


def fingerprint_conflicts(
    fingerprint: ServerFingerprint, pinned: list[tuple[int, str, dict[str, object]]]
) -> list[str]:
    """One line per active run whose pinned fingerprint this server does not match."""
    lines = []
    for _run_id, run_name, want in pinned:
        diff = ServerFingerprint(**want).differences(fingerprint)  # type: ignore[arg-type]
        if diff:
            lines.append(f"run {run_name}: " + "; ".join(diff))
    return lines


@dataclass(frozen=True)
class Judged:
    """One probe of a server and the verdict it leads to (error: what the ledger records)."""

    probe: Probe
    previous: Verdict
    verdict: Verdict
    stalled: bool
    error: str | None


def check_server(
    db: Engine,
    control: WorkerControl,
    prober: Prober,
    server: registry.ServerInfo,
    *,
    thresholds: Thresholds,
    stall_s: float,
    parity: ParityGate | None = None,
) -> Verdict:
    """Probe one server, record the verdict, and pause or resume its workers accordingly.

    With a parity gate, a healthy server re-renders a sample of each active run's prompts the
    first time it is seen for that run (and again whenever it is admitted back)."""
    judged = _judge(db, prober, server, thresholds=thresholds, stall_s=stall_s)
    if not _record(db, server, judged):
        # the state moved under this tick: the next one steps from where it is now
        with db.connect() as conn:
            now = registry.get_server(conn, server.name)
        return Verdict(Health(now.state), 0, 0)
    verdict = judged.verdict
    if verdict.state == Health.HEALTHY and judged.probe.model is not None and server.fingerprint:
        server = _weights_seen(db, control, server, judged.probe.model)
    _act(db, control, prober, server, judged, parity)
    return verdict


def _judge(
    db: Engine,
    prober: Prober,
    server: registry.ServerInfo,
    *,
    thresholds: Thresholds,
    stall_s: float,
) -> Judged:
    """Probe the server and step its health state machine (a stalled server is down)."""
    probe = prober.probe(server)
    with db.connect() as conn:
        database.limit_periodic(conn)
        load = registry.server_load(conn, server.name)
    stalled = probe.ok and registry.is_stalled(load, now=common.utcnow(), stall_s=stall_s)
    previous = Verdict(
        Health(server.state), server.consecutive_failures, server.consecutive_successes
    )
    verdict = step(
        previous,
        probe.ok,
        thresholds,
        stalled=stalled,
        refused_at_once=probe.refused_at_once,
        auth=probe.auth,
    )
    error = probe.error
    if stalled:
        error = (
            f"stalled: {load.leased} requests in flight and none finished for "
            f"{stall_s:.0f}s (health route said ok)"
        )
    return Judged(probe, previous, verdict, stalled, error)


def _record(db: Engine, server: registry.ServerInfo, judged: Judged) -> bool:
    """The probe in the ledger, and the state change (an event and a log line) through the
    registry's one writer of state changes; False when another writer changed the state since
    this tick read it (a worker's probe saw the server first): the verdict does not stand."""
    previous, verdict, error = judged.previous, judged.verdict, judged.error
    with db.begin() as conn:
        stands = registry.record_probe(
            conn,
            server.name,
            expected=previous.state.value,
            state=verdict.state.value,
            failures=verdict.failures,
            successes=verdict.successes,
            ok=judged.probe.ok and not judged.stalled,
            latency_s=judged.probe.latency_s,
            error=error,
        )
    if stands and verdict.state != previous.state:
        message = f"{server.name}: {previous.state.value} → {verdict.state.value}"
        if error and verdict.state in (Health.SUSPECT, Health.DOWN, Health.AUTH):
            message += f" ({error})"
        log.warning(message, extra={"action": "server_state"})
    return stands


def _weights_seen(
    db: Engine, control: WorkerControl, server: registry.ServerInfo, model: dict[str, Any]
) -> registry.ServerInfo:
    """Weights swapped in place (no restart) are seen here even on an idle server: the
    server as the ledger has it after noting them."""
    now = _live_fingerprint(model, server.fingerprint or {})
    if note_weights(db, control, server.name, now, "the watchdog") is None:
        return server
    with db.connect() as conn:
        return registry.get_server(conn, server.name)


def _act(
    db: Engine,
    control: WorkerControl,
    prober: Prober,
    server: registry.ServerInfo,
    judged: Judged,
    parity: ParityGate | None,
) -> None:
    """Pause a down or key-refusing server, admit one back, or check parity on a healthy one."""
    state, error = judged.verdict.state, judged.error
    if state == Health.DOWN and not server.paused:
        pause_server(
            db, control, server.name, by=PAUSED_BY_WATCHDOG, reason=f"server down: {error}"
        )
    elif state == Health.AUTH and not server.paused:
        pause_server(
            db, control, server.name, by=PAUSED_BY_WATCHDOG, reason=f"needs an API key: {error}"
        )
    elif state == Health.HEALTHY and (
        judged.previous.state != Health.HEALTHY or server.paused_by in _GUARDED
    ):
        _admit(db, control, prober, server, parity)
    elif state == Health.HEALTHY and parity is not None and not server.paused:
        blocking = parity.blocking_runs(db, server, again=False)
        if blocking:
            _pause_for_parity(db, control, server, blocking)


# pauses the watchdog sets and lifts itself
_GUARDED = (PAUSED_BY_WATCHDOG, PAUSED_BY_FINGERPRINT, PAUSED_BY_PARITY, PAUSED_BY_WEIGHTS)


def _live_fingerprint(model: dict[str, Any], known: dict[str, Any]) -> ServerFingerprint:
    """The fingerprint /model_info gives now; the server version, speculative and image
    settings (launch arguments from /server_info, which weight updates do not change) as
    known, so the runs judge the new weights on them alone."""
    return ServerFingerprint(
        model_path=None if model.get("model_path") is None else str(model["model_path"]),
        weight_version=(
            None if model.get("weight_version") is None else str(model["weight_version"])
        ),
        reasoning_parser=(
            None if model.get("reasoning_parser") is None else str(model["reasoning_parser"])
        ),
        version=known.get("version"),
        speculative=known.get("speculative"),
        images=known.get("images"),
    )


def _pause_for_parity(
    db: Engine, control: WorkerControl, server: registry.ServerInfo, runs: list[str]
) -> None:
    reason = (
        f"renders the stored prompts of --require-parity run(s) {', '.join(runs)} differently "
        f"(see `tokenmill parity RUN --server {server.name}`)"
    )
    pause_server(db, control, server.name, by=PAUSED_BY_PARITY, reason=reason)


def _admit(
    db: Engine,
    control: WorkerControl,
    prober: Prober,
    server: registry.ServerInfo,
    parity: ParityGate | None = None,
) -> None:
    """A healthy server serves again only with the fingerprint its runs pinned (and, for
    `--require-parity` runs, rendering their prompts as stored)."""
    try:
        fingerprint = prober.fingerprint(server)
    except GenerationError as exc:
        log.warning(
            "fingerprint of %s unavailable (%s); it stays as it is",
            server.name,
            exc,
            extra={"action": "fingerprint_unavailable"},
        )
        return
    with db.begin() as conn:
        registry.set_fingerprint(conn, server.name, fingerprint.to_json())
        database.limit_periodic(conn)
        conflicts = fingerprint_conflicts(fingerprint, registry.active_run_fingerprints(conn))
    # a server that serves some active run (its weights are one of theirs) is admitted; its
    # workers skip the runs pinned to other weights (one run per version across a fleet)
    if conflicts and judge(db, fingerprint).accepting:
        conflicts = []
    if conflicts:
        if server.paused and server.paused_by not in _GUARDED:
            return  # an operator's or a restart's pause: theirs to lift, not ours to relabel
        if server.paused and server.paused_by == PAUSED_BY_WEIGHTS:
            return  # paused for its new weights, and still no active run takes them
        reason = "fingerprint differs from the pinned one: " + " | ".join(conflicts)
        if pause_server(db, control, server.name, by=PAUSED_BY_FINGERPRINT, reason=reason):
            with db.begin() as conn:
                event_log.record_event(
                    conn,
                    EVENT_FINGERPRINT_MISMATCH,
                    f"{server.name} stays paused: {reason}",
                    server=server.name,
                    details={"server": fingerprint.to_json()},
                )
        return
    blocking = parity.blocking_runs(db, server, again=True) if parity is not None else []
    if blocking:
        if server.paused and server.paused_by not in _GUARDED:
            return
        _pause_for_parity(db, control, server, blocking)
        return
    if server.paused and server.paused_by in _GUARDED:
        resume_server(
            db,
            control,
            server.name,
            by=PAUSED_BY_WATCHDOG,
            reason="healthy again with the pinned fingerprint",
        )


def run_watchdog(
    db: Engine,
    settings: Settings,
    control: WorkerControl,
    prober: Prober | None = None,
    *,
    parity: ParityGate | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, str]:
    """One round: every server probed once, concurrently, never two probes to one server."""
    prober = prober or HttpProber(settings)
    thresholds = Thresholds(settings.failures_to_down, settings.successes_to_up)
    with db.connect() as conn:
        servers = registry.list_servers(conn)
    if not servers:
        return {}
    started = clock()
    results: dict[str, str] = {}
    with ThreadPoolExecutor(
        max_workers=min(PROBES_AT_ONCE, len(servers)), thread_name_prefix="tm-probe"
    ) as pool:
        futures = {
            s.name: pool.submit(
                check_server,
                db,
                control,
                prober,
                s,
                thresholds=thresholds,
                stall_s=settings.stall_s,
                parity=parity,
            )
            for s in servers
        }
        for name, future in futures.items():
            try:
                results[name] = future.result().state.value
            except Exception:
                log.exception(
                    "watchdog check of %s failed", name, extra={"action": "watchdog_failed"}
                )
                results[name] = "error"
    log.debug(
        "watchdog round over %d servers in %.2fs: %s", len(servers), clock() - started, results
    )
    return results

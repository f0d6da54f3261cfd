"""A server's weights against the runs: which active runs accept its fingerprint (the pinned
one, and a `--weight-version`), and the drift pause when its weights change under them.

Used by the watchdog (it reads /model_info on every probe), by a worker that receives a
result of other weights than its run's, and by `tokenmill update-weights`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sqlalchemy import Engine

from app.core.constants import EVENT_WEIGHTS_CHANGED, PAUSED_BY_WEIGHTS
from app.core.contracts import ServerFingerprint
from app.core.errors import NotFound
from app.ledger import database, event_log, registry
from workers.control.pausing import WorkerControl, pause_server

log = logging.getLogger(__name__)


@dataclass
class RunsVerdict:
    """The active runs that accept a fingerprint, and those that do not with the reason."""

    accepting: list[str] = field(default_factory=list)
    refusing: dict[str, list[str]] = field(default_factory=dict)

    @property
    def stranded(self) -> bool:
        """Some active run refuses these weights and none accepts them: pause the server."""
        return bool(self.refusing) and not self.accepting

    def refusals(self) -> str:
        return " | ".join(f"run {run}: " + "; ".join(d) for run, d in self.refusing.items())


def run_refusal(
    fingerprint: ServerFingerprint, pinned: dict[str, object] | None, required: str | None
) -> list[str]:
    """Why a run does not take a server of this fingerprint (empty: it does): its
    `--weight-version`, then every field of its pinned fingerprint that differs."""
    lines: list[str] = []
    if required is not None and fingerprint.weight_version != required:
        lines.append(f"weight_version: {required} → {fingerprint.weight_version}")
    if pinned is not None:
        diff = ServerFingerprint(**pinned).differences(fingerprint)  # type: ignore[arg-type]
        lines += [d for d in diff if d not in lines]
    return lines


def judge(db: Engine, fingerprint: ServerFingerprint) -> RunsVerdict:
    """The verdict of every run with unfinished items on a server of this fingerprint."""
    verdict = RunsVerdict()
    with db.connect() as conn:
        database.limit_periodic(conn)
        pins = registry.active_run_pins(conn)
    for name, pinned, required in pins:
        refusal = run_refusal(fingerprint, pinned, required)
        if refusal:
            verdict.refusing[name] = refusal
        else:
            verdict.accepting.append(name)
    return verdict


def weights_differ(before: dict[str, object] | None, now: ServerFingerprint) -> list[str]:
    """The lines naming a change of weights (model path, weight version) since `before`."""
    if not before:
        return []
    return [
        f"{key}: {before.get(key)} → {getattr(now, key)}"
        for key in ("weight_version", "model_path")
        if before.get(key) != getattr(now, key)
    ]


def note_weights(
    db: Engine,
    control: WorkerControl,
    server: str,
    fingerprint: ServerFingerprint,
    seen_by: str,
    before: dict[str, object] | None = None,
) -> RunsVerdict | None:
    """Record what a server's weights are now. When they changed (since the registry's
    fingerprint, or `before` where it has none): a `weights_changed` event naming the change,
    and the server paused (by "weights") if the active runs refuse them and none accepts
    them. Returns the verdict when they changed, else None."""
    with db.begin() as conn:
        try:
            info: registry.ServerInfo | None = registry.get_server(conn, server)
        except NotFound:  # `tokenmill run` registers no servers: the runs refuse it alone
            info = None
        known = info.fingerprint if info is not None else None
        change = weights_differ(known or before, fingerprint)
        if info is not None:
            kept = dict(known or {})
            kept.update({k: v for k, v in fingerprint.to_json().items() if v is not None})
            registry.set_fingerprint(conn, server, kept)
        if not change:
            return None
    verdict = judge(db, fingerprint)
    message = f"{server}: weights changed ({'; '.join(change)}), seen by {seen_by}"
    if verdict.accepting:
        message += f"; accepted by run(s) {', '.join(verdict.accepting)}"
    if verdict.refusing:
        message += f"; refused by {verdict.refusals()}"
    with db.begin() as conn:
        event_log.record_event(
            conn,
            EVENT_WEIGHTS_CHANGED,
            message,
            server=server,
            details={"change": change, "server": fingerprint.to_json(),
                     "accepting": verdict.accepting, "refusing": verdict.refusing},
        )  # fmt: skip
    log.warning(message, extra={"action": "weights_changed"})
    if info is None:
        return verdict
    if verdict.stranded and not (info.paused and info.paused_by != PAUSED_BY_WEIGHTS):
        pause_server(
            db,
            control,
            server,
            by=PAUSED_BY_WEIGHTS,
            reason="weights changed: " + "; ".join(change),
        )
    return verdict

"""`tokenmill update-weights`: new weights on a live server without losing an item. Pause
it, let its in-flight items finish (or give them back), `/update_weights_from_disk`, check
`/model_info`, then resume it for the runs that take the new weights.

Runs pinned to the old weights keep skipping it (their items go to the other servers); with
no active run taking the new weights, it stays paused and says which runs refuse them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine

from app.core.constants import (
    EVENT_WEIGHTS_UPDATE,
    PAUSED_BY_UPDATE,
    PAUSED_BY_WEIGHTS,
    PauseReason,
)
from app.core.errors import GenerationError
from app.core.settings import Settings
from app.ledger import event_log, registry
from workers.control.pausing import WorkerControl, pause_server, resume_server
from workers.control.weights import RunsVerdict, judge
from workers.engine.runtime import client_for


@dataclass
class UpdateResult:
    ok: bool
    message: str
    resumed: bool = False
    accepting: list[str] | None = None
    refusing: dict[str, list[str]] | None = None


def update_weights(
    db: Engine,
    settings: Settings,
    control: WorkerControl,
    name: str,
    *,
    model_path: str,
    weight_version: str | None = None,
    load_format: str | None = None,
    drain_timeout_s: float | None = None,
    poll_s: float = 0.5,
    on_progress: Callable[[str], None] = lambda line: None,
    on_drain: Callable[[int, float], None] = lambda leased, left_s: None,
) -> UpdateResult:
    """Update server `name`'s weights in place; see the module docstring. `on_progress` gets
    each step's message, `on_drain` the items still leased and the seconds the wait has left,
    every poll while it waits for them (and once as it ends)."""
    with db.connect() as conn:
        server = registry.get_server(conn, name)
    target = weight_version or model_path
    earlier_pause = server.paused_by if server.paused else None
    # a pause the watchdog does not lift: it would resume the server mid-update
    pause_server(db, control, name, by=PAUSED_BY_UPDATE, reason=f"updating weights to {target}")
    _event(db, name, f"{name}: weight update to {target} started ({model_path})")
    leased = _drain(db, name, drain_timeout_s or settings.drain_timeout_s, poll_s, on_drain)
    if leased:
        on_progress(f"{leased} requests still out: the update aborts them (their items go back)")
    client = client_for(server.url, settings)
    try:
        ok, said = client.update_weights_from_disk(
            model_path,
            weight_version=weight_version,
            load_format=load_format,
            abort_all_requests=leased > 0,
        )
        if not ok:
            return _give_up(db, name, f"the server refused the update: {said}")
        on_progress(said)
        fingerprint = client.fingerprint()
    except GenerationError as exc:
        return _give_up(db, name, f"the update call failed: {exc}")
    finally:
        client.close()
    if weight_version is not None and fingerprint.weight_version != weight_version:
        return _give_up(
            db, name, f"/model_info reports weight_version {fingerprint.weight_version}, "
            f"not {weight_version}"
        )  # fmt: skip
    with db.begin() as conn:
        registry.set_fingerprint(conn, name, fingerprint.to_json())
    verdict = judge(db, fingerprint)
    return _finish(db, control, name, fingerprint.weight_version, verdict, earlier_pause)


def _drain(
    db: Engine, name: str, timeout_s: float, poll_s: float, on_drain: Callable[[int, float], None]
) -> int:
    """Wait until none of the server's items is leased (its workers send nothing while it is
    paused and give back what waits); the number still leased when the wait ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        with db.connect() as conn:
            leased = registry.server_load(conn, name).leased
        left_s = max(0.0, deadline - time.monotonic())
        on_drain(leased, left_s)
        if leased == 0 or left_s <= 0:
            return leased
        time.sleep(min(poll_s, left_s))


def _finish(
    db: Engine,
    control: WorkerControl,
    name: str,
    version: str | None,
    verdict: RunsVerdict,
    earlier_pause: PauseReason | None,
) -> UpdateResult:
    taking = ", ".join(verdict.accepting) or "none"
    message = f"{name} serves weight_version {version}; runs that take it: {taking}"
    if verdict.refusing:
        message += f"; runs pinned to other weights skip it: {verdict.refusals()}"
    resumed = False
    if earlier_pause and earlier_pause not in (PAUSED_BY_WEIGHTS, PAUSED_BY_UPDATE):
        pause_server(db, control, name, by=earlier_pause, reason="paused before the update")
        message += f"; still paused as before ({earlier_pause})"
    elif verdict.stranded:
        pause_server(
            db, control, name, by=PAUSED_BY_WEIGHTS,
            reason=f"weight_version {version}: no active run takes it ({verdict.refusals()})",
        )  # fmt: skip
        message += "; it stays paused until a run takes these weights"
    else:
        resumed = resume_server(
            db, control, name, by=PAUSED_BY_UPDATE, reason=f"weight_version {version} loaded"
        )
        message += "; resumed"
    _event(db, name, message)
    return UpdateResult(True, message, resumed, verdict.accepting, verdict.refusing)


def _give_up(db: Engine, name: str, why: str) -> UpdateResult:
    message = (
        f"{name} stays paused: {why}. Fix it, then `tokenmill update-weights {name}` again or "
        f"`tokenmill resume --server {name}`"
    )
    _event(db, name, message)
    return UpdateResult(False, message)


def _event(db: Engine, name: str, message: str) -> None:
    with db.begin() as conn:
        event_log.record_event(conn, EVENT_WEIGHTS_UPDATE, message, server=name)

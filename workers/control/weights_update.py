"""`tokenmill update-weights`: new weights on a live server without losing an item. Pause
it, let its in-flight items finish (or give them back), `/update_weights_from_disk`, check
`/model_info`, then resume it for the runs that take the new weights.

Runs pinned to the old weights keep skipping it (their items go to the other servers); with
no active run taking the new weights, it stays paused and says which runs refuse them.

Before anything pauses it refuses a server that does not answer, and a local checkpoint path
that does not exist where the server runs (this machine: the only place tokenmill can look;
SGLang has no call that checks a path without loading it). Where the path cannot be checked,
nothing in flight is aborted: the server lets those requests finish before it loads.
"""

from __future__ import annotations

import os
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from sqlalchemy import Engine

from app.core.constants import (
    EVENT_WEIGHTS_UPDATE,
    PAUSED_BY_UPDATE,
    PAUSED_BY_WEIGHTS,
    PauseReason,
)
from app.core.errors import GenerationError
from app.core.network import is_loopback
from app.core.settings import Settings
from app.ledger import event_log, registry
from app.sglang.client import client_for
from workers.control.pausing import WorkerControl, pause_server, resume_server
from workers.control.watchdog import HttpProber, Prober
from workers.control.weights import RunsVerdict, judge


@dataclass
class UpdateResult:
    """`ok`: the server serves the new weights; `paused`: it is paused now (after a failed
    update, or updated but no run takes the weights); `again`: the command that tries again."""

    ok: bool
    message: str
    resumed: bool = False
    accepting: list[str] | None = None
    refusing: dict[str, list[str]] | None = None
    paused: bool = False
    again: str | None = None


@dataclass(frozen=True)
class UpdateRequest:
    """What to load on server `name`, as the command was given."""

    name: str
    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    drain_timeout_s: float | None = None

    def command(self) -> str:
        """The `tokenmill update-weights` command that asks for this update again."""
        argv = ["tokenmill", "update-weights", self.name, "--model-path", self.model_path]
        for option, value in (
            ("--weight-version", self.weight_version),
            ("--load-format", self.load_format),
            (
                "--drain-timeout-s",
                None if self.drain_timeout_s is None else f"{self.drain_timeout_s:g}",
            ),
        ):
            if value is not None:
                argv += [option, value]
        return shlex.join(argv)


def update_weights(
    db: Engine,
    settings: Settings,
    control: WorkerControl,
    request: UpdateRequest,
    *,
    poll_s: float = 0.5,
    prober: Prober | None = None,
    on_progress: Callable[[str], None] = lambda line: None,
    on_drain: Callable[[int, float], None] = lambda leased, left_s: None,
) -> UpdateResult:
    """Update a server's weights in place; see the module docstring. `on_progress` gets
    each step's message, `on_drain` the items still leased and the seconds the wait has left,
    every poll while it waits for them (and once as it ends)."""
    name, model_path = request.name, request.model_path
    with db.connect() as conn:
        server = registry.get_server(conn, name)
    refusal = _preflight(server, model_path, prober or HttpProber(settings))
    if refusal is not None:
        why, as_is = refusal
        again = request.command() if as_is else None
        return UpdateResult(False, f"{why}; nothing was paused", again=again)
    checked = path_checked_here(server, model_path)
    target = request.weight_version or model_path
    earlier_pause = server.paused_by if server.paused else None
    # a pause the watchdog does not lift: it would resume the server mid-update
    pause_server(db, control, name, by=PAUSED_BY_UPDATE, reason=f"updating weights to {target}")
    _event(db, name, f"{name}: weight update to {target} started ({model_path})")
    timeout_s = request.drain_timeout_s or settings.drain_timeout_s
    leased = _drain(db, name, timeout_s, poll_s, on_drain)
    if leased and checked:
        on_progress(f"{leased} requests still out: the update aborts them (their items go back)")
    elif leased:
        on_progress(
            f"{leased} requests still out: {model_path} cannot be checked from here, so none is "
            "aborted; the server lets them finish, then loads"
        )
    client = client_for(server.url, settings)
    try:
        ok, said = client.update_weights_from_disk(
            model_path,
            weight_version=request.weight_version,
            load_format=request.load_format,
            abort_all_requests=leased > 0 and checked,
        )
        if not ok:
            return _give_up(db, request, f"the server refused the update: {said}")
        on_progress(said)
        fingerprint = client.fingerprint()
    except GenerationError as exc:
        return _give_up(db, request, f"the update call failed: {exc}")
    finally:
        client.close()
    if request.weight_version is not None and fingerprint.weight_version != request.weight_version:
        # the server loaded the weights and ignored the version: the same command would too
        return _give_up(
            db, request, f"/model_info reports weight_version {fingerprint.weight_version}, "
            f"not {request.weight_version}", again=False,
        )  # fmt: skip
    with db.begin() as conn:
        registry.set_fingerprint(conn, name, fingerprint.to_json())
    verdict = judge(db, fingerprint)
    return _finish(db, control, name, fingerprint.weight_version, verdict, earlier_pause)


def _preflight(
    server: registry.ServerInfo, model_path: str, prober: Prober
) -> tuple[str, bool] | None:
    """Why the update must not start (None: it may), and whether the same command can work once
    that is fixed: the server does not answer (start it, then again), or the path is local to it
    and missing (a command with the right path is another command)."""
    probe = prober.probe(server)
    if not probe.ok:
        return (
            f"{server.name} does not answer ({probe.error or 'down'}): start it (or `tokenmill "
            f"restart {server.name}`), then update its weights",
            True,
        )
    if path_checked_here(server, model_path) and not os.path.exists(model_path):
        return (
            f"--model-path {model_path} does not exist on {server.name} (it runs on this "
            "machine, where the path was looked for): give the path of a checkpoint there",
            False,
        )
    return None


def path_checked_here(server: registry.ServerInfo, model_path: str) -> bool:
    """Whether tokenmill can tell if the server has the path: a local path (absolute or
    relative; anything else is a hub id) and a server on this machine."""
    if not model_path.startswith(("/", ".")):
        return False
    host = urlsplit(server.url).hostname or ""
    return is_loopback(host) or host in {socket.gethostname(), socket.getfqdn()}


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
    resumed, paused = False, True
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
        paused = False
    _event(db, name, message)
    return UpdateResult(True, message, resumed, verdict.accepting, verdict.refusing, paused)


def _give_up(db: Engine, request: UpdateRequest, why: str, *, again: bool = True) -> UpdateResult:
    """The update failed after the pause; again: whether the same command can work once the
    cause is fixed (it is printed to run), or would fail the same way (it is not)."""
    name = request.name
    if not again:
        message = f"{name} stays paused: {why}. `tokenmill resume --server {name}` resumes it"
        _event(db, name, message)
        return UpdateResult(False, message, paused=True)
    message = (
        f"{name} stays paused: {why}. Fix it and update again, or `tokenmill resume --server "
        f"{name}`"
    )
    _event(db, name, f"{message}; to update again: {request.command()}")
    return UpdateResult(False, message, paused=True, again=request.command())


def _event(db: Engine, name: str, message: str) -> None:
    with db.begin() as conn:
        event_log.record_event(conn, EVENT_WEIGHTS_UPDATE, message, server=name)

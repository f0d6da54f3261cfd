"""Restarting one SGLang server safely: pause its workers, run its restart command (an
argument list, never a shell), wait for readiness, check the fingerprint, then resume.

A timeout or a changed fingerprint leaves the server paused and says why. "restarted" is said
only when the server was seen to go away and come back; once it is back, each active run it
may serve is set against what it reports (model, weights, limits), and a run it no longer fits
is named, not "resumed".
"""

from __future__ import annotations

import shlex
import string
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from sqlalchemy import Engine

from app.core.constants import EVENT_RESTART, PAUSED_BY_RESTART, PauseReason
from app.core.errors import ConfigurationError, GenerationError
from app.core.settings import Settings
from app.ledger import event_log, registry
from workers.control.health import Health
from workers.control.pausing import WorkerControl, pause_server, resume_server
from workers.control.run_fit import run_fits
from workers.control.watchdog import HttpProber, Probe, Prober, fingerprint_conflicts

PLACEHOLDERS = frozenset({"name", "url", "host", "port"})


def parse_command(text: str) -> list[str]:
    """A restart command from the CLI: a JSON list of arguments, or a shell-like string that
    is split into arguments (it is never run by a shell)."""
    import json

    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigurationError(f"--restart-command is not a valid JSON list: {exc}") from exc
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigurationError("--restart-command as JSON must be a list of strings")
        argv = value
    else:
        try:
            argv = shlex.split(text)
        except ValueError as exc:
            raise ConfigurationError(f"--restart-command cannot be split: {exc}") from exc
    if not argv:
        raise ConfigurationError("--restart-command is empty")
    validate_placeholders(argv)
    return argv


def validate_placeholders(argv: list[str]) -> None:
    for arg in argv:
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(arg) if f is not None]
        except ValueError as exc:
            raise ConfigurationError(f"restart command argument {arg!r}: {exc}") from exc
        for name in fields:
            if name not in PLACEHOLDERS:
                raise ConfigurationError(
                    f"restart command argument {arg!r} uses {{{name}}}; allowed placeholders: "
                    + ", ".join(f"{{{p}}}" for p in sorted(PLACEHOLDERS))
                )


def render_command(argv: list[str], server: registry.ServerInfo) -> list[str]:
    parts = urlsplit(server.url)
    values = {
        "name": server.name,
        "url": server.url,
        "host": parts.hostname or "",
        "port": str(parts.port or (443 if parts.scheme == "https" else 80)),
    }
    validate_placeholders(argv)
    return [arg.format(**values) for arg in argv]


@dataclass
class RestartProgress:
    elapsed_s: float
    phase: str
    probe: str
    successes: int
    log_path: Path


@dataclass
class RestartResult:
    ok: bool
    message: str
    elapsed_s: float
    log_path: Path | None = None  # where the restart command's output went
    # once the server is back: each active run it may serve, pinned against what it reports
    runs: list[str] = field(default_factory=list)


class RestartProber(Prober, Protocol):
    """A prober that also tells when the server's process started (a restart changes it)."""

    def started_at(self, server: registry.ServerInfo) -> float | None: ...


def restart_server(
    db: Engine,
    settings: Settings,
    control: WorkerControl,
    name: str,
    *,
    command: list[str] | None = None,
    timeout_s: float | None = None,
    poll_s: float = 2.0,
    log_dir: Path | None = None,
    prober: RestartProber | None = None,
    on_progress: Callable[[RestartProgress], None] = lambda p: None,
) -> RestartResult:
    """Pause the server, run its restart command, wait until it is ready, and resume it; ok
    only when it was seen to go away and come back (a probe failed, or its process started
    anew) and it fits every active run it serves."""
    with db.connect() as conn:
        server = registry.get_server(conn, name)
    argv = command or server.restart_command
    if not argv:
        raise ConfigurationError(
            f"server {name} has no restart command: pass --command, or register one with "
            f"`tokenmill servers add {name} {server.url} --restart-command ...`"
        )
    argv = render_command(argv, server)
    prober = prober or HttpProber(settings)
    timeout_s = timeout_s or settings.restart_timeout_s
    started = time.monotonic()
    was_paused_by = server.paused_by if server.paused else None
    started_before = prober.started_at(server)
    pause_server(db, control, name, by=PAUSED_BY_RESTART, reason="restart in progress")
    with db.begin() as conn:
        event_log.record_event(
            conn,
            EVENT_RESTART,
            f"{name}: restart started: {shlex.join(argv)}",
            server=name,
            details={"argv": argv},
        )
    log_dir = log_dir or settings.data_dir / "restarts"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.log"

    def give_up(why: str) -> RestartResult:
        return _give_up(db, name, started, why, log_path)

    with log_path.open("ab") as log_file:
        try:
            process = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            return give_up(f"restart command could not start: {exc}")
    _reap_when_done(process)  # from here its exit code is process.returncode
    successes = 0
    needed = settings.successes_to_up
    went_away = False
    while True:
        elapsed = time.monotonic() - started
        code = process.returncode
        if code not in (None, 0):
            tail = log_path.read_text(errors="replace")[-500:].strip()
            return give_up(f"restart command exited with code {code}: {tail or '(no output)'}")
        probe = prober.probe(server)
        went_away = went_away or not probe.ok
        successes = successes + 1 if probe.ok else 0
        _note_probe(db, name, probe, _restart_state(probe, successes, needed))
        phase = "command running" if code is None else "waiting for the server"
        on_progress(
            RestartProgress(
                elapsed, phase, "ok" if probe.ok else (probe.error or "down"), successes, log_path
            )
        )
        if successes >= needed:
            break
        if elapsed > timeout_s:
            return give_up(f"not ready after {timeout_s:.0f}s (last probe: {probe.error})")
        time.sleep(poll_s)
    came_back = went_away or prober.started_at(server) not in (None, started_before)
    return _back(db, control, server, prober, started, came_back, was_paused_by, log_path)


def _back(
    db: Engine,
    control: WorkerControl,
    server: registry.ServerInfo,
    prober: RestartProber,
    started: float,
    came_back: bool,
    was_paused_by: PauseReason | None,
    log_path: Path,
) -> RestartResult:
    """The server answers again: record its fingerprint, set each active run it may serve
    against it, resume it (or keep the pause it had before), and say what happened."""
    name = server.name
    try:
        fingerprint = prober.fingerprint(server)
    except GenerationError as exc:
        return _give_up(
            db, name, started, f"ready, but its fingerprint is unreadable: {exc}", log_path
        )
    with db.begin() as conn:
        registry.set_fingerprint(conn, name, fingerprint.to_json())
        conflicts = fingerprint_conflicts(fingerprint, registry.active_run_fingerprints(conn))
        fits = run_fits(conn, name, fingerprint)
    if conflicts:
        why = "fingerprint differs from the pinned one: " + " | ".join(conflicts)
        return _give_up(db, name, started, why, log_path)
    elapsed = time.monotonic() - started
    if was_paused_by and was_paused_by != PAUSED_BY_RESTART:
        # it was paused before the restart (e.g. by an operator): keep that pause
        pause_server(db, control, name, by=was_paused_by, reason="paused before the restart")
        after = f"still paused as before ({was_paused_by})"
    else:
        resume_server(db, control, name, by=PAUSED_BY_RESTART, reason=f"ready after {elapsed:.0f}s")
        after = "resumed"
    misfits = [f.run for f in fits if f.misfit is not None]
    if not came_back:
        message = (
            f"{name} never went down: it answered throughout and its process did not start "
            f"anew (check the restart command); {after}"
        )
    elif misfits:
        message = (
            f"{name} restarted after {elapsed:.0f}s but no longer fits run "
            f"{', '.join(misfits)}: its workers leave those items to the other servers "
            f"(fix its launch flags, then `tokenmill restart {name}` again)"
        )
    elif after == "resumed":
        message = f"{name} restarted and resumed after {elapsed:.0f}s"
    else:
        message = f"{name} restarted in {elapsed:.0f}s; {after}"
    with db.begin() as conn:
        event_log.record_event(
            conn, EVENT_RESTART, message, server=name, details={"runs": [f.line for f in fits]}
        )
    ok = came_back and not misfits
    return RestartResult(ok, message, elapsed, log_path, runs=[f.line for f in fits])


def _reap_when_done(process: subprocess.Popen[bytes]) -> None:
    """A daemon thread waits for the restart command, which may outlive the restart (it may run
    the server itself): its exit is collected (no zombie, no Popen dropped while running)."""
    threading.Thread(target=process.wait, name=f"reap-{process.pid}", daemon=True).start()


def _note_probe(db: Engine, name: str, probe: Probe, state: str) -> None:
    """`tokenmill servers` shows what the restart saw, and `tokenmill events` its state changes
    (healthy → down as the command takes the server away, … → healthy as it comes back)."""
    with db.begin() as conn:
        registry.note_probe(
            conn,
            name,
            state=state,
            ok=probe.ok,
            latency_s=probe.latency_s,
            error=probe.error,
            by="restart",
        )


def _restart_state(probe: Probe, successes: int, needed: int) -> str:
    """The state a restart's probe shows: down until it answers, recovering until it answered
    often enough, then healthy; auth when it refuses our key."""
    if probe.auth:
        return Health.AUTH.value
    if not probe.ok:
        return Health.DOWN.value
    return (Health.HEALTHY if successes >= needed else Health.RECOVERING).value


def _give_up(db: Engine, name: str, started: float, why: str, log_path: Path) -> RestartResult:
    elapsed = time.monotonic() - started
    message = (
        f"{name} stays paused: {why}. Fix it, then `tokenmill resume --server {name}` "
        f"or `tokenmill restart {name}` again"
    )
    with db.begin() as conn:
        event_log.record_event(conn, EVENT_RESTART, message, server=name)
    return RestartResult(False, message, elapsed, log_path)

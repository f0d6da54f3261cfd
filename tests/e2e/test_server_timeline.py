"""A server's timeline under a Celery worker and beat (its watchdog), as `tokenmill events` shows
it: a SIGTERM-and-start of the server and a `tokenmill restart` each read healthy → … down … →
healthy once, every change recorded by one writer (the registry's guarded change of state, which
the worker's probe, the watchdog and the restart share), none twice, none contradicting the one
before it."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.core.constants import EVENT_STATE
from app.ledger import registry
from tests.support.emulator import free_port
from tests.support.procs import service_env, start_celery, start_worker, stop, tokenmill, wait_for

pytestmark = pytest.mark.e2e

NAME = "gpu-a"
# start (or restart) the emulator on a port, detached, its pid in a file: SIGTERM the one the
# file names, wait for its port to close, then start the next; used by the test and as the
# server's restart command
RELAUNCH = """
import os, signal, socket, subprocess, sys, time
pid_file, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if os.path.exists(pid_file):
    os.kill(int(open(pid_file).read()), signal.SIGTERM)
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                break
        time.sleep(0.05)
emulator = [sys.executable, "-m", "emulator", "--port", str(port), "--loading-s", "1"]
with open(log, "ab") as out:
    server = subprocess.Popen(
        emulator, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
with open(pid_file, "w") as pid_out:
    pid_out.write(str(server.pid))
"""


class Fleet:
    """One emulator (relaunched by RELAUNCH), its worker and beat."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env, self.tmp, self.port = env, tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.script = tmp / "relaunch.py"
        self.script.write_text(RELAUNCH)
        self.pid_file = tmp / "emulator.pid"
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def command(self) -> list[str]:
        log = str(self.tmp / "emulator.log")
        return [sys.executable, str(self.script), str(self.pid_file), str(self.port), log]

    def launch(self) -> None:
        subprocess.run(self.command, check=True, timeout=60)

    def pid(self) -> int:
        return int(self.pid_file.read_text())

    def listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def start_services(self) -> None:
        worker_env = self.env | {"TOKENMILL_SGLANG_URL": self.url, "TOKENMILL_SERVER_NAME": NAME}
        self.procs.append(start_worker(worker_env, "wa", self.tmp / "wa.log"))
        self.procs.append(start_celery("beat", self.env, self.tmp / "beat.log"))

    def stop(self) -> None:
        stop(self.procs)
        if self.pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid(), signal.SIGKILL)


@pytest.fixture
def fleet(pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Fleet]:
    env = service_env(
        pg_url,
        redis_url,
        tmp_path / "data",
        TOKENMILL_WATCHDOG_INTERVAL_S="1",
        TOKENMILL_PAUSE_CHECK_S="0.5",
    )
    fleet = Fleet(env, tmp_path)
    try:
        fleet.launch()
        fleet.start_services()
        yield fleet
    finally:
        fleet.stop()


def server(db: Engine) -> registry.ServerInfo:
    with db.connect() as conn:
        return registry.get_server(conn, NAME)


def serving(db: Engine) -> bool:
    """Healthy and taking work, as the ledger has it."""
    with db.connect() as conn:
        found = {s.name: s for s in registry.list_servers(conn)}
    s = found.get(NAME)
    return s is not None and s.state == "healthy" and not s.paused


def timeline(db: Engine) -> list[registry.EventInfo]:
    """The server's events, oldest first."""
    with db.connect() as conn:
        return registry.list_events(conn, server=NAME, limit=10_000)


def state_changes(db: Engine, after: int) -> list[registry.EventInfo]:
    """The state changes among the server's events after the first `after`."""
    return [e for e in timeline(db)[after:] if e.kind == EVENT_STATE]


def assert_one_way_down_and_up(changes: list[registry.EventInfo]) -> list[str]:
    """healthy → … down … → healthy, once: each change starts where the one before it ended,
    healthy is left once and reached once (at the end), no change is recorded twice; the
    states passed through."""
    moves = [((e.details or {})["from"], (e.details or {})["to"]) for e in changes]
    path = [moves[0][0], *(to for _, to in moves)] if moves else []
    shown = "\n".join(e.message for e in changes)
    assert moves and moves[0][0] == "healthy" and moves[-1][1] == "healthy", shown
    assert all(a[1] == b[0] for a, b in itertools.pairwise(moves)), shown
    assert path.count("healthy") == 2 and "down" in path, shown
    assert all(
        e.message.startswith(f"{NAME}: {a} → {b}") for e, (a, b) in zip(changes, moves, strict=True)
    ), shown
    writers = {(e.details or {}).get("by") for e in changes}
    assert writers <= {"worker", "watchdog", "restart"}, writers
    return path


def test_a_sigterm_and_start_reads_down_and_up_once(fleet: Fleet, pg_engine: Engine) -> None:
    wait_for("the server healthy", lambda: serving(pg_engine), 60)
    mark = len(timeline(pg_engine))
    os.kill(fleet.pid(), signal.SIGTERM)
    wait_for("the server gone", lambda: not fleet.listening(), 30)
    wait_for("the server down in the ledger", lambda: server(pg_engine).state == "down", 30)
    fleet.pid_file.unlink()
    fleet.launch()  # started again on the same port
    wait_for("the server healthy again", lambda: serving(pg_engine), 60)
    changes = state_changes(pg_engine, mark)
    assert_one_way_down_and_up(changes)
    shown = tokenmill(["events", "--server", NAME, "--json"], fleet.env)
    assert shown.returncode == 0, shown.stderr
    listed = [e["message"] for e in json.loads(shown.stdout) if e["kind"] == EVENT_STATE]
    assert listed[-len(changes) :] == [e.message for e in changes]


def test_a_restart_reads_down_and_up_once(fleet: Fleet, pg_engine: Engine) -> None:
    wait_for("the server healthy", lambda: serving(pg_engine), 60)
    mark = len(timeline(pg_engine))
    args = ["restart", NAME, "--command", json.dumps(fleet.command), "--poll-s", "0.5"]
    restarted = tokenmill([*args, "--timeout-s", "60"], fleet.env, timeout_s=120)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    wait_for("the server healthy again", lambda: serving(pg_engine), 60)
    path = assert_one_way_down_and_up(state_changes(pg_engine, mark))
    assert "draining" not in path[path.index("down") :], path  # a starting server is no drain

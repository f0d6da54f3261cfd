"""`tokenmill status --watch` in a real terminal: tmux runs it, capture-pane reads the screen,
the screen follows the ledger, and Ctrl-C ends it with exit code 0 and no traceback."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, update

from app.ledger import common, database, migrate
from tests.support.procs import ROOT, clean_env, tokenmill
from tests.support.runs import seed_fleet

TMUX = shutil.which("tmux")
SESSION = "watch"

pytestmark = pytest.mark.e2e
needs_tmux = pytest.mark.skipif(
    TMUX is None, reason="tmux is not installed (apt-get install -y tmux)"
)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[list[str]]:
    """A private tmux server (its own socket, no user config), killed afterwards."""
    assert TMUX is not None
    base = [TMUX, "-S", str(tmp_path / "tmux.sock"), "-f", "/dev/null"]
    yield base
    subprocess.run([*base, "kill-server"], capture_output=True, timeout=10)


def wait_for(check: Callable[[], str | None], what: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last is not None:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def seeded(tmp_path: Path) -> tuple[Engine, dict[str, str]]:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    engine = database.make_engine(url)
    migrate.upgrade(engine)
    with engine.begin() as conn:
        seed_fleet(conn, common.utcnow())
    return engine, clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=url)


def test_json_keeps_its_keys_and_refuses_watch(tmp_path: Path) -> None:
    engine, env = seeded(tmp_path)
    engine.dispose()
    counts = json.loads(tokenmill(["status", "r2", "--json"], env).stdout)
    assert counts == {
        "run": "r2",
        "total": 1,
        "waiting": 0,
        "pending": 0,
        "queued": 0,
        "leased": 0,
        "done": 1,
        "failed": 0,
        "truncated": 0,
        "output_tokens": 50,
        "prompt_tokens": 10,
        "rendering_differs": [],
        "enqueue_stopped": False,
        "served_by": {"driver": "fleet", "servers": None},
        "not_served_by": {},  # server → why, for servers that do not serve the run
        "priority": 0,  # the default: `tokenmill priority r2 N` changes it
        "failed_by_reason": {},
        "chain_endings": {},  # an agentic --turns all run's chains by how they ended
    }
    both = tokenmill(["status", "--watch", "--json"], env)
    assert both.returncode == 2 and "use --json without it" in both.stderr


@needs_tmux
def test_watch_draws_follows_the_ledger_and_exits_0_on_ctrl_c(
    tmp_path: Path, tmux: list[str]
) -> None:
    engine, env = seeded(tmp_path)
    exit_file = tmp_path / "exit_code"
    command = (
        f"{shlex.quote(sys.executable)} -m ops status --watch --interval-s 0.5; "
        f"echo $? > {shlex.quote(str(exit_file))}; exec sleep 60"  # keep the pane to read it
    )
    settings = [f"-e{k}={v}" for k, v in env.items() if k.startswith("TOKENMILL_")]
    session = ["new-session", "-d", "-s", SESSION, "-x", "150", "-y", "45", "-c", str(ROOT)]
    subprocess.run(
        [*tmux, *session, *settings, "bash", "-c", command],
        env=env,
        check=True,
        timeout=10,
    )

    def screen() -> str:
        return subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", SESSION],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout

    def showing(text: str) -> Callable[[], str | None]:
        return lambda: s if text in (s := screen()) else None

    first = wait_for(showing("latest events"), "the dashboard")
    for expected in ("tokenmill status", "6/10", "gpu-a", "yes (operator)", "unregistered"):
        assert expected in first, first
    assert "gpu-a paused by operator: maintenance" in first

    with engine.begin() as conn:  # one more item finishes: the next tick shows it
        conn.execute(
            update(common.items)
            .where(common.items.c.item_key == "l1")
            .values(
                status="done",
                completion_tokens=64,
                output_ids=[2] * 64,
                finish_reason="stop",
                latency_s=1.5,
                finished_at=common.utcnow(),
            )
        )
    later = wait_for(showing("7/10"), "the next refresh")
    assert later.count("tokenmill status") == 1, later  # redrawn in place, not appended

    subprocess.run([*tmux, "send-keys", "-t", SESSION, "C-c"], check=True, timeout=10)
    code = wait_for(
        lambda: exit_file.read_text().strip() if exit_file.exists() else None, "the exit"
    )
    final = screen()
    assert code == "0", final
    assert "Traceback" not in final and "Aborted" not in final, final
    engine.dispose()

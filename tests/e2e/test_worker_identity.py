"""Real `celery -A app worker` processes named by the rule: the README's one-line command on a
node, then a second worker with the same Celery name, and one on another node claiming the same
server, each refused at start with one line that says how to name it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.ledger import registry
from ops.emulator_proc import EmulatorProcess, start_emulator
from tests.support.procs import ROOT, service_env, start_celery, stop, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def emulator() -> Iterator[EmulatorProcess]:
    emu = start_emulator(["--step-ms", "1", "--median-tokens", "20"])
    yield emu
    emu.stop()


def refused(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app", "worker", "-E"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_workers_are_named_by_their_node_and_clashes_are_refused(
    pg_url: str, pg_engine: Engine, redis_url: str, emulator: EmulatorProcess, tmp_path: Path
) -> None:
    port = emulator.url.rsplit(":", 1)[1]
    local = f"http://localhost:{port}"
    node_a = service_env(
        pg_url, redis_url, tmp_path, TOKENMILL_SGLANG_URL=local, TOKENMILL_NODE_NAME="gpu-a"
    )
    log = tmp_path / "worker-a.log"
    first = start_celery("worker", node_a, log, "-E")
    name = f"gpu-a:{port}"

    def registered() -> bool:
        assert first.poll() is None, log.read_text()
        with pg_engine.connect() as conn:
            server = registry.find_server(conn, name)
        return server is not None and server.workers == [f"{name}@gpu-a"]

    try:
        wait_for(f"worker {name}@gpu-a registered", registered, 90, log.read_text)
        with pg_engine.connect() as conn:
            server = registry.get_server(conn, name)
        assert (server.node, server.url, server.worker_url) == ("gpu-a", local, local)

        twin = refused(node_a)
        assert f"error: a worker named {name}@gpu-a is already running" in twin.stderr
        assert f"-n {name}-2@gpu-a" in twin.stderr

        node_b = node_a | {"TOKENMILL_NODE_NAME": "gpu-b", "TOKENMILL_SERVER_NAME": name}
        other = refused(node_b)
        assert f"error: server {name} is served from node gpu-a" in other.stderr
        assert "this worker runs on node gpu-b" in other.stderr
        assert "TOKENMILL_NODE_NAME=gpu-a" in other.stderr
    finally:
        stop([first])
    # the refused workers left the registry as it was
    with pg_engine.connect() as conn:
        assert [s.name for s in registry.list_servers(conn)] == [name]
        assert registry.get_server(conn, name).node == "gpu-a"

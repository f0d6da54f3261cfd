"""A worker's Postgres connections do not grow with its window: `celery -A app worker` with the
default window (auto) on a 256-slot emulator, a run keeping its window full, holds at most
TOKENMILL_DB_POOL's default of 4 connections, each named after the worker (pg_stat_activity's
application_name), and never takes a second connection on a thread that holds one."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from app.ledger import registry
from ops.emulator_proc import EmulatorProcess, start_emulator
from tests.e2e.test_auto_window import TOP, auto_env, enqueue, finished, window_of
from tests.support.procs import start_worker, stop, wait_for

pytestmark = pytest.mark.e2e

SLOTS = 256
DEFAULT_POOL = 4
# requests stay on the server a while, so the window fills to its 272 and stays full
EMULATOR = ["--step-ms", "20", "--median-tokens", "30", "--sigma", "0.5", "--log-level", "WARNING"]


@pytest.fixture
def server() -> Iterator[EmulatorProcess]:
    emu = start_emulator(["--max-running", str(SLOTS), *EMULATOR])
    yield emu
    emu.stop()


class ConnectionWatch:
    """Samples pg_stat_activity of the test's database in a thread: the most connections each
    application_name held at once."""

    def __init__(self, db: Engine) -> None:
        self.db = db
        self.peak: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        query = text(
            "SELECT application_name, count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "GROUP BY application_name"
        )
        with self.db.connect() as conn:
            while not self._stop.is_set():
                with conn.begin():
                    for name, count in conn.execute(query):
                        self.peak[name] = max(self.peak[name], count)
                self.samples += 1
                self._stop.wait(0.05)

    def __enter__(self) -> ConnectionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_worker_on_a_256_slot_server_holds_at_most_four_connections(
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    server: EmulatorProcess,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    env = auto_env(pg_url, redis_url, tmp_path, server.url) | {"TOKENMILL_SERVER_NAME": "gpu-a:1"}
    log = tmp_path / "worker.log"
    worker = start_worker(env, "w0", log)
    try:

        def registered() -> bool:
            with pg_engine.connect() as conn:
                return any(s.workers for s in registry.list_servers(conn))

        wait_for("the worker registered", registered, 120, log.read_text)
        with ConnectionWatch(pg_engine) as watch:
            enqueue(env, kimi_tokenizer_dir, "r1", samples=40)
            wait_for(
                "the window sized by the 256-slot server",
                lambda: (window_of(env, "gpu-a:1") or {}).get("size") == TOP,
                120,
                lambda: str(window_of(env, "gpu-a:1")),
            )
            wait_for("the run finished", lambda: finished(pg_engine, "r1"), 300, log.read_text)
        assert watch.samples > 10
        print(f"most connections held at once, by application_name: {dict(watch.peak)}")
        held = watch.peak["tokenmill-worker gpu-a:1"]
        assert 2 <= held <= DEFAULT_POOL, dict(watch.peak)
        assert "nested_checkout" not in log.read_text() and "took a second" not in log.read_text()
    finally:
        stop([worker])

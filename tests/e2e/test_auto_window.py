"""TOKENMILL_INFLIGHT=auto for real: `celery -A app worker` processes with no TOKENMILL_INFLIGHT
size their windows by the emulator's /server_info and /v1/loads. Two workers on one 256-slot
server keep at most its capacity + margin in flight together; a restart of the server with a
smaller --max-running-requests resizes the window of a worker that keeps running, and the task
messages it reserves (its Celery prefetch) follow the window down."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from celery import Celery
from sqlalchemy import Engine

from app.ledger import registry
from ops.emulator_proc import EmulatorProcess, start_emulator
from tests.support.procs import ROOT, service_env, start_worker, stop, tokenmill, wait_for
from workers.engine import prefetch, sizing

pytestmark = pytest.mark.e2e

PROMPTS = ROOT / "emulator" / "data" / "demo_prompts.jsonl"
SLOTS = 256
TOP = SLOTS + sizing.margin_for(SLOTS)  # 272
# slow decode steps: requests stay on the server long enough to pile up if a window overshot
EMULATOR = ["--step-ms", "20", "--median-tokens", "30", "--sigma", "0.5", "--log-level", "WARNING"]


def auto_env(pg_url: str, redis_url: str, folder: Path, url: str) -> dict[str, str]:
    """The README's worker settings: no TOKENMILL_INFLIGHT (auto) and the default batch size;
    the load read often, so the test sees the sizer's moves quickly."""
    env = service_env(pg_url, redis_url, folder, TOKENMILL_SGLANG_URL=url)
    for name in ("TOKENMILL_INFLIGHT", "TOKENMILL_BATCH_SIZE"):
        env.pop(name, None)
    return env | {"TOKENMILL_AUTOSIZE_PROBE_S": "0.25", "TOKENMILL_HEARTBEAT_S": "2"}


def servers_json(env: dict[str, str]) -> dict[str, dict[str, object]]:
    done = tokenmill(["servers", "--json"], env)
    assert done.returncode == 0, done.stderr
    return {s["name"]: s for s in json.loads(done.stdout)}


def window_of(env: dict[str, str], server: str) -> dict[str, object] | None:
    found = servers_json(env).get(server, {}).get("window")
    return found if isinstance(found, dict) else None


class LoadWatch:
    """Reads the emulator's /v1/loads in a thread: the most requests it ever held."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak = 0
        self.readings = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10.0, trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    load = client.get("/v1/loads", params={"include": "core"}).json()["loads"][0]
                except httpx.HTTPError:
                    continue
                held = load["num_running_reqs"] + load["num_waiting_reqs"]
                self.peak = max(self.peak, held)
                self.readings += 1
                self._stop.wait(0.05)

    def __enter__(self) -> LoadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def server() -> Iterator[EmulatorProcess]:
    emu = start_emulator(["--max-running", str(SLOTS), *EMULATOR])
    yield emu
    emu.stop()


def enqueue(env: dict[str, str], tokenizer: Path, run: str, samples: int) -> None:
    args = ["enqueue", str(PROMPTS), "--run", run, "--tokenizer", str(tokenizer)]
    args += ["--max-new-tokens", "60", "--samples-per-prompt", str(samples)]
    done = tokenmill(args, env)
    assert done.returncode == 0, done.stderr


def finished(db: Engine, run: str) -> bool:
    from app.ledger import reads, run_queries

    with db.connect() as conn:
        counts = reads.run_counts(conn, run_queries.get_run(conn, run))
    return bool(counts.total and counts.finished and counts.failed == 0)


def test_two_workers_on_one_server_share_its_capacity(
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    server: EmulatorProcess,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    env = auto_env(pg_url, redis_url, tmp_path, server.url)
    name = f"{server.url.split('//')[1].split(':')[0]}"
    workers = [start_worker(env, f"w{i}", tmp_path / f"worker{i}.log") for i in range(2)]
    try:
        # both workers registered before any work: each sizes by the other from the start

        def registered() -> bool:
            with pg_engine.connect() as conn:
                return any(len(s.workers) == 2 for s in registry.list_servers(conn))

        wait_for("two workers registered", registered, 120)
        with pg_engine.connect() as conn:
            name = next(s.name for s in registry.list_servers(conn) if len(s.workers) == 2)
        with LoadWatch(server.url) as watch:
            enqueue(env, kimi_tokenizer_dir, "shared", samples=60)
            wait_for(
                "the two windows sized by the server",
                lambda: (
                    (window_of(env, name) or {}).get("workers") == 2
                    and (window_of(env, name) or {}).get("size") == TOP
                ),
                120,
                lambda: str(window_of(env, name)),
            )
            seen = window_of(env, name)
            wait_for("the run finished", lambda: finished(pg_engine, "shared"), 300)
        assert seen is not None
        assert seen["text"] == f"auto: {TOP} (max_running {SLOTS})"
        assert seen["max_running"] == SLOTS and seen["mode"] == "auto"
        assert watch.readings > 10
        # together they kept the batch full and at most the margin queued, never 2x
        assert SLOTS <= watch.peak <= TOP, watch.peak
        listed = tokenmill(["servers"], env)
        assert f"auto: {TOP} requests (max_running {SLOTS})" in listed.stdout, listed.stdout
    finally:
        stop(workers)


def prefetch_count(redis_url: str, worker: str) -> int | None:
    """The worker's prefetch count as `celery inspect stats` reports it (None: no answer)."""
    stats = Celery(broker=redis_url).control.inspect(timeout=3.0).stats() or {}
    found = [v["prefetch_count"] for k, v in stats.items() if k.startswith(f"{worker}@")]
    return int(found[0]) if found else None


def test_a_restart_with_a_smaller_batch_resizes_the_running_worker(
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    emu = start_emulator(["--max-running", str(SLOTS), *EMULATOR])
    port = emu.url.rsplit(":", 1)[1]
    env = auto_env(pg_url, redis_url, tmp_path, emu.url)
    worker = start_worker(env, "w0", tmp_path / "worker0.log")
    smaller: EmulatorProcess | None = None
    try:
        enqueue(env, kimi_tokenizer_dir, "before", samples=2)
        wait_for("the first run finished", lambda: finished(pg_engine, "before"), 300)
        with pg_engine.connect() as conn:
            name = registry.list_servers(conn)[0].name
        wait_for(
            "the window sized by the 256-slot server",
            lambda: (window_of(env, name) or {}).get("size") == TOP,
            60,
            lambda: str(window_of(env, name)),
        )
        threads = 4  # the default TOKENMILL_WORKER_THREADS: 340 items take every thread
        wait_for(
            "the prefetch of a 272 window",
            lambda: prefetch_count(redis_url, "w0") == threads,
            30,
            lambda: str(prefetch_count(redis_url, "w0")),
        )
        emu.stop()
        smaller = start_emulator(["--port", port, "--max-running", "16", *EMULATOR])
        small = 16 + sizing.margin_for(16)  # 20, with a backlog of one message: 52 items
        wait_for(
            "the window sized by the 16-slot server, the worker still running",
            lambda: (window_of(env, name) or {}).get("size") == small,
            120,
            lambda: str(window_of(env, name)),
        )
        want = prefetch.messages_for(small + 32, batch_size=32, threads=threads)
        assert want == 2
        wait_for(
            "the prefetch following the window down",
            lambda: prefetch_count(redis_url, "w0") == want,
            30,
            lambda: str(prefetch_count(redis_url, "w0")),
        )
        assert worker.poll() is None
        assert (window_of(env, name) or {}).get("reason") == sizing.REASON_CAPACITY
        events = tokenmill(["events", "--json"], env)
        assert events.returncode == 0, events.stderr
        resizes = [e for e in json.loads(events.stdout) if e["kind"] == "window_resized"]
        assert any(e["details"]["size"] == small for e in resizes), resizes
        # and the next run goes through the smaller window
        enqueue(env, kimi_tokenizer_dir, "after", samples=2)
        wait_for("the second run finished", lambda: finished(pg_engine, "after"), 300)
    finally:
        stop([worker])
        if smaller is not None:
            smaller.stop()
        emu.stop()

"""Flower for real: `tokenmill flower` as a newcomer starts it (no settings, straight after
`pip install -e .`), and with basic auth beside a JSON-logging `celery -A app worker` on a
private Redis, where its HTTP API shows readable tasks and the worker."""

from __future__ import annotations

import ast
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from sqlalchemy import Engine

from app.ledger import reads, run_queries
from ops.emulator_proc import EmulatorProcess, start_emulator
from tests.support.procs import ROOT, clean_env, service_env, stop, tokenmill

pytestmark = pytest.mark.e2e

T = TypeVar("T")
USER, PASSWORD = "ops", "flower-test-pw"
PROMPTS = [f"Tell me fact number {i} about queues." for i in range(6)]
# four or more integers in a list: what a leaked token array looks like in a repr
INT_LIST = re.compile(r"\[\s*\d+\s*(,\s*\d+\s*){3,}\]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = probe()
        except httpx.HTTPError:
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def emulator() -> Iterator[EmulatorProcess]:
    emu = start_emulator(["--step-ms", "1", "--median-tokens", "20"])
    yield emu
    emu.stop()


def test_tokenmill_flower_starts_on_embedded_defaults(tmp_path: Path) -> None:
    port = free_port()
    err = tmp_path / "flower.stderr"
    with err.open("wb") as stderr_file:
        flower = subprocess.Popen(
            [sys.executable, "-m", "ops", "flower", "--port", str(port)],
            env=clean_env(tmp_path / "data"),
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=stderr_file,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as http:
            wait_for("Flower", lambda: http.get("/healthcheck").text == "OK", 60)
            assert http.get("/").status_code == 200
            assert http.get("/metrics").status_code == 200  # no credentials set: loopback, open
    finally:
        stop([flower])
    log = err.read_text()
    assert f"Flower on http://127.0.0.1:{port}/" in log
    assert "No hostname was supplied" not in log


def test_flower_shows_readable_tasks_and_the_worker_logs_json(
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    emulator: EmulatorProcess,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    base = service_env(pg_url, redis_url, tmp_path)
    base.pop("FLOWER_UNAUTHENTICATED_API", None)
    base.pop("FLOWER_BASIC_AUTH", None)
    port = free_port()
    flower_url = f"http://127.0.0.1:{port}"
    flower_log, worker_err = tmp_path / "flower.log", tmp_path / "worker.stderr"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        flower_env = base | {"TOKENMILL_FLOWER_USER": USER, "TOKENMILL_FLOWER_PASSWORD": PASSWORD}
        flower_code = f"from ops.flower_cmd import flower_cmd; flower_cmd(['--port', '{port}'])"
        with flower_log.open("wb") as flower_out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", flower_code],
                    env=flower_env,
                    cwd=ROOT,
                    stdout=flower_out,
                    stderr=subprocess.STDOUT,
                )
            )
        worker_env = base | {
            "TOKENMILL_SGLANG_URL": emulator.url,
            "TOKENMILL_SERVER_NAME": "gpu-f",
            "TOKENMILL_LOG_FORMAT": "json",
        }
        with (tmp_path / "worker.stdout").open("wb") as banner, worker_err.open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        *(
                            sys.executable,
                            "-m",
                            "celery",
                            "-A",
                            "app",
                            "worker",
                            "--loglevel",
                            "INFO",
                        ),
                        *("-n", "flw@%h", "--without-mingle", "--without-gossip", "-E"),
                    ],
                    env=worker_env,
                    cwd=ROOT,
                    stdout=banner,
                    stderr=log,
                )
            )
        auth = httpx.BasicAuth(USER, PASSWORD)
        with httpx.Client(base_url=flower_url, timeout=10.0) as http:
            wait_for("Flower", lambda: http.get("/healthcheck").status_code == 200, 30)

            def api(path: str, **params: Any) -> Any:
                response = http.get(path, params=params, auth=auth)
                response.raise_for_status()
                return response.json()

            # the worker's events reach Flower before any task is published
            alive = wait_for(
                "the worker in Flower's event state",
                lambda: {k: v for k, v in api("/api/workers", status=True).items() if v},
                40,
            )
            (worker_name,) = alive
            assert worker_name.startswith("flw@")

            prompts = tmp_path / "prompts.jsonl"
            prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
            enqueue = tokenmill(
                [
                    *("enqueue", str(prompts), "--run", "fl1"),
                    *("--tokenizer", str(kimi_tokenizer_dir), "--max-new-tokens", "24"),
                ],
                base,
            )
            assert enqueue.returncode == 0, enqueue.stderr

            def finished_tasks() -> dict[str, Any] | None:
                tasks: dict[str, Any] = api("/api/tasks", taskname="tokenmill.generate")
                done = {k: t for k, t in tasks.items() if t["state"] == "SUCCESS"}
                claimed = sum(ast.literal_eval(t["result"])["claimed"] for t in done.values())
                return done if claimed == len(PROMPTS) else None

            tasks = wait_for("finished generate tasks in Flower", finished_tasks, 40)
            raw = http.get("/api/tasks", auth=auth).text
            workers = api("/api/workers", refresh=True)

            # without credentials, or with wrong ones, the API and /metrics answer 401
            assert http.get("/api/workers").status_code == 401
            assert http.get("/api/tasks", auth=httpx.BasicAuth(USER, "wrong")).status_code == 401
            assert http.get("/metrics").status_code == 401
            assert http.get("/metrics", auth=httpx.BasicAuth(USER, "wrong")).status_code == 401
            metrics = http.get("/metrics", auth=auth)
            assert metrics.status_code == 200 and "flower_events_total" in metrics.text

        wait_for("the run to finish", lambda: run_finished(pg_engine, "fl1"), 40)
    finally:
        stop(procs, timeout_s=30)
        print("--- flower\n" + flower_log.read_text(errors="replace")[-3000:])
        print("--- worker stderr\n" + worker_err.read_text(errors="replace")[-3000:])

    # Flower: the worker and its queues; each task by name, run and id range, never tokens
    assert worker_name in workers
    queues = {q["name"] for q in workers[worker_name]["active_queues"]}
    assert {"generate", "tokenmill.control"} <= queues
    assert len(tasks) == 2  # 6 items in messages of TOKENMILL_BATCH_SIZE=4
    for task in tasks.values():
        assert task["name"] == "tokenmill.generate"
        assert task["worker"] == worker_name
        assert re.fullmatch(r"run=fl1 \[[1-4] items: \d+\.\.\d+\]", task["args"]), task["args"]
        result = ast.literal_eval(task["result"])
        assert result["server"] == "gpu-f"
        fields = ("claimed", "skipped", "deferred", "ahead", "priority", "server", "window")
        assert set(result) == set(fields)
        assert result["priority"] == 0  # the run's (Flower's result line shows it)
        assert re.fullmatch(r"(auto|fixed): \d+( \(max_running \d+\))?( · .+)?", result["window"])
    assert "run=fl1 [4 items: 1..4]" in {t["args"] for t in tasks.values()}
    assert not INT_LIST.search(raw)

    # the worker's log: JSON lines only, with the state changes and no prompts or tokens
    lines = [line for line in worker_err.read_text().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]
    assert all({"ts", "level", "logger", "message"} <= e.keys() for e in entries)
    messages = [e["message"] for e in entries]
    assert any(m.startswith(f"worker {worker_name} serves gpu-f") for m in messages)
    assert sum("tokenmill.generate" in m and "succeeded" in m for m in messages) == 2
    done = [e for e in entries if " done on gpu-f" in e["message"]]
    assert sorted(e["item_id"] for e in done) == list(range(1, len(PROMPTS) + 1))
    assert all(e["server"] == "gpu-f" and isinstance(e["run_id"], int) for e in done)
    for line in lines:
        assert not INT_LIST.search(line), line
        assert not any(p in line for p in PROMPTS), line


def run_finished(db: Engine, run_name: str) -> bool:
    with db.connect() as conn:
        counts = reads.run_counts(conn, run_queries.get_run(conn, run_name))
    return bool(counts.total and counts.finished)

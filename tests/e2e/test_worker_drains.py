"""Celery workers (one per server, as the README's fleet) against servers that drain, push back
or want a key: a SIGTERMed server exits within its drain while the run goes on and nothing
fails; a full queue spends no attempt; a missing key is one line in the worker's log, and
nothing is claimed."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, func, select

from app.ledger import common, reads, run_queries
from ops.emulator_proc import start_emulator
from tests.support.procs import service_env, start_server_workers, stop, tokenmill, wait_for
from tests.support.rows import prompt_rows, write_rows

pytestmark = pytest.mark.e2e


def enqueue(env: dict[str, str], tokenizer: Path, tmp_path: Path, n: int) -> None:
    prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(n))
    argv = ["enqueue", str(prompts), "--run", "w1", "--tokenizer", str(tokenizer)]
    done = tokenmill([*argv, "--max-new-tokens", "32"], env, tmp_path)
    assert done.returncode == 0, done.stderr


def counts(db: Engine) -> reads.RunCounts:
    with db.connect() as conn:
        return reads.run_counts(conn, run_queries.get_run(conn, "w1"))


def most_attempts(db: Engine) -> int:
    with db.connect() as conn:
        return int(conn.execute(select(func.max(common.items.c.attempts))).scalar_one())


def test_a_sigtermed_server_drains_under_celery_workers_and_nothing_fails(
    pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    env = service_env(pg_url, redis_url, tmp_path / "data")
    flags = ["--step-ms", "40", "--median-tokens", "30"]
    leaving, staying = start_emulator(flags), start_emulator(flags)
    enqueue(env, kimi_tokenizer_dir, tmp_path, 120)
    workers = start_server_workers(env, [leaving.url, staying.url], tmp_path)
    try:
        wait_for("answers from gpu-0", lambda: counts(pg_engine).done >= 8, 180)
        leaving.popen.terminate()
        code = leaving.popen.wait(timeout=60)
        still_running = not counts(pg_engine).finished
        wait_for("the run's end", lambda: counts(pg_engine).finished, 300)
    finally:
        stop(workers)
        leaving.stop()
        staying.stop()
    log = (tmp_path / "worker0.log").read_text()
    assert code == 0 and still_running, log[-3000:]
    assert "server gpu-0 drains" in log, log[-3000:]
    final = counts(pg_engine)
    assert (final.done, final.failed) == (120, 0), final
    assert most_attempts(pg_engine) == 1


def test_a_full_queue_spends_no_attempt_under_a_celery_worker(
    pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    env = service_env(pg_url, redis_url, tmp_path / "data", TOKENMILL_RETRY_BACKOFF_S="0.05") | {
        "TOKENMILL_INFLIGHT": "64",
        "TOKENMILL_BATCH_SIZE": "16",
    }
    small = start_emulator(
        ["--step-ms", "5", "--median-tokens", "20", "--max-running", "4", "--max-queued", "2"]
    )
    enqueue(env, kimi_tokenizer_dir, tmp_path, 100)
    workers = start_server_workers(env, [small.url], tmp_path)
    try:
        wait_for("the run's end", lambda: counts(pg_engine).finished, 300)
        pushed_back = httpx.get(f"{small.url}/emulator/stats", timeout=5).json()
    finally:
        stop(workers)
        small.stop()
    final = counts(pg_engine)
    assert (final.done, final.failed) == (100, 0), final
    assert pushed_back["rejected_queue_full"] > 0
    assert most_attempts(pg_engine) == 1


def test_a_worker_without_the_key_says_so_and_claims_nothing(
    pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    env = service_env(pg_url, redis_url, tmp_path / "data")
    locked = start_emulator(["--step-ms", "5", "--api-key", "sekrit"])
    enqueue(env, kimi_tokenizer_dir, tmp_path, 20)
    workers = start_server_workers(env, [locked.url], tmp_path)
    line = "error: server gpu-0 requires an API key: set TOKENMILL_SGLANG_API_KEY"
    log = tmp_path / "worker0.log"
    try:
        wait_for(line, lambda: log.exists() and line in log.read_text(), 120)
        time.sleep(3)  # messages keep arriving meanwhile: none is claimed
        now = counts(pg_engine)
        stats = httpx.get(
            f"{locked.url}/emulator/stats", headers={"Authorization": "Bearer sekrit"}, timeout=5
        ).json()
    finally:
        stop(workers)
        locked.stop()
    assert log.read_text().count(line) == 1
    assert now.leased == 0 and now.done == 0 and now.failed == 0, now
    assert stats["requests"] == 0

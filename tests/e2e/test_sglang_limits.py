"""`tokenmill run` and Celery workers (`celery -A app worker` and beat) against SGLang 0.5.23's
own HTTP server (tests/support/sglang_http): a server told to stop (SIGTERM, what a
`systemctl restart` sends) fails nothing; a full queue spends no attempt; a missing
API key is one line and nothing is claimed; the server's smaller `--context-length` wins and is
named. What the server received is read from its own access log (`--log-level-http info`)."""

from __future__ import annotations

import itertools
import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.exc import OperationalError

from app.ledger import common, reads, run_queries
from tests.support.procs import (
    clean_env,
    run_args,
    service_env,
    start_celery,
    start_server_workers,
    start_tokenmill,
    stop,
    tokenmill,
    wait_for,
)
from tests.support.rows import prompt_rows, write_rows
from tests.support.sglang_http import harness
from tests.support.sglang_http.harness import SGLangServer

pytestmark = pytest.mark.e2e

KEY = "key-28"
CONTEXT = 96  # the guarded server's --context-length; the folder's config.json says 16384
ACCESS = re.compile(r'"(GET|POST) (\S+) HTTP/[\d.]+" (\d{3})')
WIDE = {"COLUMNS": "200"}
LOGGED = ("--log-level-http", "info")


def requests_seen(server: SGLangServer, since: int = 0) -> list[tuple[str, str, int]]:
    """(method, path, status) of every request in the server's access log, from byte since."""
    text = server.log.read_bytes()[since:].decode(errors="replace")
    return [(m[1], m[2], int(m[3])) for m in ACCESS.finditer(text)]


def answered(server: SGLangServer, status: int) -> int:
    return sum(
        1 for _, path, code in requests_seen(server) if path == "/generate" and code == status
    )


@pytest.fixture(scope="module")
def guarded_server(
    tmp_path_factory: pytest.TempPathFactory, kimi_tokenizer_dir: Path
) -> Iterator[SGLangServer]:
    """A server that wants KEY, holds CONTEXT tokens, runs 4 requests and queues 2."""
    folder = tmp_path_factory.mktemp("sglang-guarded")
    model = harness.model_folder(kimi_tokenizer_dir, folder / "model")
    flags = ("--api-key", KEY, "--context-length", str(CONTEXT), *LOGGED)
    flags += ("--max-running-requests", "4", "--max-queued-requests", "2")
    env = harness.server_env(PYTHONUNBUFFERED="1")
    with harness.running_sglang_server(model, folder / "server.log", *flags, env=env) as server:
        yield server


def limit_rows(path: Path) -> Path:
    """100 short prompts; `bad`, whose prompt fits CONTEXT but not with 32 new tokens (the
    server refuses it: a bad request); `long`, over CONTEXT (refused at enqueue, line 102)."""
    rows = prompt_rows(100)
    rows.append({"id": "bad", "prompt": "x " * 70})
    rows.append({"id": "long", "prompt": "word " * 400})
    return write_rows(path, rows)


def ledger_items(db: Engine) -> dict[str, tuple[str, int, str | None]]:
    """item key → (status, attempts, error)."""
    items = common.items
    with db.connect() as conn:
        rows = conn.execute(
            select(items.c.item_key, items.c.status, items.c.attempts, items.c.error)
        )
        return {key: (status, attempts, error) for key, status, attempts, error in rows}


def assert_limits_held(items: dict[str, tuple[str, int, str | None]]) -> None:
    """Every good item done at its first attempt; the bad one failed at its first, with
    SGLang's own 400; the long one never stored."""
    assert "long" not in items and len(items) == 101, sorted(items)
    status, attempts, error = items.pop("bad")
    assert (status, attempts) == ("failed", 1), (status, attempts, error)
    assert f"exceeds the model's maximum context length of {CONTEXT}" in (error or "")
    assert {(s, a) for s, a, _ in items.values()} == {("done", 1)}


def context_named(stderr: str, name: str) -> None:
    assert f"the servers' context length ({name} {CONTEXT}; their --context-length)" in stderr
    assert f"prompts are held to {CONTEXT}, the server's" in stderr
    assert "line 102" in stderr and f"context length {CONTEXT}" in stderr, stderr


def test_run_a_missing_key_is_one_line_and_nothing_is_claimed(
    guarded_server: SGLangServer, tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    env = clean_env(tmp_path / "data", **WIDE)
    prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(20))
    err = tmp_path / "run.err"
    name = guarded_server.base_url.removeprefix("http://")
    line = f"error: server {name} requires an API key: set TOKENMILL_SGLANG_API_KEY"
    argv = run_args(prompts, "r1", kimi_tokenizer_dir, [guarded_server.base_url])
    run = start_tokenmill([*argv], env, tmp_path, err)
    try:
        wait_for(line, lambda: line in err.read_text(), 120, err.read_text)
        probes = count_probes(guarded_server)
        run.terminate()
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert err.read_text().count(line) == 1, err.read_text()
    shown = json.loads(tokenmill(["status", "r1", "--json"], env, tmp_path).stdout)
    assert (shown["leased"], shown["done"], shown["failed"]) == (0, 0, 0), shown
    assert_probed_only(guarded_server, *probes)


def count_probes(server: SGLangServer) -> tuple[int, int, float]:
    """(the requests the server received in about 5 s, where that window starts in its log,
    its length in seconds)."""
    start, began = server.log.stat().st_size, time.monotonic()
    time.sleep(5)
    seen, elapsed = len(requests_seen(server, start)), time.monotonic() - began
    return seen, start, elapsed


def assert_probed_only(server: SGLangServer, seen: int, start: int, elapsed: float) -> None:
    assert seen <= elapsed + 1, (seen, elapsed)  # the normal rate: at most one a second
    sent = requests_seen(server, start)
    assert not [r for r in sent if r[1] == "/generate"], sent  # nothing was sent to generate


def test_run_back_pressure_and_the_servers_context(
    guarded_server: SGLangServer, tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    """64 in flight against 4 running + 2 queued: the server pushes back (503 "The request
    queue is full.") and no item spends an attempt on it; the server's 96 tokens of context
    hold the prompts, named at start."""
    data = tmp_path / "data"
    env = clean_env(data, TOKENMILL_SGLANG_API_KEY=KEY, TOKENMILL_INFLIGHT="64", **WIDE)
    env["TOKENMILL_RETRY_BACKOFF_S"] = "0.05"
    pushed_before = answered(guarded_server, 503)
    prompts = limit_rows(tmp_path / "p.jsonl")
    argv = [*run_args(prompts, "r1", kimi_tokenizer_dir, [guarded_server.base_url]), "--json"]
    run = tokenmill(argv, env, tmp_path)
    assert run.returncode == 0, run.stderr
    context_named(run.stderr, guarded_server.base_url.removeprefix("http://"))
    counts = json.loads(run.stdout)
    assert (counts["done"], counts["failed"]) == (100, 1), counts
    assert answered(guarded_server, 503) > pushed_before  # the server did push back
    ledger = create_engine(f"sqlite:///{data / 'ledger.sqlite3'}")
    try:
        assert_limits_held(ledger_items(ledger))
    finally:
        ledger.dispose()


def run_counts(db: Engine, run: str) -> reads.RunCounts:
    with db.connect() as conn:
        return reads.run_counts(conn, run_queries.get_run(conn, run))


def test_worker_a_missing_key_is_one_line_and_nothing_is_claimed(
    guarded_server: SGLangServer,
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    env = service_env(pg_url, redis_url, tmp_path / "data")
    prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(20))
    argv = ["enqueue", str(prompts), "--run", "w1", "--tokenizer", str(kimi_tokenizer_dir)]
    enqueued = tokenmill(argv, env, tmp_path)
    assert enqueued.returncode == 0, enqueued.stderr
    workers = start_server_workers(env, [guarded_server.base_url], tmp_path)
    line = "error: server gpu-0 requires an API key: set TOKENMILL_SGLANG_API_KEY"
    log = tmp_path / "worker0.log"
    try:
        wait_for(line, lambda: log.exists() and line in log.read_text(), 120)
        probes = count_probes(guarded_server)  # messages keep arriving meanwhile
        now = run_counts(pg_engine, "w1")
    finally:
        stop(workers)
    assert log.read_text().count(line) == 1, log.read_text()[-3000:]
    assert (now.leased, now.done, now.failed) == (0, 0, 0), now
    assert_probed_only(guarded_server, *probes)


def test_worker_back_pressure_and_the_servers_context(
    guarded_server: SGLangServer,
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    """The README's fleet (a worker for the server, beat): the worker names the server's
    context length against its model folder's at start, `tokenmill enqueue` holds prompts to
    the registered server's, and a full queue spends no attempt."""
    env = service_env(pg_url, redis_url, tmp_path / "data", TOKENMILL_SGLANG_API_KEY=KEY)
    env |= {"TOKENMILL_INFLIGHT": "64", "TOKENMILL_BATCH_SIZE": "16", **WIDE}
    env["TOKENMILL_RETRY_BACKOFF_S"] = "0.05"
    pushed_before = answered(guarded_server, 503)
    workers = start_server_workers(env, [guarded_server.base_url], tmp_path)
    workers.append(start_celery("beat", env, tmp_path / "beat.log", "-s", str(tmp_path / "beat")))
    log = tmp_path / "worker0.log"
    try:
        wait_for("the worker", lambda: log.exists() and "serves gpu-0" in log.read_text(), 120)
        prompts = limit_rows(tmp_path / "p.jsonl")
        argv = ["enqueue", str(prompts), "--run", "w1", "--tokenizer", str(kimi_tokenizer_dir)]
        enqueued = tokenmill([*argv, "--max-new-tokens", "32"], env, tmp_path)
        assert enqueued.returncode == 0, enqueued.stderr
        context_named(enqueued.stderr, "gpu-0")
        wait_for("the run's end", lambda: run_counts(pg_engine, "w1").finished, 300)
    finally:
        stop(workers)
    text = log.read_text()
    assert f"server gpu-0's context length is {CONTEXT} (its --context-length)" in text, text[
        -3000:
    ]
    assert answered(guarded_server, 503) > pushed_before  # the server did push back
    assert_limits_held(ledger_items(pg_engine))


def events_moves(env: dict[str, str], cwd: Path, server: str) -> list[tuple[str, str]]:
    shown = tokenmill(["events", "--server", server, "--json"], env, cwd)
    assert shown.returncode == 0, shown.stderr
    events = json.loads(shown.stdout)
    return [(e["details"]["from"], e["details"]["to"]) for e in events if e["kind"] == "state"]


RUN_ROWS, FLEET_ROWS = 600, 480


def embedded_done(data: Path) -> int:
    """The items done in `tokenmill run`'s own ledger."""
    ledger = create_engine(f"sqlite:///{data / 'ledger.sqlite3'}")
    try:
        with ledger.connect() as conn:
            items = common.items
            done = select(func.count()).where(items.c.status == "done")
            return int(conn.execute(done).scalar_one())
    except OperationalError:  # not created yet
        return 0
    finally:
        ledger.dispose()


def test_a_sigterm_mid_run_fails_nothing(
    sglang_server: SGLangServer,
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    """SIGTERM to a server (what `systemctl stop/restart` sends) while a `tokenmill run` and a
    Celery fleet both use it and the session server: it drains and exits while both go on,
    nothing fails, no attempt is spent, the timelines show draining → down, and → healthy once
    the server is started again on its port."""
    # the session server's model folder: both servers of a run serve one model
    model = Path(httpx.get(f"{sglang_server.base_url}/model_info", timeout=10).json()["model_path"])
    log = tmp_path / "leaving.log"
    server_env = harness.server_env(PYTHONUNBUFFERED="1", HARNESS_STEP_S="0.02")
    run_env = clean_env(tmp_path / "data", TOKENMILL_INFLIGHT="8", **WIDE)
    fleet_env = service_env(pg_url, redis_url, tmp_path / "fleet") | WIDE
    run_prompts = write_rows(tmp_path / "run.jsonl", prompt_rows(RUN_ROWS))
    fleet_prompts = write_rows(tmp_path / "fleet.jsonl", prompt_rows(FLEET_ROWS))
    with harness.running_sglang_server(model, log, *LOGGED, env=server_env) as leaving:
        name = leaving.base_url.removeprefix("http://")
        added = tokenmill(["servers", "add", name, leaving.base_url], run_env, tmp_path)
        assert added.returncode == 0, added.stderr
        argv = ["enqueue", str(fleet_prompts), "--run", "w1"]
        argv += ["--tokenizer", str(kimi_tokenizer_dir), "--max-new-tokens", "32"]
        enqueued = tokenmill(argv, fleet_env, tmp_path)
        assert enqueued.returncode == 0, enqueued.stderr
        urls = [leaving.base_url, sglang_server.base_url]
        workers = start_server_workers(fleet_env, urls, tmp_path)
        beat_log = tmp_path / "beat.log"
        workers.append(start_celery("beat", fleet_env, beat_log, "-s", str(tmp_path / "beat")))
        run_argv = run_args(run_prompts, "r1", kimi_tokenizer_dir, urls)
        err = tmp_path / "run.err"
        run = start_tokenmill([*run_argv, "--json"], run_env, tmp_path, err, piped=True)
        try:
            # both use it: each has answers, and so requests in flight on it
            wait_for("the fleet's answers", lambda: run_counts(pg_engine, "w1").done >= 16, 180)
            wait_for("the run's answers", lambda: embedded_done(tmp_path / "data") >= 16, 180)
            terminated = time.monotonic()
            leaving.popen.send_signal(signal.SIGTERM)  # what `systemctl stop` sends
            code = leaving.popen.wait(timeout=120)
            drained_s = time.monotonic() - terminated
            run_going, fleet_going = run.poll() is None, not run_counts(pg_engine, "w1").finished
            out, _ = run.communicate(timeout=300)
            wait_for("the fleet's end", lambda: run_counts(pg_engine, "w1").finished, 300)
            # systemd starts it again on its port: the fleet sees it come back
            port = int(leaving.base_url.rsplit(":", 1)[1])
            with harness.running_sglang_server(model, log, *LOGGED, env=server_env, port=port):
                # straight from down (its worker's probe), or through recovering when the
                # watchdog paused it meanwhile
                back = {("down", "healthy"), ("recovering", "healthy")}
                wait_for(
                    "gpu-0 seen healthy again",
                    lambda: bool(back & set(events_moves(fleet_env, tmp_path, "gpu-0"))),
                    120,
                    lambda: str(events_moves(fleet_env, tmp_path, "gpu-0")),
                )
        finally:
            if run.poll() is None:
                run.kill()
            stop(workers)
    text = err.read_text()
    print(f"\nSIGTERM: drained and exited in {drained_s:.1f}s")
    assert code == 0, text
    assert run_going and fleet_going, "a run ended before the drained server exited"
    assert run.returncode == 0, text
    assert f"--server {leaving.base_url} drains (its /health answers 503)" in text, text
    counts = json.loads(out)
    assert (counts["done"], counts["failed"]) == (RUN_ROWS, 0), counts
    ledger = create_engine(f"sqlite:///{tmp_path / 'data' / 'ledger.sqlite3'}")
    try:
        with ledger.connect() as conn:
            assert conn.execute(select(func.max(common.items.c.attempts))).scalar_one() == 1
    finally:
        ledger.dispose()
    moves = events_moves(run_env, tmp_path, name)
    assert ("healthy", "draining") in moves and ("draining", "down") in moves, moves
    fleet = run_counts(pg_engine, "w1")
    assert (fleet.done, fleet.failed) == (FLEET_ROWS, 0), fleet
    with pg_engine.connect() as conn:
        assert conn.execute(select(func.max(common.items.c.attempts))).scalar_one() == 1
    assert "server gpu-0 drains" in (tmp_path / "worker0.log").read_text()
    moves = events_moves(fleet_env, tmp_path, "gpu-0")
    assert ("healthy", "draining") in moves and ("draining", "down") in moves, moves
    # one way down and one way up: each change starts where the one before it ended
    assert all(a[1] == b[0] for a, b in itertools.pairwise(moves)), moves
    assert [to for _, to in moves[moves.index(("healthy", "draining")) :]].count("healthy") == 1

"""The Prometheus endpoint against real Postgres and Redis: exact figures from the ledger, basic
auth, refusal to serve beyond loopback without credentials, queue depth, several workers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine

from app.core.constants import GENERATE_TASK, PAUSED_BY_WATCHDOG, WORK_QUEUE
from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import ConfigurationError
from app.core.settings import Settings
from app.ledger import claims, queue, registry, run_queries
from app.ledger import outcomes as ledger_outcomes
from ops.views.metrics import (
    Credentials,
    LedgerCollector,
    MetricsServer,
    credentials_from,
    make_metrics_server,
)
from tests.support.emulator import free_port
from tests.support.procs import ROOT, clean_env

COMMAND = "from ops.metrics_cmd import metrics_cmd; metrics_cmd()"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def spec(name: str) -> run_queries.RunSpec:
    return run_queries.RunSpec(
        name=name,
        tokenizer_path="/tok",
        tokenizer_hash="a" * 64,
        chat_template_hash="b" * 64,
        chat_template_kwargs={},
        sampling=SamplingParams(seed=1),
        samples_per_prompt=2,
        think_end_id=None,
        eos_token_ids=[2],
    )


def make_run(engine: Engine, name: str, prompts: int) -> list[int]:
    """A run with prompts × 2 samples, all pending; their ids in order."""
    with engine.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec(name))
        new = [
            queue.NewItem(f"{name}-k{i}", s, i + 1, None, [1, 2, 3])
            for i in range(prompts)
            for s in range(2)
        ]
        queue.insert_items(conn, run.id, new)
        return queue.pending_ids(conn, run.id)


def done(item_id: int, tokens: int, latency_s: float, finish: str = "stop") -> ledger_outcomes.Done:
    result = GenerateResult(
        f"rid-{item_id}",
        [7] * tokens,
        finish,
        None,
        3,
        tokens,
        0,
        latency_s,  # type: ignore[arg-type]
    )
    return ledger_outcomes.Done(item_id, result)


def finish(
    engine: Engine, server: str, ids: list[int], outcomes: list[ledger_outcomes.Outcome]
) -> None:
    owner = f"worker-{server}"
    with engine.begin() as conn:
        assert len(claims.claim_items(conn, ids, owner=owner, server=server, lease_s=60)) == len(
            ids
        )
        ledger_outcomes.record_outcomes(conn, outcomes, owner=owner, lease_s=60)


@contextmanager
def serving(
    engine: Engine,
    *,
    broker_url: str | None = None,
    credentials: Credentials | None = None,
) -> Iterator[MetricsServer]:
    server = make_metrics_server(
        engine=engine,
        broker_url=broker_url,
        host="127.0.0.1",
        port=0,
        credentials=credentials,
        cache_s=0,
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(server: MetricsServer, auth: tuple[str, str] | None = None) -> Samples:
    response = httpx.get(server.url, auth=auth, timeout=30)
    assert response.status_code == 200, response.text
    return parse(response.text)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def build_fleet(engine: Engine) -> Engine:
    """Two servers, two runs; items done, truncated, failed, leased, queued and pending."""
    with engine.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://gpu-a:30000")
        registry.upsert_server(conn, "gpu-b", "http://gpu-b:30000")
        registry.record_probe(
            conn,
            "gpu-a",
            state="healthy",
            failures=0,
            successes=2,
            ok=True,
            latency_s=0.05,
            error=None,
        )
        registry.record_probe(
            conn,
            "gpu-b",
            state="down",
            failures=3,
            successes=0,
            ok=False,
            latency_s=None,
            error="connection refused",
        )
        registry.set_paused(conn, "gpu-b", True, by=PAUSED_BY_WATCHDOG, reason="down")
    r1 = make_run(engine, "r1", 3)  # 6 items
    r2 = make_run(engine, "r2", 2)  # 4 items
    with engine.begin() as conn:
        queue.mark_queued(conn, r1 + r2[:2])
    finish(
        engine,
        "gpu-a",
        r1[:3],
        [
            done(r1[0], 10, 0.4),
            done(r1[1], 20, 3.0, "length"),
            ledger_outcomes.Failed(r1[2], "HTTP 400"),
        ],
    )
    finish(engine, "gpu-b", r1[3:5], [done(r1[3], 7, 45.0)])  # r1[4] stays leased
    with engine.begin() as conn:  # and gpu-a runs a second copy of it
        assert [c.id for c in claims.mark_hedged(conn, [r1[4]], owner="worker-gpu-a")] == [r1[4]]
    finish(engine, "gpu-a", r2[:1], [done(r2[0], 5, 700.0)])
    finish(engine, "gpu-b", r2[1:2], [])  # leased; r1[5] queued, r2[2:] pending
    return engine


@pytest.fixture
def fleet(pg_engine: Engine) -> Engine:
    return build_fleet(pg_engine)


def test_scrape_reports_exact_ledger_figures(db: Engine) -> None:
    """On Postgres and on the embedded SQLite ledger alike."""
    with serving(build_fleet(db)) as server:
        m = scrape(server)

    assert value(m, "tokenmill_generated_tokens_total", server="gpu-a") == 35
    assert value(m, "tokenmill_generated_tokens_total", server="gpu-b") == 7
    requests = {
        (server, outcome): value(m, "tokenmill_requests_total", server=server, outcome=outcome)
        for server in ("gpu-a", "gpu-b")
        for outcome in ("stop", "length", "failed")
    }
    assert requests == {
        ("gpu-a", "stop"): 2,
        ("gpu-a", "length"): 1,
        ("gpu-a", "failed"): 1,
        ("gpu-b", "stop"): 1,
        ("gpu-b", "length"): 0,
        ("gpu-b", "failed"): 0,
    }
    assert value(m, "tokenmill_requests_in_flight", server="gpu-a") == 0
    assert value(m, "tokenmill_requests_in_flight", server="gpu-b") == 2

    def bucket(server: str, le: str) -> float | None:
        return value(m, "tokenmill_request_latency_seconds_bucket", server=server, le=le)

    # gpu-a finished in 0.4 s, 3.0 s and 700 s; gpu-b in 45 s
    assert [bucket("gpu-a", le) for le in ("0.5", "2.5", "5.0", "600.0", "1200.0", "+Inf")] == [
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    assert value(m, "tokenmill_request_latency_seconds_count", server="gpu-a") == 3
    assert value(m, "tokenmill_request_latency_seconds_sum", server="gpu-a") == pytest.approx(703.4)
    assert [bucket("gpu-b", le) for le in ("30.0", "60.0", "+Inf")] == [0, 1, 1]
    assert value(m, "tokenmill_request_latency_seconds_sum", server="gpu-b") == 45

    statuses = ("pending", "queued", "leased", "done", "failed")
    assert {s: value(m, "tokenmill_run_items", run="r1", status=s) for s in statuses} == {
        "pending": 0,
        "queued": 1,
        "leased": 1,
        "done": 3,
        "failed": 1,
    }
    assert {s: value(m, "tokenmill_run_items", run="r2", status=s) for s in statuses} == {
        "pending": 2,
        "queued": 0,
        "leased": 1,
        "done": 1,
        "failed": 0,
    }
    hedged = {
        (run, s): value(m, "tokenmill_run_hedged_items", run=run, status=s)
        for run in ("r1", "r2")
        for s in ("leased", "done", "failed")
    }
    assert hedged == {(run, s): 1 if (run, s) == ("r1", "leased") else 0 for run, s in hedged}
    assert value(m, "tokenmill_run_generated_tokens_total", run="r1") == 37
    assert value(m, "tokenmill_run_generated_tokens_total", run="r2") == 5

    assert value(m, "tokenmill_server_state", server="gpu-a", state="healthy") == 1
    assert value(m, "tokenmill_server_state", server="gpu-a", state="down") == 0
    assert value(m, "tokenmill_server_state", server="gpu-b", state="down") == 1
    assert value(m, "tokenmill_server_state", server="gpu-b", state="healthy") == 0
    assert value(m, "tokenmill_server_paused", server="gpu-a", paused_by="") == 0
    assert value(m, "tokenmill_server_paused", server="gpu-b", paused_by="watchdog") == 1
    assert value(m, "tokenmill_server_last_probe_success", server="gpu-a") == 1
    assert value(m, "tokenmill_server_last_probe_success", server="gpu-b") == 0
    assert value(m, "tokenmill_server_last_probe_latency_seconds", server="gpu-a") == 0.05
    probed_at = value(m, "tokenmill_server_last_probe_timestamp_seconds", server="gpu-a")
    assert probed_at is not None and abs(probed_at - time.time()) < 300

    assert value(m, "tokenmill_ledger_up") == 1
    assert not any(name.startswith(("tokenmill_queue", "tokenmill_broker")) for name, _ in m)


def test_a_scrape_is_cached_for_the_configured_period(fleet: Engine) -> None:
    now = [100.0]
    collector = LedgerCollector(fleet, None, cache_s=2.0, clock=lambda: now[0])

    def tokens() -> float:
        family = next(f for f in collector.collect() if f.name == "tokenmill_generated_tokens")
        return sum(s.value for s in family.samples)

    assert tokens() == 42
    more = make_run(fleet, "r3", 1)
    with fleet.begin() as conn:
        queue.mark_queued(conn, more)
    finish(fleet, "gpu-a", more[:1], [done(more[0], 8, 1.0)])
    now[0] += 1.9
    assert tokens() == 42  # served from the cache
    now[0] += 0.1
    assert tokens() == 50


def test_basic_auth_is_enforced_when_configured(fleet: Engine) -> None:
    with serving(fleet, credentials=Credentials("prom", "s3cret")) as server:
        anonymous = httpx.get(server.url, timeout=30)
        assert anonymous.status_code == 401
        assert anonymous.headers["WWW-Authenticate"].startswith("Basic ")
        assert "tokenmill_" not in anonymous.text
        assert httpx.get(server.url, auth=("prom", "wrong"), timeout=30).status_code == 401
        assert httpx.get(server.url, auth=("other", "s3cret"), timeout=30).status_code == 401
        garbled = httpx.get(server.url, headers={"Authorization": "Basic %%%"}, timeout=30)
        assert garbled.status_code == 401
        m = scrape(server, auth=("prom", "s3cret"))
    assert value(m, "tokenmill_generated_tokens_total", server="gpu-a") == 35


def test_refuses_to_serve_beyond_loopback_without_credentials(
    pg_engine: Engine, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError, match=r"refusing to serve metrics on '0\.0\.0\.0'"):
        make_metrics_server(
            engine=pg_engine, broker_url=None, host="0.0.0.0", port=0, credentials=None
        )
    with pytest.raises(ConfigurationError, match="TOKENMILL_METRICS_PASSWORD"):
        credentials_from(Settings(metrics_user="prom", metrics_password=None))

    # the command refuses before it opens the database (this one does not exist)
    env = clean_env(tmp_path, TOKENMILL_DATABASE_URL="postgresql://nobody@127.0.0.1:1/x")
    result = subprocess.run(
        [sys.executable, "-c", COMMAND, "--host", "0.0.0.0", "--port", "0"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "refusing to serve metrics on '0.0.0.0' without credentials" in result.stderr
    assert "TOKENMILL_METRICS_USER" in result.stderr


def test_the_command_serves_with_credentials_from_settings(
    fleet: Engine, pg_url: str, tmp_path: Path
) -> None:
    port = free_port()
    env = clean_env(
        tmp_path,
        TOKENMILL_DATABASE_URL=pg_url,
        TOKENMILL_METRICS_USER="prom",
        TOKENMILL_METRICS_PASSWORD="s3cret",
        TOKENMILL_METRICS_PORT=str(port),
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", COMMAND],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                anonymous = httpx.get(url, timeout=10)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "the metrics server never answered"
                time.sleep(0.1)
        assert anonymous.status_code == 401
        response = httpx.get(url, auth=("prom", "s3cret"), timeout=10)
        assert response.status_code == 200
        m = parse(response.text)
        assert value(m, "tokenmill_generated_tokens_total", server="gpu-a") == 35
        assert value(m, "tokenmill_broker_up") is None  # the folder broker has no readable queue
    finally:
        proc.terminate()
        proc.communicate(timeout=10)  # waits and closes its stderr pipe


def test_queue_depth_from_redis(pg_engine: Engine, redis_url: str) -> None:
    app = Celery(broker=redis_url)
    try:
        for _ in range(5):
            app.send_task(GENERATE_TASK, args=[[1, 2]], queue=WORK_QUEUE)
        for priority in (3, 9):  # priority sub-queues `generate\x06\x16<n>`
            app.send_task(GENERATE_TASK, args=[[3]], queue=WORK_QUEUE, priority=priority)
    finally:
        app.close()
    with serving(pg_engine, broker_url=redis_url) as server:
        m = scrape(server)
    assert value(m, "tokenmill_queue_messages", queue="generate") == 7
    assert value(m, "tokenmill_broker_up") == 1


def test_a_broker_outage_is_reported_and_the_ledger_figures_remain(fleet: Engine) -> None:
    with serving(fleet, broker_url=f"redis://127.0.0.1:{free_port()}/0") as server:
        m = scrape(server)
    assert value(m, "tokenmill_broker_up") == 0
    assert value(m, "tokenmill_queue_messages", queue="generate") is None
    assert value(m, "tokenmill_generated_tokens_total", server="gpu-a") == 35


WORKER = """
import json, sys, time
from app.core.contracts import GenerateResult
from app.ledger import claims, outcomes as ledger_outcomes
from app.ledger.database import make_engine

url, server = sys.argv[1:]
owner = "worker-" + server
engine = make_engine(url)
print("ready", flush=True)
sys.stdin.readline()
finished = tokens = 0
while True:
    with engine.begin() as conn:
        claimed = claims.claim_next(conn, owner=owner, server=server, lease_s=60, limit=2)
    if not claimed:
        break
    time.sleep(0.02)  # the generation
    outcomes = []
    for c in claimed:
        n = c.id % 7 + 1
        result = GenerateResult(f"r{c.id}", [5] * n, "stop", None, 3, n, 0, 0.1 * n)
        outcomes.append(ledger_outcomes.Done(c.id, result))
    with engine.begin() as conn:
        ledger_outcomes.record_outcomes(conn, outcomes, owner=owner, lease_s=60)
    finished += len(claimed)
    tokens += sum(c.id % 7 + 1 for c in claimed)
print(json.dumps({"finished": finished, "tokens": tokens}), flush=True)
"""


def test_totals_are_the_sum_over_worker_processes(pg_engine: Engine, pg_url: str) -> None:
    ids = make_run(pg_engine, "r1", 30)  # 60 items
    with pg_engine.begin() as conn:
        queue.mark_queued(conn, ids)
    procs = {
        server: subprocess.Popen(
            [sys.executable, "-c", WORKER, pg_url, server],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for server in ("gpu-a", "gpu-b")
    }
    reports = {}
    try:
        for proc in procs.values():  # both connected before either takes work
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0
            reports[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)  # waits and closes its pipes
    assert all(r["finished"] > 0 for r in reports.values()), reports

    with serving(pg_engine) as server:
        m = scrape(server)
    for name, report in reports.items():
        assert value(m, "tokenmill_generated_tokens_total", server=name) == report["tokens"]
        assert (
            value(m, "tokenmill_requests_total", server=name, outcome="stop") == report["finished"]
        )
        assert (
            value(m, "tokenmill_request_latency_seconds_count", server=name) == report["finished"]
        )
    assert sum(r["finished"] for r in reports.values()) == 60
    assert value(m, "tokenmill_run_items", run="r1", status="done") == 60
    assert value(m, "tokenmill_run_generated_tokens_total", run="r1") == sum(i % 7 + 1 for i in ids)

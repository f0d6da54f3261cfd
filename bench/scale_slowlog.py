"""`python bench/scale.py --slowlog`: on the 1M-item ledger, Postgres logs every statement of
500 ms or more while the fleet runs; the product must log none (issue 14's last target).

The ledger is bench/scale_build.py's: run A at its end (live leases on two servers, a dead
worker's expired leases), run B queued behind it, every id in a broker message. For
SLOWLOG_SECONDS real `celery -A app worker`s (two by default, `--slowlog-workers N`), each
bound to an emulator of its own (servers s3, s4, ...), work run B (steady state: with two,
each one's hedge search meets the other's leases on run B) and hedge run A's stragglers;
`celery -A app beat` sends the watchdog, reconcile (every 30 s) and compaction (every 60 s,
which moves run A's finished arrays to shards); the dead worker's leases are put back every
30 s, so every reconcile pass finds some; and an operator polls `tokenmill status`,
`servers`, `events` and `/metrics`.
The database gets `log_min_duration_statement = 500` (ALTER DATABASE, reset at the end);
the lines its sessions add to the server log are the result.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import scale_build as build
from common import (
    PG_ADMIN_URL,
    ROOT,
    emulator,
    engine_for,
    fixture_tokenizer_dir,
    service_env,
    start_worker,
    stop_process,
)
from sqlalchemy import create_engine, text

from app.core.settings import Settings, normalize_database_url
from app.ledger import claims, reads, registry

SIZE = 1_000_000
SLOWLOG_SECONDS = 240
SLOW_MS = 500
SERVER_LOG = Path("/var/log/postgresql/postgresql-15-main.log")
OPERATOR_POLL_S = 5.0
DEAD_LEASES_EVERY_S = 30.0
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
DURATION = re.compile(r"duration: ([0-9.]+) ms\s+(?:statement|execute [^:]*): (.*)")
PARAMETER = re.compile(r"(\$\d+) = ('(?:[^']|'')*'|NULL)")


def main(*, keep: bool, workers: int = 2) -> None:
    from scale_broker import REDIS_URL, fill_broker

    from app.prompts.tokenization import load_tokenizer

    built = build.existing(SIZE) if keep else None
    if built is None:
        tokenizer = load_tokenizer(fixture_tokenizer_dir())
        built = build.build(
            SIZE,
            str(fixture_tokenizer_dir()),
            tokenizer.tokenizer_hash,
            tokenizer.chat_template_hash,
        )
    db = engine_for(built.url)
    log_from = SERVER_LOG.stat().st_size
    set_slow_log(SLOW_MS)
    processed = 0  # items of run B finished while the fleet ran
    try:
        fill_broker(db, built)
        with db.connect() as conn:
            before = reads.run_counts(conn, built.run_b)
        emu_args = ["--step-ms", "5", "--median-tokens", "16", "--sigma", "0.5"]
        emu_args += ["--max-running", "64", "--log-level", "warning"]
        with contextlib.ExitStack() as stack:
            emulators = [stack.enter_context(emulator(emu_args)) for _ in range(workers)]
            servers = {f"s{3 + i}": emu.url for i, emu in enumerate(emulators)}
            serve_runs_with(db, servers)
            with tempfile.TemporaryDirectory(prefix="tokenmill-slowlog-") as tmp:
                _run_fleet(built, servers, Path(tmp), REDIS_URL, db)
        with db.connect() as conn:
            after = reads.run_counts(conn, built.run_b)
        processed = after.done + after.failed - before.done - before.failed
    finally:
        set_slow_log(None)
        db.dispose()
        if keep:
            build.forget(SIZE)  # run B moved on: not the built state any more
        else:
            build.drop(SIZE)
    slow = slow_statements(log_from)
    print(
        f"slow-statement log at {SLOW_MS} ms, {SLOWLOG_SECONDS} s of {workers} workers, beat and "
        f"an operator on {SIZE:,} items ({processed:,} items of run B finished meanwhile): "
        f"{len(slow)} statements logged"
    )
    for ms, statement in sorted(slow, reverse=True)[:20]:
        print(f"  {ms:9.1f} ms  {statement[:300]}")


def set_slow_log(ms: int | None, name: str = build.database_name(SIZE)) -> None:
    """Log every statement of database `name`'s sessions that takes ms or more (None: reset)."""
    admin = create_engine(normalize_database_url(PG_ADMIN_URL), isolation_level="AUTOCOMMIT")
    setting = f"SET log_min_duration_statement = {ms}" if ms is not None else "RESET ALL"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" {setting}'))
    finally:
        admin.dispose()


def serve_runs_with(db: Any, servers: dict[str, str]) -> None:
    """Point servers s3 and s4 at the emulators and pin the emulators' fingerprint on the
    runs (the built ledger pins a synthetic one), so the workers take their items."""
    from app.sglang.client import client_for

    client = client_for(next(iter(servers.values())), Settings())
    try:
        fingerprint = client.fingerprint().to_json()
    finally:
        client.close()
    with db.begin() as conn:
        for name, url in servers.items():
            registry.upsert_server(conn, name, url)
        conn.execute(
            text("UPDATE runs SET fingerprint = CAST(:fp AS json)"),
            {"fp": json.dumps(fingerprint)},
        )


@contextlib.contextmanager
def fleet(
    url: str,
    servers: dict[str, str],
    tmp: Path,
    redis_url: str,
    worker_pids: list[int] | None = None,
) -> Iterator[dict[str, str]]:
    """A `celery -A app worker` per server (bound to it) and `celery -A app beat` (reconcile
    every 30 s, compaction every 60 s) on the ledger at url, stopped on exit; yields their
    environment. worker_pids, if given, gets the workers' process ids."""
    env = service_env(
        url,
        redis_url,
        tmp,
        TOKENMILL_RECONCILE_INTERVAL_S="30",
        TOKENMILL_COMPACT_INTERVAL_S="60",
        TOKENMILL_STORAGE_URL=str(tmp / "storage"),
    )
    env["PYTHONPATH"] = str(ROOT)
    workers = [
        start_worker(
            env | {"TOKENMILL_SGLANG_URL": server_url, "TOKENMILL_SERVER_NAME": name},
            f"fleet-{name}",
            tmp / f"worker-{name}.log",
        )
        for name, server_url in servers.items()
    ]
    if worker_pids is not None:
        worker_pids.extend(worker.pid for worker in workers)
    with (tmp / "beat.log").open("wb") as beat_log:
        beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "app", "beat", "--schedule", str(tmp / "beat")],
            env=env,
            cwd=ROOT,
            stdout=beat_log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield env
    finally:
        stop_process(beat)
        for worker in workers:
            stop_process(worker)


def _run_fleet(
    built: build.Ledger, servers: dict[str, str], tmp: Path, redis_url: str, db: Any
) -> None:
    stop = threading.Event()
    scraper = threading.Thread(target=_scrape_metrics, args=(db, redis_url, stop), daemon=True)
    with fleet(built.url, servers, tmp, redis_url) as env:
        scraper.start()
        try:
            started = time.monotonic()
            deadline = started + SLOWLOG_SECONDS
            restored_at = started
            while time.monotonic() < deadline:
                for argv in (["status"], ["servers"], ["events"]):
                    subprocess.run(
                        [sys.executable, "-m", "ops", *argv],
                        env=env,
                        cwd=ROOT,
                        capture_output=True,
                        timeout=120,
                    )
                if time.monotonic() - restored_at >= DEAD_LEASES_EVERY_S:
                    _lease_to_the_dead_worker(db, built)
                    restored_at = time.monotonic()
                time.sleep(OPERATOR_POLL_S)
        finally:
            stop.set()
            scraper.join(timeout=120)


def _lease_to_the_dead_worker(db: Any, built: build.Ledger) -> None:
    """The dead worker holds DEAD_LEASES of run B's queued items again, leases expired an hour
    ago (through the product's claim): the next reconcile pass puts them back."""
    with db.begin() as conn:
        ids = list(
            conn.execute(
                text(
                    "SELECT id FROM items WHERE run_id = :run AND status = 'queued' "
                    "ORDER BY id DESC LIMIT :n"
                ),
                {"run": built.run_b.id, "n": build.DEAD_LEASES},
            ).scalars()
        )
        claims.claim_items(conn, ids, owner=build.DEAD_WORKER, server="s2", lease_s=-3600)


def _scrape_metrics(db: Any, redis_url: str, stop: threading.Event) -> None:
    from ops.views.metrics import make_metrics_server

    server = make_metrics_server(
        engine=db, broker_url=redis_url, host="127.0.0.1", port=0, credentials=None, cache_s=0
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        while not stop.wait(OPERATOR_POLL_S):
            urllib.request.urlopen(server.url, timeout=300).read()
    finally:
        server.shutdown()
        server.server_close()


def slow_statements(offset: int, name: str = build.database_name(SIZE)) -> list[tuple[float, str]]:
    """(ms, statement) of every duration line database `name`'s sessions logged past offset;
    a statement of several lines continues on the lines that start without a timestamp."""
    return [(ms, statement) for ms, statement, _ in logged_statements(offset, name)]


def logged_statements(offset: int, name: str) -> list[tuple[float, str, dict[str, str]]]:
    """slow_statements with the parameters of each (`DETAIL:  parameters: $1 = '5', ...`, the
    line after an `execute` of psycopg's server-side binding), as {"$1": "'5'"}."""
    found: list[tuple[float, str, dict[str, str]]] = []
    current: list[str] | None = None

    def close() -> None:
        if current is not None:
            ms, _, params = found[-1]
            found[-1] = (ms, " ".join(p for p in current if p), params)

    with SERVER_LOG.open(encoding="utf-8", errors="replace") as fh:
        fh.seek(offset)
        for line in fh:
            if not LOG_LINE.match(line):
                if current is not None:
                    current.append(line.strip())
                continue
            close()
            current = None
            if found and f"@{name} " in line and "DETAIL:  parameters:" in line:
                params = dict(PARAMETER.findall(line.split("parameters:", 1)[1]))
                found[-1] = (found[-1][0], found[-1][1], params)
                continue
            match = DURATION.search(line) if f"@{name} " in line else None
            if match:
                found.append((float(match.group(1)), "", {}))
                current = [match.group(2).strip()]
    close()
    return found


def explain(url: str, statement: str, params: dict[str, str]) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of a logged statement, its parameters put back as the
    literals the log quotes, in a transaction that is rolled back; COMMIT and the like: []."""
    if statement.split(None, 1)[0].upper() not in ("SELECT", "UPDATE", "DELETE", "INSERT", "WITH"):
        return []
    literal = re.sub(r"\$(\d+)\b", lambda m: params.get(m.group(0), m.group(0)), statement)
    db = engine_for(url)
    try:
        with db.connect() as conn:
            conn.begin()
            try:
                # no parameters: the driver sends the text as it is
                rows = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + literal).scalars()
                return [str(r) for r in rows]
            except Exception as exc:  # a statement the log cut, or a type the literal misses
                return [f"(not explained: {str(exc).splitlines()[0]})"]
            finally:
                conn.rollback()
    finally:
        db.dispose()


def checkpoint() -> float:
    """CHECKPOINT (from the admin database, so it is logged as no ledger's statement): the
    bulk build's dirty pages are written before anything is timed. Returns its seconds."""
    admin = create_engine(normalize_database_url(PG_ADMIN_URL), isolation_level="AUTOCOMMIT")
    started = time.monotonic()
    try:
        with admin.connect() as conn:
            conn.execute(text("CHECKPOINT"))
    finally:
        admin.dispose()
    return time.monotonic() - started


def set_database(name: str, setting: str, value: str) -> None:
    """ALTER DATABASE name SET setting = value (reset with set_slow_log(None, name))."""
    admin = create_engine(normalize_database_url(PG_ADMIN_URL), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" SET {setting} = {value}'))
    finally:
        admin.dispose()

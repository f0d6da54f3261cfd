"""Scale: what every operator command, periodic query and claim/write costs on ledgers of
10K to 10M items (issue 14), with the product's own functions, and the ratios between sizes.

    python bench/scale.py [--sizes 10000,100000,1000000,10000000] [--keep] [--repeat 5]
                          [--parts commands,queries,claims,export,preflight] [--slowlog]
    python bench/scale.py --fleet --sizes 1000000[,10000000] [--explain-slow]
                          [--synchronous-commit off]

Ledgers are built by bench/scale_build.py (one database `tokenmill_scale_<size>` per size;
--keep reuses one built at the current schema revision and keeps it afterwards). Commands are
timed as `python -m ops ...` subprocesses, start-up included (wall, median of --repeat, and
CPU); periodic queries and claim/write call app.ledger, app.ledger.registry,
app.ledger.metrics_queries, ops.views.metrics, workers.control.reconcile in this process, each in
its own pooled connection as the workers do. --slowlog (bench/scale_slowlog.py) checks Postgres'
slow-statement log instead; --fleet (bench/scale_fleet.py) times the operator's commands
while a worker and beat work the ledger, against an empty ledger under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import scale_build as build
from common import (
    ROOT,
    engine_for,
    fixture_tokenizer_dir,
    machine_note,
)

# first: it points the product's broker setting at the benchmark's Redis database
from scale_broker import REDIS_URL, fill_broker, queued_ids
from scale_table import RESULTS, report, save
from sqlalchemy import Engine, text

from app.core.contracts import GenerateResult
from app.core.settings import Settings
from app.ledger import claims as ledger_claims
from app.ledger import compaction, reads, registry, run_queries
from app.ledger import outcomes as ledger_outcomes

PARTS = ("commands", "queries", "claims", "export", "preflight")
CLAIM_BATCH = 32
CLAIM_ROUNDS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000,10000000")
    parser.add_argument("--keep", action="store_true", help="reuse and keep built ledgers")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    parser.add_argument("--repeat", type=int, default=5, help="timings per figure (median)")
    parser.add_argument("--slowlog", action="store_true", help="run the slow-statement check")
    parser.add_argument(
        "--fleet",
        action="store_true",
        help="time the commands while a worker and beat work the ledger, against an empty one",
    )
    parser.add_argument(
        "--explain-slow",
        action="store_true",
        help="--fleet: EXPLAIN ANALYZE the slowest statement of each group it lists",
    )
    parser.add_argument(
        "--synchronous-commit",
        choices=("on", "off"),
        default=None,
        help="--fleet: synchronous_commit on both ledgers (off: no COMMIT waits for the WAL flush)",
    )
    parser.add_argument(
        "--slowlog-workers", type=int, default=2, help="workers (each with its own emulator)"
    )
    parser.add_argument(
        "--table", action="store_true", help=f"only print the table of the figures in {RESULTS}"
    )
    args = parser.parse_args()
    if args.table:
        saved = json.loads(RESULTS.read_text())
        print(report({int(size): figures for size, figures in saved.items()}))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    parts = [p for p in args.parts.split(",") if p]
    if args.fleet:
        import scale_fleet

        scale_fleet.main(
            sizes,
            _tokenizer_identity(),
            repeat=min(args.repeat, 3),
            explain_slow=args.explain_slow,
            synchronous_commit=args.synchronous_commit,
        )
        return
    if args.slowlog:
        import scale_slowlog

        scale_slowlog.main(keep=args.keep, workers=args.slowlog_workers)
        return
    print(f"scale: {machine_note()}", flush=True)
    tokenizer = _tokenizer_identity()
    results: dict[int, dict[str, float]] = {}
    for size in sizes:
        built = build.existing(size) if args.keep else None
        if built is None:
            print(f"building {size:,} items", flush=True)
            built = build.build(size, *tokenizer)
        try:
            results[size] = measure(built, parts, args.repeat)
        finally:
            if not args.keep:
                build.drop(size)
        save(size, results[size])
    print()
    print(report(results))


def _tokenizer_identity() -> tuple[str, str, str]:
    from app.prompts.tokenization import load_tokenizer

    path = fixture_tokenizer_dir()
    tok = load_tokenizer(path)
    return str(path), tok.tokenizer_hash, tok.chat_template_hash


def measure(built: build.Ledger, parts: list[str], repeat: int) -> dict[str, float]:
    db = engine_for(built.url, pool_size=4)
    settings = Settings(database_url=built.url, broker_url=REDIS_URL)
    out: dict[str, float] = {}
    try:
        with db.connect() as conn:
            out["items table + indexes, bytes/item"] = (
                conn.execute(text("SELECT pg_total_relation_size('items')")).scalar_one()
                / built.size
            )
        fill_broker(db, built)
        if "commands" in parts:
            out |= time_commands(db, built, repeat)
        if "queries" in parts:
            out |= time_queries(db, built, settings, repeat)
        if "claims" in parts:
            out |= time_claims(db, built)
        if "export" in parts:
            out |= time_export(db, built, repeat)
        if "preflight" in parts:
            out |= time_preflight(db, built, repeat)
    finally:
        db.dispose()
    return out


# --- the broker: every queued item of run B is in a message, as after a real enqueue ---------


def _restore_dead_leases(db: Engine, built: build.Ledger) -> None:
    """Put the dead worker's leases back (expired an hour ago) after a reconcile re-queued
    them, through the product's claim (a negative lease is one that has already expired)."""
    with db.begin() as conn:
        ids = list(
            conn.execute(
                text("SELECT id FROM items WHERE run_id = :run ORDER BY id DESC LIMIT :n"),
                {"run": built.run_a.id, "n": build.DEAD_LEASES},
            ).scalars()
        )
        ledger_claims.claim_items(conn, ids, owner=build.DEAD_WORKER, server="s2", lease_s=-3600)


# --- operator commands: subprocess wall time, start-up included ------------------------------


def _command_env(built: build.Ledger, data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env["PYTHONPATH"] = str(ROOT)
    env["TOKENMILL_DATABASE_URL"] = built.url
    env["TOKENMILL_BROKER_URL"] = REDIS_URL
    env["TOKENMILL_DATA_DIR"] = str(data_dir)
    env["TOKENMILL_STORAGE_URL"] = str(data_dir / "storage")
    return env


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of `python -m ops ARGV` (exit 0 or 1: verify's findings)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "ops", *argv], env=env, cwd=ROOT, capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"tokenmill {' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu


COMMANDS: tuple[tuple[str, list[str]], ...] = (
    ("tokenmill --help", ["--help"]),
    ("tokenmill status", ["status"]),
    ("tokenmill status --json", ["status", "--json"]),
    ("tokenmill servers", ["servers"]),
    ("tokenmill events", ["events"]),
    ("tokenmill reconcile", ["reconcile"]),
    ("tokenmill pause", ["pause", "--server", "s1"]),
    ("tokenmill resume", ["resume", "--server", "s1"]),
)
# a state-changing command finds, every run, the state it changes (set up and put back
# untimed): a pause finds the server working, a resume finds it paused
PAUSE_S1 = ["pause", "--server", "s1"]
RESUME_S1 = ["resume", "--server", "s1"]
SETUP = {"resume": PAUSE_S1}
TEARDOWN = {"pause": RESUME_S1}


def time_commands(db: Engine, built: build.Ledger, repeat: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="tokenmill-scale-") as tmp:
        env = _command_env(built, Path(tmp))
        for name, argv in COMMANDS:
            walls, cpus = [], []
            for _ in range(repeat):
                if argv[0] in SETUP:
                    _run(SETUP[argv[0]], env)
                wall, cpu = _run(argv, env)
                walls.append(wall)
                cpus.append(cpu)
                if argv[0] == "reconcile":
                    _restore_dead_leases(db, built)
                if argv[0] in TEARDOWN:
                    _run(TEARDOWN[argv[0]], env)
            out[f"{name}, s wall"] = statistics.median(walls)
            out[f"{name}, s cpu"] = statistics.median(cpus)
            print(f"  {name}: {statistics.median(walls):.3f} s", flush=True)
    return out


# --- periodic queries, in process ---------------------------------------------------------


def _timed(fn: Callable[[], Any], repeat: int, *, after: Callable[[], Any] | None = None) -> float:
    """Median seconds of fn over repeat calls after a warm-up; `after` (untimed) runs after
    every call, e.g. to put back what fn changed."""
    samples = []
    for i in range(repeat + 1):
        started = time.perf_counter()
        fn()
        if i:  # the first call pays the pool's connect and the statement cache
            samples.append(time.perf_counter() - started)
        if after is not None:
            after()
    return statistics.median(samples)


def _read(db: Engine, fn: Callable[[Any], Any]) -> Callable[[], Any]:
    def call() -> Any:
        with db.connect() as conn:
            return fn(conn)

    return call


def _write(db: Engine, fn: Callable[[Any], Any]) -> Callable[[], Any]:
    def call() -> Any:
        with db.begin() as conn:
            return fn(conn)

    return call


def time_queries(
    db: Engine, built: build.Ledger, settings: Settings, repeat: int
) -> dict[str, float]:
    from app.ledger import dashboard_queries, metrics_queries
    from workers.control.reconcile import reconcile
    from workers.intake.publish import publish_items

    with db.connect() as conn:
        in_flight = list(
            conn.execute(
                text("SELECT id FROM items WHERE lease_owner = :owner ORDER BY id LIMIT 64"),
                {"owner": build.LIVE_WORKERS[0]},
            ).scalars()
        )
    run_a = built.run_a

    def reconcile_pass() -> None:
        def publish(ids: list[int], wait_s: float) -> None:
            if ids:
                publish_items(ids, batch_size=settings.batch_size, countdown_s=wait_s)

        reconcile(db, settings, run=None, publish=publish)

    def status_all(conn: Any) -> Any:
        return [reads.run_counts(conn, r) for r in run_queries.list_runs(conn)]

    queries: dict[str, Callable[[], Any]] = {
        "hedge search (end of run A, B queued)": _read(
            db, lambda c: ledger_claims.hedge_candidates(c, server="s3", limit=32)
        ),
        # the hedge search's probe of a run that still has work (run B: all queued), as a
        # second worker's leases on run B make it ask
        "hedge search: claimable_left(run B)": _read(
            db, lambda c: ledger_claims.claimable_left(c, built.run_b.id)
        ),
        "finished_among(64 in flight)": _read(
            db, lambda c: ledger_claims.finished_among(c, in_flight)
        ),
        "heartbeat: extend_leases(128)": _write(
            db,
            lambda c: ledger_claims.extend_leases(c, owner=build.LIVE_WORKERS[0], lease_s=300),
        ),
        "watchdog: server_load(s1)": _read(db, lambda c: registry.server_load(c, "s1")),
        "watchdog: active_run_fingerprints": _read(db, registry.active_run_fingerprints),
        "counts: run_counts(run A)": _read(db, lambda c: reads.run_counts(c, run_a)),
        "counts: every run (status)": _read(db, status_all),
        "dashboard tick (status --watch)": _read(db, dashboard_queries.gather_dashboard),
        "metrics: read_snapshot": lambda: metrics_queries.read_snapshot(db),
        "compaction scan: runs_with_compactable": _read(
            db, lambda c: compaction.runs_with_compactable(c, settings.compact_min_items)
        ),
        # as the periodic compaction asks it: "are there compact_min_items?"
        "compaction scan: count_uncompacted(A, up to compact_min_items)": _read(
            db,
            lambda c: compaction.count_uncompacted(c, run_a.id, at_most=settings.compact_min_items),
        ),
        "events: list_events(200)": _read(db, lambda c: registry.list_events(c, limit=200)),
        "reconcile pass": reconcile_pass,
    }
    out: dict[str, float] = {}
    for name, fn in queries.items():
        key = f"{name}, ms"
        after = (lambda: _restore_dead_leases(db, built)) if fn is reconcile_pass else None
        out[key] = 1000 * _timed(fn, repeat, after=after)
        print(f"  {name}: {out[key]:.1f} ms", flush=True)
    out["metrics: /metrics scrape over HTTP, ms"] = 1000 * _time_scrape(db, repeat)
    return out


def _time_scrape(db: Engine, repeat: int) -> float:
    from ops.views.metrics import make_metrics_server

    server = make_metrics_server(
        engine=db, broker_url=REDIS_URL, host="127.0.0.1", port=0, credentials=None, cache_s=0
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        return _timed(lambda: urllib.request.urlopen(server.url, timeout=600).read(), repeat)
    finally:
        server.shutdown()
        server.server_close()


# --- the parity preflight's read of the prompts to check ----------------------------------


def time_preflight(db: Engine, built: build.Ledger, repeat: int) -> dict[str, float]:
    """The preflight's sample (TOKENMILL_PARITY_SAMPLE ids) of run A (rendered from messages)
    and run B (pre-tokenized), beside all of run A's (`tokenmill parity` without --sample)."""
    sample = Settings().parity_sample
    calls: dict[str, Callable[[], Any]] = {
        f"parity preflight: sample_prompt_item_ids(run A, {sample})": _read(
            db, lambda c: reads.sample_prompt_item_ids(c, built.run_a.id, sample, seed=0)
        ),
        f"parity preflight: sample_prompt_item_ids(run B, pre-tokenized, {sample})": _read(
            db, lambda c: reads.sample_prompt_item_ids(c, built.run_b.id, sample, seed=0)
        ),
        "parity, every prompt id: prompt_item_ids(run A)": _read(
            db, lambda c: reads.prompt_item_ids(c, built.run_a.id)
        ),
    }
    found = len(calls[next(iter(calls))]())
    print(f"  the preflight's sample of run A: {found} of {sample} ids", flush=True)
    out: dict[str, float] = {}
    for name, fn in calls.items():
        key = f"{name}, ms"
        out[key] = 1000 * _timed(fn, repeat)
        print(f"  {name}: {out[key]:.2f} ms", flush=True)
    return out


# --- claim and write ------------------------------------------------------------------------


def time_claims(db: Engine, built: build.Ledger) -> dict[str, float]:
    """CLAIM_ROUNDS batches of 32 queued items of run B: claim, then write their results."""
    claims, writes = [], []
    owner = "gen@scale-bench"
    for _ in range(CLAIM_ROUNDS):
        ids = queued_ids(db, built, 0, CLAIM_BATCH)
        started = time.perf_counter()
        with db.begin() as conn:
            claimed = ledger_claims.claim_items(conn, ids, owner=owner, server="s3", lease_s=300)
        claims.append(time.perf_counter() - started)
        outcomes: list[ledger_outcomes.Outcome] = [
            ledger_outcomes.Done(item.id, _result(item.id)) for item in claimed
        ]
        started = time.perf_counter()
        with db.begin() as conn:
            ledger_outcomes.record_outcomes(conn, outcomes, owner=owner, lease_s=300)
        writes.append(time.perf_counter() - started)
    out = {
        f"claim of {CLAIM_BATCH} ids, ms": 1000 * statistics.median(claims),
        f"result write of {CLAIM_BATCH}, ms": 1000 * statistics.median(writes),
    }
    print(f"  claims: {out}", flush=True)
    return out


def _result(item_id: int) -> GenerateResult:
    return GenerateResult(
        rid=f"scale-{item_id}",
        output_ids=[7] * 11 + [build.EOS_ID],
        finish_reason="stop",
        matched_stop=build.EOS_ID,
        prompt_tokens=8,
        completion_tokens=12,
        cached_tokens=0,
        e2e_latency_s=3.2,
    )


# --- export and verify: items per second ----------------------------------------------------


def time_export(db: Engine, built: build.Ledger, repeat: int) -> dict[str, float]:
    out: dict[str, float] = {}
    rows = build.EXPORT_ITEMS * 998 // 1000  # run C's done items
    with tempfile.TemporaryDirectory(prefix="tokenmill-scale-") as tmp:
        env = _command_env(built, Path(tmp))
        commands = {
            "export (specforge, run C), items/s": [
                "export",
                build.RUN_C,
                "--out",
                f"{tmp}/c.jsonl",
            ],
            "verify (run C), items/s": ["verify", build.RUN_C],
            "report (run C), items/s": ["report", build.RUN_C, "--out", f"{tmp}/report"],
        }
        for name, argv in commands.items():
            wall = statistics.median(_run(argv, env)[0] for _ in range(max(1, repeat // 2)))
            out[name] = rows / wall
            print(f"  {name}: {out[name]:,.0f}", flush=True)
    out.update(_stream_run_a(db, built))
    return out


def _stream_run_a(db: Engine, built: build.Ledger) -> dict[str, float]:
    """iter_items (the read path of export, verify and report) over the whole of run A: the
    rate of its first and its last tenth, and of all of it (a page at row 8M costs what a
    page at row 0 does)."""
    with db.connect() as conn:
        total = reads.run_counts(conn, built.run_a).done
        next(reads.iter_items(conn, built.run_a.id))  # warm-up: imports, the first plan
    tenth = max(1, total // 10)
    marks: list[float] = [time.perf_counter()]
    streamed = 0
    with db.connect() as conn:
        for _ in reads.iter_items(conn, built.run_a.id):
            streamed += 1
            if streamed % tenth == 0:
                marks.append(time.perf_counter())
    marks.append(time.perf_counter())
    out = {
        "iter_items(run A), first tenth, items/s": tenth / (marks[1] - marks[0]),
        "iter_items(run A), last tenth, items/s": tenth / (marks[10] - marks[9]),
        "iter_items(run A), whole run, items/s": streamed / (marks[-1] - marks[0]),
    }
    for key, value in out.items():
        print(f"  {key}: {value:,.0f}", flush=True)
    return out


if __name__ == "__main__":
    main()

"""`python bench/scale.py --fleet --sizes 1000000[,10000000]`: the operator's commands while
the fleet works, on a large ledger against an empty one under the same load (issue 32).

For each size, bench/scale_build.py's ledger (run A at its end, run B queued) gets a bulk
enqueue on top: run D, a fifth of the size more queued items inserted after the statistics
were taken, with autovacuum off on items, so the planner's statistics stay those of before
the enqueue for the whole measurement. An empty ledger (the same runs and servers, no item)
sits beside it. On the large ledger one `celery -A app worker` bound to an emulator works
run B (FLEET_MESSAGES of its ids are published) and `celery -A app beat` runs the watchdog,
reconcile and compaction. Meanwhile each command runs as `python -m ops ...` (start-up
included) against the large ledger and against the empty one in turn, REPEAT times each:
the table gives the medians and their ratio, measured under the same load in the same run.
Both databases log every statement of SLOW_MS or more (ALTER DATABASE ... SET
log_min_duration_statement, reset at the end); every one logged from the end of the enqueue
to the end of the run is listed.

The worker's CPU per item is measured in the same run: its process's CPU seconds (the threads
pool: one process) over the items of run B it finished, from when it is at work to the last
item it finished while the commands ran, so that 10K and 10M queued items compare in one run.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import scale_build as build
from common import (
    ROOT,
    emulator,
    engine_for,
    flush_redis,
    machine_note,
    service_env,
    table,
)
from scale_broker import REDIS_URL, queued_ids
from scale_slowlog import (
    SERVER_LOG,
    checkpoint,
    explain,
    fleet,
    logged_statements,
    serve_runs_with,
    set_database,
    set_slow_log,
)
from sqlalchemy import Engine, text

from app.core.contracts import SamplingParams
from app.ledger import common, run_queries

REPEAT = 3
SLOW_MS = 100
FLEET_MESSAGES = 60_000
CONNECT_TRIES = 5
STATEMENT_CHARS = 160  # statements are grouped by their first characters
PLAN_LINES = 12  # of each group's EXPLAIN ANALYZE (--explain-slow)
RUN_D = "scale-d"
CPU_SAMPLE_S = 1.0  # how often the worker's CPU and run B's done items are read
EMPTY = 0  # the empty ledger's "size" (its database name)
COMMANDS: tuple[tuple[str, list[str]], ...] = (
    ("status RUN", ["status", build.RUN_B]),
    ("status", ["status"]),
    ("servers", ["servers"]),
    ("events --run", ["events", "--run", build.RUN_B]),
    ("reconcile", ["reconcile"]),
)


def main(
    sizes: list[int],
    tokenizer: tuple[str, str, str],
    repeat: int = REPEAT,
    *,
    explain_slow: bool = False,
    synchronous_commit: str | None = None,
) -> None:
    """explain_slow: EXPLAIN ANALYZE the slowest of each group of slow statements on the large
    ledger after the run; synchronous_commit: that setting on both ledgers for the run ("off"
    tells a COMMIT's wait for the WAL flush from a plan's cost)."""
    print(f"scale --fleet: {machine_note()}", flush=True)
    if synchronous_commit is not None:
        print(f"synchronous_commit = {synchronous_commit} on both ledgers", flush=True)
    print("building the empty ledger", flush=True)
    empty = _empty(tokenizer)
    rows: list[list[Any]] = []
    cpu: dict[int, WorkerCpu] = {}
    slow: dict[int, list[tuple[float, str]]] = {}
    plans: dict[str, list[str]] = {}
    try:
        for size in sizes:
            print(f"building {size:,} items", flush=True)
            built = build.build(size, *tokenizer)
            try:
                offset, timings, cpu[size] = _measure(built, empty, repeat, synchronous_commit)
                logged = [
                    hit
                    for name in (build.database_name(size), build.database_name(EMPTY))
                    for hit in logged_statements(offset, name)
                ]
                slow[size] = [(ms, statement) for ms, statement, _ in logged]
                if explain_slow:
                    plans |= _explain_groups(built.url, logged)
            finally:
                build.drop(size)
            for name, (large, none) in timings.items():
                large_s, empty_s = statistics.median(large), statistics.median(none)
                rows.append([f"{size:,}", name, large_s, empty_s, f"{large_s / empty_s:.2f}"])
    finally:
        build.drop(EMPTY)
    print()
    print(table(["items", "command", "median s", "empty ledger s", "ratio"], rows))
    print()
    first = next(iter(cpu.values()), None)
    cpu_rows = [
        [
            f"{size:,}",
            f"{c.queued:,}",
            f"{c.items:,}",
            f"{c.seconds:.0f}",
            c.ms_per_item,
            f"{c.ms_per_item / first.ms_per_item:.2f}" if first and first.items else "-",
        ]
        for size, c in cpu.items()
    ]
    headers = ["items", "queued", "items done", "over s", "worker cpu ms/item", "ratio"]
    print(table(headers, cpu_rows))
    for size, hits in slow.items():
        print(f"\nstatements of {SLOW_MS} ms or more at {size:,} items: {len(hits)}")
        groups: dict[str, list[float]] = {}
        for ms, statement in hits:
            groups.setdefault(statement[:STATEMENT_CHARS], []).append(ms)
        for statement, times in sorted(groups.items(), key=lambda g: -max(g[1])):
            print(f"  {len(times):4d} x, {min(times):7.1f}-{max(times):7.1f} ms  {statement}")
            for line in plans.get(statement, [])[:PLAN_LINES]:
                print(f"        {line}")


def _explain_groups(
    url: str, logged: list[tuple[float, str, dict[str, str]]]
) -> dict[str, list[str]]:
    """Per group of slow statements (by their first STATEMENT_CHARS characters): the EXPLAIN
    ANALYZE of its slowest one on the large ledger as it is after the run."""
    slowest: dict[str, tuple[float, str, dict[str, str]]] = {}
    for hit in logged:
        key = hit[1][:STATEMENT_CHARS]
        if key not in slowest or hit[0] > slowest[key][0]:
            slowest[key] = hit
    return {key: explain(url, statement, params) for key, (_, statement, params) in slowest.items()}


def _empty(tokenizer: tuple[str, str, str]) -> build.Ledger:
    """The empty ledger: built with no item of runs A and B, then run C's deleted."""
    empty = build.build(EMPTY, *tokenizer)
    db = engine_for(empty.url)
    try:
        with db.begin() as conn:
            conn.execute(text("DELETE FROM items"))
    finally:
        db.dispose()
    return empty


def _bulk_enqueue(db: Engine, size: int) -> None:
    """Run D: size // 5 queued items, inserted after the statistics, autovacuum off."""
    with db.begin() as conn:
        conn.execute(text("ALTER TABLE items SET (autovacuum_enabled = off)"))
        spec = run_queries.RunSpec(
            name=RUN_D,
            tokenizer_path="/synthetic",
            tokenizer_hash="d" * 64,
            chat_template_hash="d" * 64,
            chat_template_kwargs={},
            sampling=SamplingParams(max_new_tokens=build.MAX_NEW_TOKENS, seed=1),
            samples_per_prompt=4,
            think_end_id=None,
            eos_token_ids=[build.EOS_ID],
        )
        run, _ = run_queries.get_or_create_run(conn, spec)
    started = time.monotonic()
    build.insert_items(db, run.id, size // 5, build.QUEUED_ROW, common.utcnow())
    print(f"  bulk enqueue of {size // 5:,} items in {time.monotonic() - started:.0f}s")


def _measure(
    built: build.Ledger, empty: build.Ledger, repeat: int, synchronous_commit: str | None
) -> tuple[int, dict[str, tuple[list[float], list[float]]], WorkerCpu]:
    db = engine_for(built.url)
    names = (build.database_name(built.size), build.database_name(EMPTY))
    try:
        with _emulated(db) as servers, tempfile.TemporaryDirectory(prefix="tm-fleet-") as tmp:
            for name in names:
                set_slow_log(SLOW_MS, name)
                if synchronous_commit is not None:
                    set_database(name, "synchronous_commit", synchronous_commit)
            offset = SERVER_LOG.stat().st_size
            _bulk_enqueue(db, built.size)
            _publish_run_b(db, built)
            # the build's and the enqueue's dirty pages are written now, not while timing
            print(f"  CHECKPOINT in {checkpoint():.1f}s", flush=True)
            queued = _queued(db)
            pids: list[int] = []
            with _fleet(built, servers, Path(tmp), pids), _WorkerMeter(db, built, pids) as meter:
                timings = _time_commands(built, empty, Path(tmp), repeat)
    finally:
        for name in names:
            set_slow_log(None, name)
        db.dispose()
    cpu = meter.result(queued)
    print(f"  worker: {cpu.ms_per_item:.2f} ms cpu per item over {cpu.items:,} items", flush=True)
    return offset, timings, cpu


def _queued(db: Engine) -> int:
    """Queued items of every run, from the item counters."""
    with db.connect() as conn:
        return int(
            conn.execute(
                text("SELECT coalesce(sum(item_count), 0) FROM item_counts WHERE status = 'queued'")
            ).scalar_one()
        )


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class WorkerCpu:
    queued: int  # items queued in the ledger when the fleet started
    items: int  # run B's items the worker finished in the span
    seconds: float  # the span: from the first reading to the last one with more items done
    cpu_s: float

    @property
    def ms_per_item(self) -> float:
        return 1000 * self.cpu_s / self.items if self.items else float("nan")


class _WorkerMeter:
    """Reads the workers' CPU seconds and run B's done items every CPU_SAMPLE_S in a thread."""

    def __init__(self, db: Engine, built: build.Ledger, pids: list[int]) -> None:
        self._db, self._run_id, self._pids = db, built.run_b.id, pids
        self._readings: list[tuple[float, float, int]] = []  # (time, cpu s, done)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _WorkerMeter:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _read(self) -> tuple[float, float, int]:
        done = _done(self._db, self._run_id)
        return time.monotonic(), sum(_cpu_s(pid) for pid in self._pids), done

    def _loop(self) -> None:
        while True:
            self._readings.append(self._read())
            if self._stop.wait(CPU_SAMPLE_S):
                return

    def result(self, queued: int) -> WorkerCpu:
        first = self._readings[0]
        last = first
        for reading in self._readings:
            if reading[2] > last[2]:
                last = reading
        return WorkerCpu(queued, last[2] - first[2], last[0] - first[0], last[1] - first[1])


@contextlib.contextmanager
def _emulated(db: Engine) -> Iterator[dict[str, str]]:
    emu_args = ["--step-ms", "5", "--median-tokens", "16", "--sigma", "0.5"]
    emu_args += ["--max-running", "64", "--log-level", "warning"]
    with emulator(emu_args) as emu:
        servers = {"s3": emu.url}
        serve_runs_with(db, servers)
        yield servers


def _publish_run_b(db: Engine, built: build.Ledger) -> None:
    from workers.intake.publish import publish_items

    flush_redis(REDIS_URL)
    ids = queued_ids(db, built, 0, FLEET_MESSAGES)
    publish_items(ids, batch_size=32, run=build.RUN_B)


@contextlib.contextmanager
def _fleet(
    built: build.Ledger, servers: dict[str, str], tmp: Path, pids: list[int]
) -> Iterator[None]:
    with fleet(built.url, servers, tmp, REDIS_URL, pids):
        _wait_working(built)
        yield


def _wait_working(built: build.Ledger, timeout_s: float = 180) -> None:
    """Until the worker has finished items of run B (the fleet is at work)."""
    db = engine_for(built.url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            done = _done(db, built.run_b.id)
            if done > 0:
                print(f"  the worker is at work ({done} items of run B done)", flush=True)
                return
            time.sleep(2)
    finally:
        db.dispose()
    raise RuntimeError("the worker finished no item of run B in time")


def _done(db: Engine, run_id: int) -> int:
    """The run's done items, from the item counters."""
    with db.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT coalesce(sum(item_count), 0) FROM item_counts "
                    "WHERE run_id = :r AND status = 'done'"
                ),
                {"r": run_id},
            ).scalar_one()
        )


def _command_env(ledger: build.Ledger, tmp: Path) -> dict[str, str]:
    env = service_env(ledger.url, REDIS_URL, tmp, TOKENMILL_STORAGE_URL=str(tmp / "storage"))
    env["PYTHONPATH"] = str(ROOT)
    return env


def _wall(argv: list[str], env: dict[str, str]) -> float:
    """Wall seconds of `tokenmill ARGV`; a run refused a connection (the shared Postgres at
    max_connections) is run again, untimed, up to CONNECT_TRIES times."""
    for _ in range(CONNECT_TRIES):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "ops", *argv], env=env, cwd=ROOT, capture_output=True, text=True
        )
        wall = time.perf_counter() - started
        if done.returncode == 0:
            return wall
        if "too many clients" not in done.stderr:
            break
        time.sleep(5)
    raise RuntimeError(f"tokenmill {' '.join(argv)} failed:\n{done.stderr[-2000:]}")


def _time_commands(
    built: build.Ledger, empty: build.Ledger, tmp: Path, repeat: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Each command on the large and the empty ledger in turn, repeat times."""
    envs = (_command_env(built, tmp), _command_env(empty, tmp))
    out: dict[str, tuple[list[float], list[float]]] = {}
    for name, argv in COMMANDS:
        large: list[float] = []
        none: list[float] = []
        for _ in range(repeat):
            large.append(_wall(argv, envs[0]))
            none.append(_wall(argv, envs[1]))
        out[name] = (large, none)
        ratio = statistics.median(large) / statistics.median(none)
        print(
            f"  {name}: {statistics.median(large):.3f} s, empty {statistics.median(none):.3f} s"
            f" ({ratio:.2f})",
            flush=True,
        )
    return out

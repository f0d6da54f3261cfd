"""`python bench/fleet_control.py [--servers 256] [--workers 64] [--probe-ms 0,500]`: the control
plane at fleet size (issue 40).

A private Postgres cluster (bench/fleet_cluster.py) holds a ledger with --servers registered
servers, --workers workers among them and a run with 64 items in flight on each server. The
servers are stand-ins in this process: one small HTTP server per port answering
`/health_generate` after --probe-ms (a loaded SGLang answers its one-token generation check in
tens to hundreds of milliseconds), `/health` and `/model_info` at once. It times:

- the watchdog's round (workers/control/watchdog.py run_watchdog: every server probed, its
  verdict recorded), for each --probe-ms and each --probes-at-once, against its period
  (TOKENMILL_WATCHDOG_INTERVAL_S);
- `tokenmill servers`, `tokenmill status` and `tokenmill reconcile` as an operator runs them
  (`python -m ops ...`, start-up included), and the lines `servers` prints;
- the dashboard (`status --watch`): one tick's queries and its frame at 160 columns, its lines;
- one scrape of `tokenmill metrics` (/metrics), its lines.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from fleet import create_run, enqueue
from fleet_cluster import Cluster, free_port
from fleet_phase import print_table
from rich.console import Console
from sqlalchemy import Engine

from app.core.settings import Settings
from app.ledger import claims, dashboard_queries, database, migrate, registry
from ops.views.dashboard import render_dashboard
from workers.control import watchdog

ROOT = Path(__file__).resolve().parents[1]
IN_FLIGHT = 64  # items leased to each server
ROUNDS = 3
REPEAT = 3
BROKER_URL = os.environ.get("TOKENMILL_BENCH_BROKER_URL", "redis://127.0.0.1:6379/13")
MODEL_INFO = b'{"model_path": "stand-in/model", "weight_version": "1", "is_generation": true}'


class _StandIn(BaseHTTPRequestHandler):
    delay_s = 0.0

    def do_GET(self) -> None:
        if self.path.startswith("/health_generate"):
            time.sleep(type(self).delay_s)
        info = self.path.startswith(("/model_info", "/server_info"))
        body = MODEL_INFO if info else b""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@contextmanager
def stand_in_servers(count: int) -> Iterator[list[str]]:
    """count HTTP servers on free ports of 127.0.0.1; their URLs."""
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _StandIn) for _ in range(count)]
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


class NoControl:
    """Celery's remote control stands aside: pauses are ledger flags here."""

    def cancel_consumer(self, workers: list[str]) -> None:
        pass

    def add_consumer(self, workers: list[str]) -> None:
        pass


def fleet_ledger(db: Engine, urls: list[str], workers: int) -> None:
    """urls registered as servers srv-NNN, workers spread over them, IN_FLIGHT items leased to
    each."""
    names = [f"srv-{i:03d}:30000" for i in range(len(urls))]
    with db.begin() as conn:
        for name, url in zip(names, urls, strict=True):
            registry.upsert_server(conn, name, url)
        for i in range(workers):
            name = names[i * len(names) // workers]
            registry.add_worker(conn, name, f"{name}@node-{i}")
    run_id = create_run(db, "busy")
    ids, _ = enqueue(db, run_id, IN_FLIGHT * len(urls), seed=3)
    with db.begin() as conn:
        for i, name in enumerate(names):
            chunk = ids[i * IN_FLIGHT : (i + 1) * IN_FLIGHT]
            claims.claim_items(conn, chunk, owner=f"{name}@node", server=name, lease_s=3600)


def watchdog_rounds(db: Engine, settings: Settings, probe_ms: int) -> list[float]:
    _StandIn.delay_s = probe_ms / 1000
    seconds = []
    for _ in range(ROUNDS):
        started = time.monotonic()
        states = watchdog.run_watchdog(db, settings, NoControl())
        seconds.append(time.monotonic() - started)
        bad = {s for s in states.values() if s not in ("healthy", "suspect", "unknown")}
        if bad:
            raise SystemExit(f"watchdog verdicts: {sorted(bad)}")
    return seconds


def command(url: str, data_dir: Path, *args: str) -> tuple[float, str]:
    """Median seconds of `tokenmill ARGS` (REPEAT runs) and its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env |= {
        "TOKENMILL_DATABASE_URL": url,
        "TOKENMILL_BROKER_URL": BROKER_URL,
        "TOKENMILL_DATA_DIR": str(data_dir),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "160",
    }
    seconds, out = [], ""
    for _ in range(REPEAT):
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "ops", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        seconds.append(time.monotonic() - started)
        if done.returncode != 0:
            raise SystemExit(f"tokenmill {' '.join(args)}: {done.stderr}")
        out = done.stdout
    return statistics.median(seconds), out


def dashboard_tick(db: Engine) -> tuple[float, list[str]]:
    seconds, lines = [], []
    for _ in range(REPEAT):
        started = time.monotonic()
        with db.connect() as conn:
            database.limit_periodic(conn)
            board = dashboard_queries.gather_dashboard(conn)
        console = Console(file=io.StringIO(), width=160, color_system=None)
        console.print(render_dashboard(board, interval_s=2.0, width=160))
        seconds.append(time.monotonic() - started)
        lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    return statistics.median(seconds), lines


def metrics_scrape(url: str, data_dir: Path) -> tuple[float, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env |= {
        "TOKENMILL_DATABASE_URL": url,
        "TOKENMILL_BROKER_URL": BROKER_URL,
        "TOKENMILL_DATA_DIR": str(data_dir),
        "TOKENMILL_METRICS_CACHE_S": "0",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops", "metrics", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        seconds, lines = [], 0
        for _ in range(REPEAT):
            started = time.monotonic()
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text
            seconds.append(time.monotonic() - started)
            lines = len(text.splitlines())
        return statistics.median(seconds), lines
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=256)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--probe-ms", default="0,500", help="comma-separated probe latencies")
    parser.add_argument(
        "--probes-at-once",
        default=f"16,{watchdog.PROBES_AT_ONCE}",
        help="comma-separated watchdog concurrencies to time (16: before issue 40)",
    )
    args = parser.parse_args()
    cluster = Cluster({"max_connections": "200"})
    cluster.start()
    rows: list[list[str]] = []
    try:
        url = cluster.create_database("control")
        db = database.make_engine(url, pool_size=3)
        migrate.upgrade(db)
        settings = Settings(database_url=url, broker_url=BROKER_URL)
        period = settings.watchdog_interval_s
        with stand_in_servers(args.servers) as urls, tempfile.TemporaryDirectory() as data:
            fleet_ledger(db, urls, args.workers)
            for at_once in (int(n) for n in args.probes_at_once.split(",")):
                watchdog.PROBES_AT_ONCE = at_once
                for probe_ms in (int(p) for p in args.probe_ms.split(",")):
                    rounds = watchdog_rounds(db, settings, probe_ms)
                    rows.append(
                        [
                            f"watchdog round, {at_once} probes at once answering in {probe_ms} ms",
                            f"{statistics.median(rounds):.2f} s (period {period:g} s)",
                            "",
                        ]
                    )
            for name, argv in (
                ("tokenmill servers", ["servers"]),
                ("tokenmill status", ["status"]),
                ("tokenmill reconcile", ["reconcile"]),
            ):
                seconds, out = command(url, Path(data), *argv)
                first = out.splitlines()[0] if out else ""
                lines = f"{len(out.splitlines())} lines; first: {first[:70]}"
                rows.append([name, f"{seconds:.2f} s", lines if argv == ["servers"] else ""])
            seconds, frame = dashboard_tick(db)
            title = next((line.strip() for line in frame if "servers:" in line), "")
            rows.append(["dashboard tick", f"{seconds:.2f} s", f"{len(frame)} lines; {title}"])
            seconds, count = metrics_scrape(url, Path(data))
            rows.append(["/metrics scrape", f"{seconds:.2f} s", f"{count} lines"])
        db.dispose()
    finally:
        cluster.stop()
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"bench/fleet_control.py --servers {args.servers} --workers {args.workers} "
        f"--probe-ms {args.probe_ms} --probes-at-once {args.probes_at_once}, {when}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
        f"medians of {ROUNDS} rounds / {REPEAT} runs"
    )
    print_table(["what", "took", "output"], rows)


if __name__ == "__main__":
    main()

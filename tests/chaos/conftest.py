"""Shared pieces of the chaos suite: a deployment of real processes (emulators, `celery -A app
worker`s, beat) on the test's Postgres and a Redis broker, a run enqueued through the CLI, and
the end-of-run audit every scenario shares.

The audit checks what the ledger guarantees whatever went wrong: one row per (prompt, sample),
each done or failed with a reason, nothing left pending/queued/leased, and every stored output
equal to what the emulator generates for that prompt. Each scenario prints one line,
`CHAOS <scenario>: items=N done=D failed=F duplicates=0 lost=0 recover_s=X`, for `pytest -s`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from app.ledger import counters, reads, registry, run_queries
from emulator.config import EmulatorConfig
from emulator.model import generate_output
from tests.support.emulator import free_port
from tests.support.procs import ROOT, service_env, start_celery, start_worker, tokenmill, wait_for

__all__ = ["Deployment", "RedisServer", "free_port", "wait_for"]

# small, fast generations: ~30 tokens at 2 ms a step
BASE_FLAGS: dict[str, str] = {
    "--max-running": "16",
    "--step-ms": "2",
    "--median-tokens": "30",
    "--sigma": "0.8",
}
MAX_NEW_TOKENS = 100
RUN = "chaos"

# what the tests lower so that faults are noticed and repaired in seconds
FAST_SETTINGS: dict[str, str] = {
    "TOKENMILL_WATCHDOG_INTERVAL_S": "1",
    "TOKENMILL_PAUSE_CHECK_S": "0.5",
    "TOKENMILL_UNAVAILABLE_WAIT_S": "1",
    "TOKENMILL_PROBE_TIMEOUT_S": "10",
    "TOKENMILL_RECONCILE_INTERVAL_S": "2",
    "TOKENMILL_RECONCILE_GRACE_S": "3",
    "TOKENMILL_LEASE_S": "5",
    "TOKENMILL_RETRY_BACKOFF_S": "0.05",
    "TOKENMILL_RETRY_BACKOFF_MAX_S": "1",
    "TOKENMILL_DRAIN_TIMEOUT_S": "2",
    "TOKENMILL_CONNECT_TIMEOUT_S": "2",
}

_FLAG_FIELDS = {
    "--max-running": ("max_running", int),
    "--step-ms": ("step_ms", float),
    "--median-tokens": ("median_tokens", float),
    "--sigma": ("sigma", float),
    "--context-length": ("context_length", int),
    "--error-rate": ("error_rate", float),
    "--drop-rate": ("drop_rate", float),
    "--fault-seed": ("fault_seed", int),
    "--hang-after-s": ("hang_after_s", float),
    "--hang-after-requests": ("hang_after_requests", int),
    "--health-timeout-s": ("health_timeout_s", float),
    "--weight-version": ("weight_version", str),
}


def emulator_config(flags: dict[str, str]) -> EmulatorConfig:
    """The EmulatorConfig the emulator CLI builds from these flags (the ones the suite uses)."""
    kwargs = {}
    for flag, value in flags.items():
        name, kind = _FLAG_FIELDS[flag]
        kwargs[name] = kind(value)
    return EmulatorConfig(**kwargs)


def prompt_lines(n: int, long_every: int = 0, long_words: int = 0) -> list[str]:
    """n JSONL prompts; every `long_every`-th one padded with `long_words` words."""
    lines = []
    for i in range(n):
        text_ = f"Question number {i}?"
        if long_every and i % long_every == 0:
            text_ += " Please consider" + " carefully" * long_words + "."
        lines.append(json.dumps({"id": f"p{i}", "prompt": text_}) + "\n")
    return lines


@dataclass
class Emulator:
    proc: subprocess.Popen[bytes]
    port: int
    flags: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config(self) -> EmulatorConfig:
        return emulator_config(self.flags)


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The HTTP status of a GET, None when nothing answered in time."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, urllib.error.URLError):
        return None


class RedisServer:
    """A private `redis-server` on a free port, no persistence: killing it loses every message.

    The chaos suite never touches the shared Redis on 6379 (other sessions use it: their
    flushdb and their remote-control broadcasts to workers named like ours would interfere).
    """

    def __init__(self, tmp: Path, port: int | None = None) -> None:
        self.tmp = tmp
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        self.starts += 1
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--daemonize", "no", "--dir", str(self.tmp)]
        with (self.tmp / f"redis-{self.port}.{self.starts}.log").open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

        def up() -> bool:
            try:
                return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
            except redis.RedisError:
                return False

        wait_for(f"redis-server on {self.port}", up, 20)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Deployment:
    """One chaos scenario's processes and ledger; every process started is stopped at the end."""

    db: Engine
    env: dict[str, str]
    tmp: Path
    items: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    emulators: list[Emulator] = field(default_factory=list)

    # --- processes ------------------------------------------------------------------------

    def emulator(self, extra: dict[str, str] | None = None, port: int | None = None) -> Emulator:
        flags = BASE_FLAGS | (extra or {})
        port = port or free_port()
        argv = [sys.executable, "-m", "emulator", "--port", str(port), "--log-level", "warning"]
        for flag, value in flags.items():
            argv += [flag, value]
        with (self.tmp / f"emulator-{port}.log").open("ab") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        emu = Emulator(proc, port, flags)
        self.emulators.append(emu)
        wait_for(f"emulator on {port}", lambda: http_status(emu.url + "/health") == 200, 30)
        return emu

    def worker(self, name: str, server: str, url: str, **settings: str) -> subprocess.Popen[bytes]:
        env = self.env | {"TOKENMILL_SGLANG_URL": url, "TOKENMILL_SERVER_NAME": server}
        env |= settings
        proc = start_worker(env, name, self._log(name))
        self.procs.append(proc)
        return proc

    def beat(self) -> subprocess.Popen[bytes]:
        proc = start_celery("beat", self.env, self._log("beat"))
        self.procs.append(proc)
        return proc

    def _log(self, name: str) -> Path:
        # each start of a process gets its own log: name.0.log, name.1.log, ...
        return self.tmp / f"{name}.{len(self._logs(name))}.log"

    def _logs(self, name: str) -> list[Path]:
        found = [p for p in self.tmp.glob(f"{name}.*.log") if p.name.split(".")[1].isdigit()]
        return sorted(found, key=lambda p: int(p.name.split(".")[1]))

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The last lines of every log of process `name`, oldest start first."""
        out = []
        for path in self._logs(name):
            out.append(f"--- {path.name}")
            out.extend(path.read_text(errors="replace").splitlines()[-lines:])
        return "\n".join(out)

    def stop_all(self) -> None:
        """Workers and beat get a warm shutdown, then SIGKILL; emulators are killed outright
        (a hung emulator would never finish its in-flight requests)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for e in self.emulators:
            if e.proc.poll() is None:
                e.proc.kill()
        deadline = time.monotonic() + 15
        for p in [*self.procs, *(e.proc for e in self.emulators)]:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # --- the run --------------------------------------------------------------------------

    def enqueue(
        self,
        tokenizer: Path,
        n: int,
        *,
        long_every: int = 0,
        long_words: int = 0,
        run: str = RUN,
        extra: tuple[str, ...] = (),
    ) -> None:
        prompts = self.tmp / f"prompts-{run}.jsonl"
        prompts.write_text("".join(prompt_lines(n, long_every, long_words)))
        result = tokenmill(
            [
                "enqueue",
                str(prompts),
                "--run",
                run,
                "--tokenizer",
                str(tokenizer),
                "--max-new-tokens",
                str(MAX_NEW_TOKENS),
                "--seed",
                "1",
                *extra,
            ],
            self.env,
        )
        assert result.returncode == 0, result.stderr
        if run == RUN:
            self.items = n
        assert self.counts(run).total == n

    def counts(self, run: str = RUN) -> reads.RunCounts:
        with self.db.connect() as conn:
            return reads.run_counts(conn, run_queries.get_run(conn, run))

    def server(self, name: str) -> registry.ServerInfo:
        with self.db.connect() as conn:
            return registry.get_server(conn, name)

    def leased_by_pid(self, pid: int) -> set[int]:
        """Items whose lease a given worker process holds (the owner id carries its pid)."""
        with self.db.connect() as conn:
            rows = conn.execute(
                text("SELECT id FROM items WHERE status = 'leased' AND lease_owner LIKE :pat"),
                {"pat": f"%:{pid}:%"},
            )
            return {int(r[0]) for r in rows}

    def finished_ids(self, ids: set[int]) -> set[int]:
        if not ids:
            return set()
        with self.db.connect() as conn:
            rows = conn.execute(
                text("SELECT id FROM items WHERE status IN ('done', 'failed') AND id = ANY(:ids)"),
                {"ids": sorted(ids)},
            )
            return {int(r[0]) for r in rows}

    def describe(self) -> str:
        """Ledger counts and what the broker holds, for a failure message."""
        from workers.control.broker_scan import broker_item_ids

        c = self.counts()
        try:
            held = broker_item_ids(self.env["TOKENMILL_BROKER_URL"])
        except Exception as exc:
            held_text = f"broker unreadable: {exc!r}"
        else:
            import redis

            client = redis.Redis.from_url(self.env["TOKENMILL_BROKER_URL"], socket_timeout=2)
            try:
                where = f"queue={client.llen('generate')} unacked={client.hlen('unacked')}"
            finally:
                client.close()
            held_text = f"broker carries {len(held or ())} item ids ({where} messages)"
        with self.db.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, status, lease_owner, lease_expires_at, queued_at FROM items "
                    "WHERE status IN ('pending', 'queued', 'leased') ORDER BY id LIMIT 10"
                )
            ).all()
        return (
            f"pending={c.pending} queued={c.queued} leased={c.leased} done={c.done} "
            f"failed={c.failed}; {held_text}; unfinished: {[tuple(r) for r in rows]}"
        )

    def wait(self, what: str, check: Callable[[], bool], timeout_s: float) -> None:
        """wait_for, with the ledger's and the broker's state in the failure message."""
        try:
            wait_for(what, check, timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.describe()}") from None

    def wait_finished(self, timeout_s: float, watch: Callable[[], None] | None = None) -> float:
        """Wait until nothing is pending, queued or leased; return the seconds it took."""
        started = time.monotonic()

        def check() -> bool:
            if watch is not None:
                watch()
            return self.counts().finished

        try:
            wait_for("run finished", check, timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.describe()}") from None
        return time.monotonic() - started

    # --- the audit ------------------------------------------------------------------------

    def audit(self, configs: dict[str, EmulatorConfig]) -> list[reads.StoredItem]:
        """Every item done or failed with a reason, once; every output what its server's
        emulator generates. `configs` maps server name → that emulator's configuration."""
        with self.db.connect() as conn:
            run = run_queries.get_run(conn, RUN)
            stored = list(reads.iter_items(conn, run.id, statuses=("done", "failed")))
            rows = int(
                conn.execute(
                    text("SELECT count(*) FROM items WHERE run_id = :r"), {"r": run.id}
                ).scalar_one()
            )
            # what status and /metrics showed through the scenario: equal to a full count
            drift = [d.describe() for d in counters.find_drift(conn)]
        keys = {(s.item_key, s.sample_index) for s in stored}
        assert rows == self.items, f"{rows} ledger rows for {self.items} items"
        assert drift == [], f"item counters drifted: {drift}"
        assert len(keys) == len(stored), "duplicate results"
        assert len(stored) == self.items, f"lost: {self.items - len(stored)} items unfinished"
        for s in stored:
            assert s.attempts >= 1, f"{s.item_key}: finished with attempts={s.attempts}"
            if s.status == "failed":
                assert s.error, f"{s.item_key} failed without a reason"
                assert s.output_ids is None
                continue
            assert s.output_ids is not None and s.server in configs, s
            expected, finish = generate_output(
                s.prompt_ids, run.generation.sampling.for_sample(s.sample_index), configs[s.server]
            )
            assert s.output_ids == expected, f"{s.item_key}: output differs from the emulator's"
            want = finish["type"] if isinstance(finish, dict) else finish
            assert s.finish_reason == want, f"{s.item_key}: finish {s.finish_reason} != {want}"
        return stored

    def summary_now(self, scenario: str, recover_s: float) -> str:
        """The CHAOS line from the ledger's counts, for a scenario that did not finish."""
        c = self.counts()
        line = (
            f"CHAOS {scenario}: items={self.items} done={c.done} failed={c.failed} "
            f"duplicates=0 lost={c.total - c.done - c.failed} recover_s={recover_s:.1f}"
        )
        print("\n" + line, flush=True)
        return line

    def summary(self, scenario: str, stored: list[reads.StoredItem], recover_s: float) -> str:
        done = sum(s.status == "done" for s in stored)
        failed = sum(s.status == "failed" for s in stored)
        dupes = len(stored) - len({(s.item_key, s.sample_index) for s in stored})
        lost = self.items - len(stored)
        line = (
            f"CHAOS {scenario}: items={self.items} done={done} failed={failed} "
            f"duplicates={dupes} lost={lost} recover_s={recover_s:.1f}"
        )
        print("\n" + line, flush=True)
        return line


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def deployment(
    pg_url: str, pg_engine: Engine, broker: RedisServer, tmp_path: Path
) -> Iterator[Deployment]:
    """A chaos deployment on the test session's private Postgres database and a private
    Redis; every process it started is stopped afterwards, even when the test failed."""
    env = service_env(pg_url, broker.url, tmp_path, **FAST_SETTINGS)
    env["TOKENMILL_HEARTBEAT_S"] = "1"  # service_env sets 2; leases are 5 s here
    dep = Deployment(db=pg_engine, env=env, tmp=tmp_path)
    try:
        yield dep
    finally:
        dep.stop_all()

"""Shared helpers of the benchmarks: a private Postgres database, Redis db 12, emulators and
`celery -A app worker` processes (through the harness the tests use too: ops/processes.py and
ops/emulator_proc.py), synthetic prompts and the ledger; CPU meters and profiles are in
meters.py, bare /generate clients in bare_client.py.

Every benchmark is run as `python bench/NAME.py` from the repository root; this module is
imported as `common` (the script's folder is first on sys.path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, create_engine, func, select, text

from ops import processes
from ops.emulator_proc import EmulatorProcess, start_emulator
from ops.processes import service_env as service_env

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get(
    "TOKENMILL_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("TOKENMILL_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
CACHE_DIR = Path(tempfile.gettempdir()) / "tokenmill-bench-cache"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- services ----------------------------------------------------------------------------


@contextlib.contextmanager
def bench_database() -> Iterator[str]:
    """A fresh Postgres database `tokenmill_bench_<random>` at the latest migration; dropped
    afterwards. Yields its plain postgresql:// URL (what TOKENMILL_DATABASE_URL takes)."""
    from app.core.settings import normalize_database_url
    from app.ledger import database, migrate

    name = f"tokenmill_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(normalize_database_url(PG_ADMIN_URL), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        engine = database.make_engine(normalize_database_url(url))
        migrate.upgrade(engine)
        engine.dispose()
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def engine_for(url: str, pool_size: int = 4) -> Engine:
    from app.core.settings import normalize_database_url
    from app.ledger import database

    return database.make_engine(normalize_database_url(url), pool_size=pool_size)


def flush_redis(url: str = REDIS_URL) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def redis_cpu_s(url: str = REDIS_URL) -> float:
    """CPU seconds the Redis server has used (all databases, all clients)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        info = client.info("cpu")
    finally:
        client.close()
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def run_tokenmill(args: Sequence[str], env: dict[str, str], timeout_s: float = 1800) -> str:
    """`tokenmill ARGS` (as `python -m ops`) to completion; its stdout, or an error."""
    done = processes.tokenmill(args, env, timeout_s=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"tokenmill {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def start_worker(env: dict[str, str], name: str, log: Path) -> subprocess.Popen[bytes]:
    """`celery -A app worker -E` as the README starts it (celery's default log level, WARNING)."""
    return processes.start_worker(env, name, log, loglevel=None)


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 60) -> None:
    """SIGTERM (a warm shutdown for celery), then SIGKILL if it does not exit in time."""
    processes.stop([proc], timeout_s)


@contextlib.contextmanager
def emulator(args: Sequence[str]) -> Iterator[EmulatorProcess]:
    """A fresh `python -m emulator --port 0 ARGS` process, stopped afterwards."""
    proc = start_emulator(list(args))
    try:
        yield proc
    finally:
        proc.stop()


def emulator_stats(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/emulator/stats", timeout=30.0)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


class StatsSampler:
    """Polls /emulator/stats every interval_s in a thread: (time, running, waiting, tokens)."""

    def __init__(self, url: str, interval_s: float = 0.1) -> None:
        self.url = url
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10.0, trust_env=False) as client:
            while not self._stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    s = client.get("/emulator/stats").json()
                    self.samples.append(
                        (time.time(), s["running"], s["waiting"], s["generated_tokens"])
                    )
                self._stop.wait(self.interval_s)

    def __enter__(self) -> StatsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, start: float, end: float) -> list[tuple[float, int, int, int]]:
        return [s for s in self.samples if start <= s[0] <= end]

    def ramp(self, start: float, seconds: float = 4.0) -> str:
        """Running requests at each sample of the first `seconds` after start."""
        first = [s for s in self.samples if start <= s[0] <= start + seconds]
        return " ".join(f"{s[0] - start:.1f}:{s[1]}" for s in first)

    def summary(self, start: float, end: float, slots: int) -> str:
        """Ramp (first time all slots run), mean running requests over the whole busy span
        [start, end] and over its middle (10%-80%: after the ramp, before the drain of the
        longest outputs), and how often all slots ran in that middle part."""
        busy = self.busy(start, end)
        if not busy:
            return "no samples"
        span = end - start
        middle = [s for s in busy if start + 0.1 * span <= s[0] <= start + 0.8 * span] or busy
        mean_all = sum(s[1] for s in busy) / len(busy)
        mean_mid = sum(s[1] for s in middle) / len(middle)
        held_mid = sum(s[1] + s[2] for s in middle) / len(middle)
        full = sum(1 for s in middle if s[1] >= slots) / len(middle)
        ramp = next((s[0] - start for s in busy if s[1] >= slots), float("nan"))
        return (
            f"all {slots} running {ramp:.2f} s after the first request; mean running "
            f"{mean_all:.1f} over the span; over its 10%-80% part: running {mean_mid:.1f}, "
            f"running+waiting {held_mid:.1f}, all {slots} running in {100 * full:.0f}% of samples"
        )


# --- the fixture tokenizer and synthetic prompts ----------------------------------------


def fixture_tokenizer_dir() -> Path:
    """The bundled Kimi-K2.5-shaped fixture tokenizer (built once into a temp cache)."""
    from emulator.fixtures.kimi import ensure_kimi_tokenizer

    return ensure_kimi_tokenizer(CACHE_DIR / "tokenizers")


_WORDS_TEXT = (
    "a about after again against all also an and answer any are around as ask at away back "
    "batch be because been before begin being below between both but by call came can case "
    "change check clear code come could count data day did different do does done down draft "
    "during each early easy end enough even every example explain fact far few find first "
    "follow for form found from full get give go good great group had hand has have he help "
    "her here high him his how idea if important in into is it its just keep kind know large "
    "last later least left less let life like line little long look made make many may me "
    "mean might model more most move much must my name need never new next no not note now "
    "number of off often old on once one only open or order other our out over own part "
    "people place plan point problem prompt put queue question quite rather read reason right "
    "run said same say see server set she should show side since small so some something "
    "sound start state still step such sure system take tell than that the their them then "
    "there these they thing think this those though three through time to token together too "
    "try turn two under until up upon use very want was water way we well went were what "
    "when where which while who why will window with word work world would write year yes yet "
    "you your"
)
WORDS = tuple(_WORDS_TEXT.split())
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Be brief and precise.",
    "Think step by step, then answer.",
    "You are an expert reviewer. Point out every problem you find.",
)


def synthetic_text(rng: random.Random, words: int) -> str:
    out: list[str] = []
    for i in range(words):
        word = rng.choice(WORDS)
        if i == 0 or out[-1].endswith("."):
            word = word.capitalize()
        if rng.random() < 0.08:
            word += "."
        elif rng.random() < 0.05:
            word += ","
        out.append(word)
    return " ".join(out) + "?"


def synthetic_conversation(rng: random.Random, words: int) -> list[dict[str, str]]:
    """A chat of about `words` words: a system turn sometimes, and one to three user turns
    (earlier ones answered), ending with a user turn (roughly 1.2 tokens a word)."""
    messages: list[dict[str, str]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    turns = rng.choice((1, 1, 1, 2, 3))
    share = max(1, words // (2 * turns - 1))
    for turn in range(turns):
        messages.append({"role": "user", "content": synthetic_text(rng, share)})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": synthetic_text(rng, share)})
    return messages


def write_chat_prompts(path: Path, count: int, *, words: int, seed: int) -> Path:
    """`count` JSONL lines {"id", "messages"}, each about `words` words (varied ±50%)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for i in range(count):
            n = max(8, int(words * rng.uniform(0.5, 1.5)))
            line = {"id": f"p{i:07d}", "messages": synthetic_conversation(rng, n)}
            out.write(json.dumps(line, separators=(",", ":")) + "\n")
    return path


# --- the ledger ------------------------------------------------------------------------


@dataclass(frozen=True)
class LedgerItem:
    id: int
    sample_index: int
    prompt_ids: list[int]


def run_items(db: Engine, run_name: str) -> tuple[list[LedgerItem], Any]:
    """The run's items in id order and its SamplingParams: what the workers would send."""
    from app.ledger import common, run_queries

    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        t = common.items
        rows = conn.execute(
            select(t.c.id, t.c.sample_index, t.c.prompt_ids)
            .where(t.c.run_id == run.id)
            .order_by(t.c.id)
        ).all()
    sampling = run.generation.sampling
    return [LedgerItem(r.id, r.sample_index, list(r.prompt_ids)) for r in rows], sampling


def wait_run_finished(
    db: Engine,
    run_name: str,
    *,
    timeout_s: float,
    poll_s: float = 0.25,
    alive: Any = None,
) -> Any:
    """Poll `ledger.run_counts` until nothing is pending, queued or leased; the counts."""
    from app.ledger import reads, run_queries

    deadline = time.monotonic() + timeout_s
    while True:
        with db.connect() as conn:
            counts = reads.run_counts(conn, run_queries.get_run(conn, run_name))
        if counts.total and counts.finished:
            return counts
        if alive is not None and not alive():
            raise RuntimeError(f"the worker exited before run {run_name} finished: {counts}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_name} did not finish in {timeout_s:.0f} s: {counts}")
        time.sleep(poll_s)


def wait_first_claim(db: Engine, run_name: str, *, timeout_s: float = 120) -> None:
    """Poll until a worker has claimed (or finished) an item of the run."""
    from app.ledger import reads, run_queries

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with db.connect() as conn:
            counts = reads.run_counts(conn, run_queries.get_run(conn, run_name))
        if counts.leased or counts.done or counts.failed:
            return
        time.sleep(0.05)
    raise TimeoutError(f"no worker claimed an item of {run_name} in {timeout_s:.0f} s")


def run_span(db: Engine, run_name: str) -> tuple[datetime, datetime]:
    """(first claim, last result written) of a run, from the ledger's timestamps."""
    from app.ledger import common, run_queries

    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        t = common.items
        first, last = conn.execute(
            select(func.min(t.c.started_at), func.max(t.c.finished_at)).where(t.c.run_id == run.id)
        ).one()
    return first, last


# --- output ------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (first column left, the rest right)."""
    cells = [[str(h) for h in headers], *[[_fmt(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        rest = [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        parts = [r[0].ljust(widths[0]), *rest]
        lines.append("  ".join(parts))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def machine_note() -> str:
    load = os.getloadavg()
    return (
        f"{os.cpu_count()} cores (shared, noisy), Python {sys.version.split()[0]}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
    )


def enqueue_cli(args: argparse.Namespace, env: dict[str, str], prompts: Path, run: str) -> None:
    """`tokenmill enqueue` of the prompt file into a new run (publishes to Redis); args carries
    max_new_tokens and seed."""
    run_tokenmill(
        [
            "enqueue",
            str(prompts),
            "--run",
            run,
            "--tokenizer",
            str(fixture_tokenizer_dir()),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--seed",
            str(args.seed),
            "--temperature",
            "1.0",
        ],
        env,
    )

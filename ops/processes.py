"""This project's own processes started from Python, the one harness of the benchmarks and the
tests: the tokenmill CLI (`python -m ops`), `celery -A app worker|beat`, each with an environment
that names only the services the caller chose, and stopping them (a warm shutdown first).

It lives in ops, beside ops/emulator_proc.py (the emulator's half), because bench imports ops
and never tests; the product's commands do not use it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.core.settings import child_environment

ROOT = Path(__file__).resolve().parents[1]


def clean_env(data_dir: Path, **settings: str) -> dict[str, str]:
    """This process's environment without any TOKENMILL_* setting, plus the data folder and
    `settings` (e.g. TOKENMILL_INFLIGHT="64")."""
    return child_environment(
        {"TOKENMILL_DATA_DIR": str(data_dir), **settings}, without_settings=True
    )


def service_env(pg_url: str, redis_url: str, data_dir: Path, **settings: str) -> dict[str, str]:
    """clean_env for a distributed deployment: the ledger at pg_url, the broker at redis_url."""
    return clean_env(
        data_dir, TOKENMILL_DATABASE_URL=pg_url, TOKENMILL_BROKER_URL=redis_url, **settings
    )


def tokenmill(
    args: Sequence[str], env: dict[str, str], cwd: Path = ROOT, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run `tokenmill ARGS` (as `python -m ops`) to completion; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "ops", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def start_celery(
    kind: str, env: dict[str, str], log: Path, *args: str, loglevel: str | None = "INFO"
) -> subprocess.Popen[bytes]:
    """`celery -A app worker|beat ARGS`, output to log (loglevel None: celery's own, WARNING)."""
    level = ["--loglevel", loglevel] if loglevel else []
    with log.open("wb") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "app", kind, *level, *args],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def start_worker(
    env: dict[str, str], name: str, log: Path, *, loglevel: str | None = "INFO"
) -> subprocess.Popen[bytes]:
    """`celery -A app worker -E` named NAME@host, as the README starts it."""
    return start_celery(
        "worker",
        env,
        log,
        "-n",
        f"{name}@%h",
        "--without-mingle",
        "--without-gossip",
        "-E",
        loglevel=loglevel,
    )


def stop(procs: Sequence[subprocess.Popen[Any]], timeout_s: float = 60) -> None:
    """SIGTERM (a warm shutdown for celery), then SIGKILL whatever is still there in time."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

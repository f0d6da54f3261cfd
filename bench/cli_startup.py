"""CLI start-up: wall and CPU time of `tokenmill --help`, `status`, `servers` and `events` on an
embedded SQLite ledger, repeated like hyperfine, for this tree and optionally another one.

    python bench/cli_startup.py [--repeat 10] [--baseline /path/to/other/checkout]

Each command runs as `python -m ops ...` with PYTHONPATH set to the tree measured, in a fresh
data directory whose SQLite ledger one `tokenmill status` created first (so no run pays the
schema creation). The modules `--help` imports come from `python -X importtime`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine_note, table

COMMANDS = (["--help"], ["status"], ["servers"], ["events"])
HEAVY = ("pyarrow", "alembic", "httpx", "rich", "sqlalchemy", "pydantic", "celery", "kombu")


def _env(tree: Path, data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env["PYTHONPATH"] = str(tree)
    env["TOKENMILL_DATA_DIR"] = str(data_dir)
    return env


def _time(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "ops", *argv], env=env, cwd=cwd, capture_output=True, check=True
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def measure(tree: Path, repeat: int) -> list[list[object]]:
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-startup-") as tmp:
        env = _env(tree, Path(tmp) / "data")
        _time(["status"], env, Path(tmp))  # creates the SQLite ledger
        for argv in COMMANDS:
            walls, cpus = zip(*(_time(argv, env, Path(tmp)) for _ in range(repeat)), strict=True)
            rows.append(
                [
                    f"{tree.name}: tokenmill {' '.join(argv)}",
                    min(walls),
                    statistics.median(walls),
                    statistics.median(cpus),
                ]
            )
        imported = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "ops", "--help"],
            env=env,
            cwd=tmp,
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    loaded = sorted({m for m in HEAVY if f" {m}\n" in imported or f" {m}." in imported})
    rows.append([f"{tree.name}: --help imports", ", ".join(loaded) or "none of them", "", ""])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to compare")
    args = parser.parse_args()
    print(f"cli_startup: {machine_note()}")
    rows = measure(ROOT, args.repeat)
    if args.baseline is not None:
        rows += measure(args.baseline.resolve(), args.repeat)
    print(table(["command (SQLite ledger)", "wall min s", "wall median s", "cpu median s"], rows))


if __name__ == "__main__":
    main()

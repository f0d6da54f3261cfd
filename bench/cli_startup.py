"""CLI start-up: wall and CPU time of `tokenmill --help`, `status`, `servers` and `events` on an
embedded SQLite ledger beside `python -c pass` and `python -c "import sqlalchemy"` in the same
run, repeated like hyperfine, for this tree and optionally another one.

    python bench/cli_startup.py [--repeat 10] [--baseline /path/to/other/checkout]

Each command runs as `python -m ops ...` with PYTHONPATH set to the tree measured, in a fresh
data directory whose SQLite ledger one `tokenmill status` created first (so no run pays the
schema creation). The rounds interleave the commands (each round runs every one once), so a
machine whose load changes slows them alike; the figures are medians, and each command's
difference from `import sqlalchemy` is the median of the per-round differences. The modules
`--help` and `status` import come from `python -X importtime`.
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
BASELINES = {"python -c pass": "pass", "python -c 'import sqlalchemy'": "import sqlalchemy"}
HEAVY = ("pyarrow", "alembic", "httpx", "rich", "sqlalchemy", "pydantic", "celery", "kombu")


def _env(tree: Path, data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env["PYTHONPATH"] = str(tree)
    env["TOKENMILL_DATA_DIR"] = str(data_dir)
    return env


def _time(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, check=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _imports(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ops", *argv],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = sorted({m for m in HEAVY if f" {m}\n" in done.stderr or f" {m}." in done.stderr})
    return ", ".join(loaded) or "none of them"


def measure(tree: Path, repeat: int) -> list[list[object]]:
    cases = {name: ["-c", code] for name, code in BASELINES.items()}
    cases |= {f"tokenmill {' '.join(argv)}": ["-m", "ops", *argv] for argv in COMMANDS}
    walls: dict[str, list[float]] = {name: [] for name in cases}
    cpus: dict[str, list[float]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory(prefix="tokenmill-startup-") as tmp:
        env = _env(tree, Path(tmp) / "data")
        _time(["-m", "ops", "status"], env, Path(tmp))  # creates the SQLite ledger
        for _ in range(repeat):
            for name, argv in cases.items():
                wall, cpu = _time(argv, env, Path(tmp))
                walls[name].append(wall)
                cpus[name].append(cpu)
        imported = {argv[0]: _imports(argv, env, Path(tmp)) for argv in (["--help"], ["status"])}
    base = "python -c 'import sqlalchemy'"
    rows: list[list[object]] = []
    for name in cases:
        over = statistics.median(w - b for w, b in zip(walls[name], walls[base], strict=True))
        over_cpu = statistics.median(c - b for c, b in zip(cpus[name], cpus[base], strict=True))
        rows.append(
            [
                f"{tree.name}: {name}",
                min(walls[name]),
                statistics.median(walls[name]),
                statistics.median(cpus[name]),
                f"{over:+.3f}",
                f"{over_cpu:+.3f}",
            ]
        )
    for command, loaded in imported.items():
        rows.append([f"{tree.name}: {command} imports", loaded, "", "", "", ""])
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
    headers = ["command (SQLite ledger)", "wall min s", "wall median s", "cpu median s"]
    print(table([*headers, "wall vs import sqlalchemy", "cpu vs import sqlalchemy"], rows))


if __name__ == "__main__":
    main()

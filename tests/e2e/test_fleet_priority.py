"""A shared fleet as the README starts it ("Distributed", one GPU node, a 16-slot emulator that
schedules by priority): a big run is enqueued first and its messages fill the queue; then the
runbook's "A run is urgent" as printed (a 48-item run at --priority 10), a run of the default
priority, and a run raised by `tokenmill priority` after it was queued behind the big one.

Order, not time, is asserted, from the ledger's finish times (the commands' own duration on a
loaded machine does not enter): when the urgent run's last item finished, most of the big run
had not; the run of equal priority and the raised one each finished before the big run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select

from app.ledger import common, reads, run_queries
from tests.support.moto_s3 import moto_s3
from tests.support.procs import ROOT, wait_for
from tests.support.readme_fleet import Command, Fleet, commands, section_blocks

pytestmark = pytest.mark.e2e

BIG = 1000  # the README's r1: ~1.5 s an item, 16 at a time, over a minute and a half alone
SMALL = 48
# 16 slots, ~25 tokens of 60 ms each: ~1.5 s per request; its queue ordered by priority
FLAGS = [
    *("--max-running", "16", "--step-ms", "60", "--median-tokens", "25", "--sigma", "0.2"),
    "--enable-priority-scheduling",
]
BUCKETS = ("tokenmill-data",)  # the README's s3://tokenmill-data/store


def prompts(path: Path, name: str, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"id": f"{name}{i}", "prompt": f"{name} question {i}: a prime above {i}?"})
            + "\n"
            for i in range(n)
        )
    )
    return path


@pytest.fixture
def fleet(
    tmp_path: Path, pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path
) -> Iterator[Fleet]:
    paths = {
        "prompts.jsonl": str(prompts(tmp_path / "prompts.jsonl", "big", BIG)),
        "evals.jsonl": str(prompts(tmp_path / "evals.jsonl", "eval", SMALL)),
        "/models/Kimi-K2.5": str(kimi_tokenizer_dir),
    }
    fleet = Fleet.on_test_services(tmp_path, pg_engine, pg_url, redis_url, ("gpu-a",), paths, FLAGS)
    with moto_s3(*BUCKETS) as options:
        fleet.exports["TOKENMILL_STORAGE_OPTIONS"] = json.dumps(options)
        with fleet.serving():
            yield fleet


def doc_commands(path: Path, heading: str) -> list[Command]:
    return [c for block in section_blocks(path.read_text(), heading) for c in commands(block)]


def counts(db: Engine, run: str) -> reads.RunCounts:
    with db.connect() as conn:
        return reads.run_counts(conn, run_queries.get_run(conn, run))


def finished(db: Engine, run: str) -> int:
    c = counts(db, run)
    return c.done + c.failed


def big_finished_before(db: Engine, run: str) -> int:
    """The big run's items finished by the time run's last item finished."""
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, run).id
        big_id = run_queries.get_run(conn, "r1").id
        last = select(func.max(common.items.c.finished_at)).where(common.items.c.run_id == run_id)
        count = select(func.count()).where(
            common.items.c.run_id == big_id, common.items.c.finished_at <= last.scalar_subquery()
        )
        return int(conn.execute(count).scalar_one())


def enqueue(fleet: Fleet, tmp_path: Path, run: str, *flags: str) -> None:
    """`tokenmill enqueue` of a small run, as the runbook's, with these flags."""
    source = prompts(tmp_path / f"{run}.jsonl", run, SMALL)
    argv = [
        *("tokenmill", "enqueue", str(source), "--run", run, "--tokenizer", "/models/Kimi-K2.5"),
        *("--trust-remote-code", "--max-new-tokens", "8192", *flags),
    ]
    fleet.run(Command(" ".join(argv), {}, argv, None))


def test_an_urgent_run_goes_first_and_equal_runs_share(
    fleet: Fleet, pg_engine: Engine, tmp_path: Path
) -> None:
    for command in doc_commands(ROOT / "README.md", "Distributed"):
        fleet.run(command)
    wait_for("the big run under way", lambda: finished(pg_engine, "r1") >= 16, 120)

    urgent = doc_commands(ROOT / "ops" / "README.md", "A run is urgent")
    assert urgent[0].argv[:2] == ["tokenmill", "enqueue"] and "--priority" in urgent[0].argv
    outputs = [fleet.run(command) for command in urgent]
    assert "priority 10 (higher first)" in outputs[-1][0].stdout
    enqueue(fleet, tmp_path, "shared")  # the default priority, the big run's
    enqueue(fleet, tmp_path, "later", "--priority", "-1")  # behind the big run...
    fleet.run(
        Command("tokenmill priority later 10", {}, ["tokenmill", "priority", "later", "10"], None)
    )

    for run in ("eval-500", "later", "shared"):
        wait_for(f"run {run}", lambda r=run: finished(pg_engine, r) == SMALL, 300)
        c = counts(pg_engine, run)
        assert c.done == SMALL and c.failed == 0, c
    # most of the big run was still to do when the urgent run was finished
    big_at_urgent = big_finished_before(pg_engine, "eval-500")
    assert big_at_urgent < BIG // 2, big_at_urgent
    # the raised run and the run of equal priority (fair share) did not wait for the big run
    assert big_finished_before(pg_engine, "later") < BIG
    assert big_finished_before(pg_engine, "shared") < BIG
    assert finished(pg_engine, "r1") < BIG

    status = fleet.run(
        Command("tokenmill status --json", {}, ["tokenmill", "status", "--json"], None)
    )
    shown = {r["run"]: r["priority"] for r in json.loads(status[0].stdout)}
    assert shown == {"r1": 0, "eval-500": 10, "shared": 0, "later": 10}

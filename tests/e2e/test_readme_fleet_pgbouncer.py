"""The README's fleet ("Distributed") through PgBouncer, as printed but for the ledger's URL:
Debian's PgBouncer in transaction pooling with 10 server connections, three workers on 256-slot
emulated servers, beat and Flower, 6,000 items. Every item is done once, `servers`,
`reconcile`, `export` and `verify` are clean, and no log (the fleet's nor PgBouncer's) holds an
error: nothing of the ledger outlives a transaction (no server-side prepared statement, no
session temporary table, advisory lock or setting)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.ledger import reads, run_queries
from tests.support import pgbouncer
from tests.support.moto_s3 import moto_s3
from tests.support.procs import ROOT, wait_for
from tests.support.readme_fleet import Command, Fleet, commands, section_blocks

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not pgbouncer.installed(), reason="pgbouncer is not installed"),
]

NODES = ("gpu-a", "gpu-b", "gpu-c")
PROMPTS = 6000
SLOTS = 256
# answers in ~60 ms: the ledger's traffic, not the servers, sets the pace
FLAGS = ["--max-running", str(SLOTS), "--step-ms", "1", "--median-tokens", "60"]
SERVER_CONNECTIONS = 10
# what a log line of trouble looks like: Python's levels and tracebacks, psycopg's and
# PgBouncer's errors (PgBouncer's own lines are "LOG", "WARNING" or "ERROR")
TROUBLE = re.compile(r"\b(ERROR|CRITICAL|Traceback|FATAL)\b|nested_checkout|took a second")


@pytest.fixture
def fleet(
    tmp_path: Path, pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path
) -> Iterator[tuple[Fleet, pgbouncer.Bouncer]]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"Question {i}: name a prime above {i}."}) + "\n"
            for i in range(PROMPTS)
        )
    )
    paths = {"prompts.jsonl": str(prompts), "/models/Kimi-K2.5": str(kimi_tokenizer_dir)}
    flags = [*FLAGS, "--tokenizer", str(kimi_tokenizer_dir)]
    with pgbouncer.pgbouncer(pg_url, server_connections=SERVER_CONNECTIONS) as bouncer:
        fleet = Fleet.on_test_services(
            tmp_path, pg_engine, bouncer.url, redis_url, NODES, paths, flags
        )
        # the one setting a pooled ledger needs beside its URL (docs/large-fleets.md)
        fleet.exports["TOKENMILL_DB_POOLER"] = "true"
        with moto_s3("tokenmill-data") as options:
            fleet.exports["TOKENMILL_STORAGE_OPTIONS"] = json.dumps(options)
            with fleet.serving():
                yield fleet, bouncer


def operator(fleet: Fleet, *argv: str) -> str:
    (done,) = fleet.run(Command(text=" ".join(argv), env={}, argv=list(argv), node=None))
    return done.stdout + done.stderr


def test_the_readme_fleet_through_pgbouncer_in_transaction_pooling(
    fleet: tuple[Fleet, pgbouncer.Bouncer], pg_engine: Engine, tmp_path: Path
) -> None:
    fleet_, bouncer = fleet
    distributed = [
        c
        for block in section_blocks((ROOT / "README.md").read_text(), "Distributed")
        for c in commands(block)
    ]
    assert any(c.argv[:4] == ["celery", "-A", "app", "beat"] for c in distributed)
    for command in distributed:
        fleet_.run(command)
    assert fleet_.exports["TOKENMILL_DATABASE_URL"].endswith(bouncer.url.split("://", 1)[1])

    def finished() -> bool:
        with pg_engine.connect() as conn:
            counts = reads.run_counts(conn, run_queries.get_run(conn, "r1"))
        return bool(counts.total and counts.finished)

    wait_for("run r1 to finish", finished, 600, fleet_.log_tail)
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "r1")
        counts = reads.run_counts(conn, run)
        stored = list(reads.iter_items(conn, run.id))
    assert counts.done == len(stored) == PROMPTS and counts.failed == 0
    assert len({s.item_key for s in stored}) == PROMPTS
    assert {s.server for s in stored} == {f"{node}:{port}" for node, port in fleet_.nodes.items()}

    listed = operator(fleet_, "tokenmill", "servers")
    for node, port in fleet_.nodes.items():
        assert f"{node}:{port}" in listed, listed
    assert '"broker_checked": true' in operator(fleet_, "tokenmill", "reconcile"), listed
    out = tmp_path / "r1.jsonl"
    assert f"wrote {PROMPTS} samples" in operator(
        fleet_, "tokenmill", "export", "r1", "--out", str(out)
    )
    assert "clean" in operator(fleet_, "tokenmill", "verify", "r1")

    for key, log in [*fleet_.logs.items(), ("pgbouncer", bouncer.log)]:
        trouble = [
            line for line in log.read_text(errors="replace").splitlines() if TROUBLE.search(line)
        ]
        assert trouble == [], (key, trouble[:20])

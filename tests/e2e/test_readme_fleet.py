"""The fleet exactly as the docs start it: README's "Distributed", docs/restarts.md ("Riding
through server restarts"), and ops/README's "Start a fleet" and "A server needs a restart", run
as printed on two emulated GPU nodes; once the run is done, the runbook's sections for a
finished run (watch, reconcile, pause, parity, export, verify, compaction, archive, metrics) on
the same ledger.

Two servers, one worker each, beat and Flower; a `tokenmill restart` of one server never pauses
the other's worker (its in-flight count stays up); Flower lists both workers; every item is
done exactly once with the emulator's exact output. A README edit that breaks a command fails
here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine

from app.ledger import counters, reads, registry, run_queries
from emulator.config import EmulatorConfig
from emulator.model import generate_output
from tests.support.moto_s3 import moto_s3
from tests.support.procs import ROOT, stop, wait_for
from tests.support.readme_fleet import (
    NOT_RUN,
    RUN_APART,
    Command,
    Fleet,
    commands,
    flower_workers,
    in_flight_samples,
    section_blocks,
)
from tests.support.rows import agentic_rows, write_rows

pytestmark = pytest.mark.e2e

NODES = ("gpu-a", "gpu-b")
PROMPTS = 1200
# slow enough that a restart (~25 s here) falls well inside the run: ~6 s per request, 64 at a
# time per server, ~10 items/s each
EMULATOR = EmulatorConfig(max_running=64, step_ms=40, median_tokens=160, sigma=0.25)
FLAGS = [
    *("--max-running", "64", "--step-ms", "40", "--median-tokens", "160", "--sigma", "0.25"),
    *("--startup-delay-s", "1", "--loading-s", "2"),  # port closed, then 503, as SGLang loads
]
FLOWER_PASSWORD = "SECRET"  # as printed
BUCKETS = ("tokenmill-data", "datasets")  # s3://tokenmill-data/store, s3://datasets/r1
# docs/rendering.md's agents.jsonl: 3 boundary samples a row, 210 items for its --sample 200
AGENTIC_ROWS = 70


def section(path: Path, heading: str | None) -> list[Command]:
    """The section's commands this test runs (NOT_RUN's and RUN_APART's left out)."""
    doc = str(path.relative_to(ROOT))
    return [
        c
        for block in section_blocks(path.read_text(), heading)
        for c in commands(block)
        if (doc, c.text) not in NOT_RUN and (doc, c.text) not in RUN_APART
    ]


# the runbook's sections for a finished run, in the order an operator would go, and a key part
# of each command's output (stdout and stderr), by its words
AFTER_THE_RUN = (
    "Watch a run",
    "Redis is down",
    "Pause for maintenance",
    "Check that the servers render",
    "Export",
    "Verify a run",
    "Compaction",
    "Archive",  # last: the run's rows leave the hot table
)
# by the command's first words as printed, the longest that match
KEY_OUTPUT = {
    ("tokenmill", "status"): "r1",
    ("tokenmill", "servers"): "worker: http://localhost:",
    ("tokenmill", "events"): "restarted and resumed",
    ("tokenmill", "reconcile"): '"broker_checked": true',
    ("tokenmill", "parity", "r1", "--server", "gpu-a:30000"): "200 checked, 200 equal, 0 mismat",
    ("tokenmill", "parity", "r1", "--server", "http://gpu-b:30000"): '"mismatched": 0',
    ("tokenmill", "parity", "agents"): "200 checked, 200 equal, 0 mismatched",
    ("tokenmill", "enqueue", "agents.jsonl"): f"{3 * AGENTIC_ROWS} items inserted",
    ("tokenmill", "export"): f"wrote {PROMPTS} samples",
    ("tokenmill", "verify", "r1"): "clean",
    ("tokenmill", "verify", "--counts"): "item counters of every run: equal to a full count",
    ("tokenmill", "verify", "--counts", "r1", "--json"): '"drift": []',
    (
        "tokenmill",
        "verify",
        "r1",
        "--export",
    ): f'"rows": {PROMPTS},\n    "shards": 1,\n    "problems": []',
    ("tokenmill", "compact", "r1"): f"({PROMPTS} finished items wait, fewer than",
    ("tokenmill", "compact", "r1", "--all"): f"run r1: {PROMPTS} items compacted into 1 shard",
    ("tokenmill", "archive"): f"{PROMPTS} items moved to the archive",
}


def key_output(argv: list[str]) -> str | None:
    """What a command's output must hold: KEY_OUTPUT's entry of its longest matching start."""
    starts = [k for k in KEY_OUTPUT if tuple(argv[: len(k)]) == k]
    return KEY_OUTPUT[max(starts, key=len)] if starts else None


@pytest.fixture
def fleet(
    tmp_path: Path, pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path
) -> Iterator[Fleet]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"Question {i}: name a prime above {i}."}) + "\n"
            for i in range(PROMPTS)
        )
    )
    paths = {
        "prompts.jsonl": str(prompts),
        "/models/Kimi-K2.5": str(kimi_tokenizer_dir),
        "agents.jsonl": str(write_rows(tmp_path / "agents.jsonl", agentic_rows(AGENTIC_ROWS))),
        "./Kimi-K2.5": str(kimi_tokenizer_dir),
    }
    # with the run's tokenizer folder, so /v1/tokenize renders (the runbook's parity)
    flags = [*FLAGS, "--tokenizer", str(kimi_tokenizer_dir)]
    fleet = Fleet.on_test_services(tmp_path, pg_engine, pg_url, redis_url, NODES, paths, flags)
    # the docs' buckets (the fleet's store, the runbook's export) on one moto server, its
    # endpoint and credentials as every machine's environment holds them
    with moto_s3(*BUCKETS) as options:
        fleet.exports["TOKENMILL_STORAGE_OPTIONS"] = json.dumps(options)
        with fleet.serving():
            yield fleet


def test_readme_distributed_and_restarts_as_printed(fleet: Fleet, pg_engine: Engine) -> None:
    distributed = section(ROOT / "README.md", "Distributed")
    riding = section(ROOT / "docs" / "restarts.md", None)
    assert [c.argv[:4] for c in distributed].count(["celery", "-A", "app", "beat"]) == 1
    servers = {node: f"{node}:{port}" for node, port in fleet.nodes.items()}  # the naming rule
    for command in distributed:
        fleet.run(command)
    restart = next(c for c in riding if c.argv[:2] == ["tokenmill", "restart"])
    target = fleet.substitute(restart.argv[2], None)
    (other,) = set(servers.values()) - {target}
    assert target == servers["gpu-a"]
    wait_for("both servers with work in flight", lambda: serving(pg_engine, servers), 120)
    for command in riding:
        if command is restart:
            with in_flight_samples(pg_engine, other) as samples:
                (done,) = fleet.run(command)
            assert "resumed" in done.stderr, done.stderr
        else:
            fleet.run(command)
    workers = flower_workers(fleet.flower_port, FLOWER_PASSWORD)
    check_fleet(fleet, pg_engine, servers, restarted=target, other=other, samples=samples)
    assert {f"{s}@{node}" for node, s in servers.items()} <= set(workers), workers

    with pg_engine.connect() as conn:
        registered = {s.name: s for s in registry.list_servers(conn)}
    # the worker registered its own loopback URL (a fleet on one machine); `servers add` then
    # set the control plane's, and the worker's stays beside it
    port_a, port_b = fleet.nodes["gpu-a"], fleet.nodes["gpu-b"]
    assert registered[target].url == f"http://127.0.0.1:{port_a}"
    assert registered[target].worker_url == f"http://localhost:{port_a}"
    assert registered[other].url == registered[other].worker_url == f"http://localhost:{port_b}"
    assert {s.node for s in registered.values()} == set(NODES)


def test_ops_readme_start_a_fleet_keeps_the_registered_urls(
    fleet: Fleet, pg_engine: Engine
) -> None:
    runbook = ROOT / "ops" / "README.md"
    start = [*section(runbook, None), *section(runbook, "Start a fleet")]
    restart = section(runbook, "A server needs a restart")[0]
    flower = next(c for c in section(runbook, "Watch a run") if c.argv[1:2] == ["flower"])
    assert restart.argv == ["tokenmill", "restart", "gpu-a:30000"]
    servers = {node: f"{node}:{port}" for node, port in fleet.nodes.items()}  # the naming rule
    outputs = [fleet.run(command) for command in start]
    fleet.run(flower)
    # the registry keeps the URLs `servers add` gave; each worker's own is recorded beside it
    listing = outputs[-1][0].stdout
    with pg_engine.connect() as conn:
        for node, port in fleet.nodes.items():
            server = registry.get_server(conn, servers[node])
            assert server.url == f"http://127.0.0.1:{port}", server
            assert server.worker_url == f"http://localhost:{port}", server
            assert server.node == node and server.workers == [f"{servers[node]}@{node}"], server
            assert f"worker: http://localhost:{port}" in listing, listing
    wait_for("both servers with work in flight", lambda: serving(pg_engine, servers), 120)
    with in_flight_samples(pg_engine, servers["gpu-b"]) as samples:
        (done,) = fleet.run(restart)
    assert "resumed" in done.stderr, done.stderr
    workers = flower_workers(fleet.flower_port, FLOWER_PASSWORD)
    a, b = servers["gpu-a"], servers["gpu-b"]
    check_fleet(fleet, pg_engine, servers, restarted=a, other=b, samples=samples)
    assert {f"{a}@gpu-a", f"{b}@gpu-b"} <= set(workers), workers
    with pg_engine.connect() as conn:
        assert registry.get_server(conn, a).url == f"http://127.0.0.1:{fleet.nodes['gpu-a']}"
    # the runbook's sections for a finished run
    after = [
        *(c for heading in AFTER_THE_RUN for c in section(runbook, heading)),
        # docs/rendering.md's enqueue of agentic rows, checked against gpu-a before it runs
        *section(ROOT / "docs" / "rendering.md", None),
    ]
    for command in after:
        if command.long_running:
            continue  # Flower: started above, beside the run
        (done,) = fleet.run(command)  # exit 0, or it fails here
        key = key_output(command.argv)
        assert key is None or key in done.stdout + done.stderr, (command.text, done)
        print(f"$ {command.text}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    check_metrics(fleet, section(runbook, "Metrics"))


def check_metrics(fleet: Fleet, printed: list[Command]) -> None:
    """The exporter as printed: on loopback, then (the first stopped: one port) beyond it, where
    a scrape needs the basic auth the command was given."""
    loopback, beyond = printed
    url = f"http://127.0.0.1:{fleet.metrics_port}/metrics"
    fleet.run(loopback)
    scrape = httpx.get(url, timeout=30.0)
    assert scrape.status_code == 200, scrape.text
    assert re.search(r"^tokenmill_ledger_up 1(\.0)?$", scrape.text, flags=re.MULTILINE)
    (first,) = [k for k in fleet.procs if "tokenmill metrics" in k]
    stop([fleet.procs.pop(first)])
    fleet.run(beyond)
    assert httpx.get(url, timeout=30.0).status_code == 401
    user, password = beyond.env["TOKENMILL_METRICS_USER"], beyond.env["TOKENMILL_METRICS_PASSWORD"]
    scrape = httpx.get(url, auth=(user, password), timeout=30.0)
    assert scrape.status_code == 200, scrape.text
    assert re.search(r"^tokenmill_broker_up 1(\.0)?$", scrape.text, flags=re.MULTILINE)


def serving(db: Engine, servers: dict[str, str]) -> bool:
    """Every server has a worker and items in flight."""
    with db.connect() as conn:
        leased = counters.leased_by_server(conn)
        listed = {s.name: s.workers for s in registry.list_servers(conn)}
    return all(listed.get(s) and leased.get(s, 0) > 0 for s in servers.values())


def check_fleet(
    fleet: Fleet,
    db: Engine,
    servers: dict[str, str],
    *,
    restarted: str,
    other: str,
    samples: list[int],
) -> None:
    """The restart left the other server serving throughout; the run finishes with every item
    done once, exactly as the emulator generates it, on both servers."""
    print(f"in flight on {other} during the restart of {restarted}: {samples}")
    assert len(samples) >= 5 and min(samples) > 0, samples
    with db.connect() as conn:
        events = registry.list_events(conn, limit=10_000)
    assert any(e.kind == "restart" and e.server == restarted for e in events)
    assert any(e.kind == "paused" and e.server == restarted for e in events)
    assert not [e for e in events if e.server == other and e.kind == "paused"], events
    other_node = next(node for node, s in servers.items() if s == other)
    for key, log in fleet.logs.items():
        if key.startswith(f"{other_node}:"):
            assert "stops consuming" not in log.read_text(), key

    def finished() -> bool:
        with db.connect() as conn:
            counts = reads.run_counts(conn, run_queries.get_run(conn, "r1"))
        return bool(counts.total and counts.finished)

    wait_for("run r1 to finish", finished, 600, fleet.log_tail)
    with db.connect() as conn:
        run = run_queries.get_run(conn, "r1")
        counts = reads.run_counts(conn, run)
        stored = list(reads.iter_items(conn, run.id))
    assert counts.done == len(stored) == PROMPTS and counts.failed == 0
    assert len({(s.item_key, s.sample_index) for s in stored}) == PROMPTS
    assert {s.server for s in stored} == set(servers.values())
    for s in stored:
        expected, finish = generate_output(
            s.prompt_ids, run.generation.sampling.for_sample(s.sample_index), EMULATOR
        )
        assert (s.output_ids, s.finish_reason) == (expected, finish["type"]), s.item_key

"""A misconfigured server cannot fail the run, on the README's fleet (emulated GPU nodes, a
worker each, beat; Postgres and Redis): items of up to ~2,000 prompt tokens on servers of
context length 8192.

- One server restarted through `tokenmill restart` into `--context-length 1024` mid-run: the
  restart says the server no longer fits the run (exit 1, the pins against what it reports),
  its worker leaves the run's items to the other server, `tokenmill servers` says why, and
  every item is done: 0 failed.
- One server that reports 8192 but refuses anything past 1024 with SGLang's own 400: its
  refusals go to the other server, it is paused as failing, and every item is done.
- Such a server alone: at most 10 items fail before its pause; after a correct restart,
  `tokenmill resume` and `tokenmill retry`, every item is done.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, select

from app.core.constants import EVENT_FINGERPRINT_MISMATCH, EVENT_PAUSED
from app.ledger import common, counters, reads, registry, run_queries
from tests.support.procs import ROOT, wait_for
from tests.support.readme_fleet import Command, Fleet, commands, section_blocks

pytestmark = pytest.mark.e2e

PROMPTS = 200
MAX_NEW = 64
# ~2.6 s a request (64 steps of 40 ms), 16 at a time per server: the run outlasts a restart
FLAGS = [
    *("--context-length", "8192", "--max-running", "16", "--step-ms", "40"),
    *("--median-tokens", "160", "--sigma", "0.25"),
    *("--startup-delay-s", "1", "--loading-s", "2"),  # port closed, then 503, as SGLang loads
]
# the restart's run: ~6.4 s a request, so that half the run is left once the restart is done
SLOW = ["--step-ms", "100"]
SMALL = ["--context-length", "1024"]
LYING = ["--refuse-over", "1024"]  # /server_info says 8192

# the README's "Distributed" commands, the storage left to each machine (text items only), the
# run's max_new_tokens small enough that every item fits 8192
START = f"""
export TOKENMILL_DATABASE_URL=postgresql://tokenmill@db-host/tokenmill
export TOKENMILL_BROKER_URL=redis://redis-host:6379/0
tokenmill db upgrade
tokenmill enqueue prompts.jsonl --run r1 --tokenizer /models/Kimi-K2.5 --trust-remote-code --max-new-tokens {MAX_NEW}
celery -A app beat --loglevel INFO
TOKENMILL_SGLANG_URL=http://localhost:30000 celery -A app worker -E --loglevel INFO  # on each GPU node
"""  # noqa: E501


def _prompts(path: Path) -> Path:
    """PROMPTS rows from ~60 to ~2,000 tokens, every third one past 1,024."""
    rows = []
    for i in range(PROMPTS):
        words = 60 + (i * 1940) // (PROMPTS - 1)
        rows.append({"id": f"q{i}", "prompt": f"Question {i}: " + "the " * words})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _fleet(
    tmp_path: Path,
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    tokenizer: Path,
    nodes: tuple[str, ...],
) -> Fleet:
    paths = {
        "prompts.jsonl": str(_prompts(tmp_path / "prompts.jsonl")),
        "/models/Kimi-K2.5": str(tokenizer),
    }
    return Fleet.on_test_services(
        tmp_path,
        pg_engine,
        pg_url,
        redis_url,
        nodes,
        paths,
        [*FLAGS, "--tokenizer", str(tokenizer)],
    )


def _unit(fleet: Fleet, node: str, extra: list[str]) -> None:
    """Edit node's unit as an operator edits its flags (the next start or restart runs them)."""
    fleet.node_flags[node] = extra
    fleet.write_units(node)


@pytest.fixture
def two(
    tmp_path: Path, pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path
) -> Fleet:
    return _fleet(tmp_path, pg_url, pg_engine, redis_url, kimi_tokenizer_dir, ("gpu-a", "gpu-b"))


def _start(fleet: Fleet) -> None:
    for command in commands(START):
        fleet.run(command)


def _op(text: str) -> Command:
    (command,) = commands(text)
    return command


def _counts(db: Engine) -> reads.RunCounts:
    with db.connect() as conn:
        return reads.run_counts(conn, run_queries.get_run(conn, "r1"))


def _finished(db: Engine) -> reads.RunCounts:
    def finished() -> bool:
        counts = _counts(db)
        return bool(counts.total and counts.finished)

    wait_for("run r1 to finish", finished, 300)
    return _counts(db)


def _server(db: Engine, node: str) -> registry.ServerInfo:
    with db.connect() as conn:
        return next(s for s in registry.list_servers(conn) if s.node == node)


def _long_prompts(db: Engine) -> int:
    """Items whose prompt and new tokens do not fit 1,024."""
    with db.connect() as conn:
        tokens = conn.execute(select(common.items.c.prompt_tokens)).scalars().all()
    return sum(1 for t in tokens if t + MAX_NEW > 1024)


@pytest.fixture
def serving(two: Fleet) -> Iterator[Fleet]:
    two.node_flags.update({"gpu-a": SLOW, "gpu-b": SLOW})
    with two.serving():
        yield two


def test_a_restart_into_a_smaller_context_fails_nothing(serving: Fleet, pg_engine: Engine) -> None:
    fleet = serving
    _start(fleet)
    a, b = _server(pg_engine, "gpu-a").name, _server(pg_engine, "gpu-b").name
    assert _long_prompts(pg_engine) > PROMPTS // 3

    def both_serving() -> bool:
        with pg_engine.connect() as conn:
            leased = counters.leased_by_server(conn)
        return leased.get(a, 0) > 0 and leased.get(b, 0) > 0

    wait_for("both servers with work in flight", both_serving, 120)
    _unit(fleet, "gpu-a", [*SLOW, *SMALL])
    restart = _op(
        f"tokenmill restart {a} --command 'ssh {{host}} sudo systemctl restart sglang@{{port}}'"
    )
    done = fleet.attempt(restart)
    print(done.stdout, done.stderr)
    said = " ".join(done.stderr.split())  # a line folded by the terminal's width
    assert done.returncode == 1, said
    assert "no longer fits run r1" in said and "restarted and resumed" not in said
    assert f"{a}: run r1: pinned model" in said, said
    assert "context_length 8192" in said and "the server now" in said, said
    assert (
        "does not fit: its limits do not admit the largest request: context_length 1024 <" in said
    )

    def shown_as_not_serving() -> bool:
        listed = fleet.attempt(_op("tokenmill servers --json"))
        rows = {row["name"]: row for row in json.loads(listed.stdout)}
        status = json.loads(fleet.attempt(_op("tokenmill status r1 --json")).stdout)
        return "limits do not admit" in rows[a]["not_serving"].get("r1", "") and (
            "limits do not admit" in status["not_served_by"].get(a, "")
        )

    wait_for(f"`servers` and `status` to show {a} not serving r1", shown_as_not_serving, 60)
    table = fleet.attempt(_op("tokenmill servers")).stdout
    assert "r1: its limits do not admit" in table, table
    left = _counts(pg_engine)
    counts = _finished(pg_engine)
    print(f"left when the restart was done: {left.total - left.done - left.failed}")
    assert counts.failed == 0 and counts.done == PROMPTS
    with pg_engine.connect() as conn:
        events = registry.list_events(conn, limit=10_000)
    said = [e.message for e in events if e.kind == EVENT_FINGERPRINT_MISMATCH and e.server == a]
    assert said and all("context_length 1024 <" in m for m in said), said


def test_a_server_refusing_past_1024_is_paused_and_fails_nothing(
    two: Fleet, pg_engine: Engine
) -> None:
    two.node_flags["gpu-a"] = LYING
    with two.serving():
        _start(two)
        counts = _finished(pg_engine)
        a = _server(pg_engine, "gpu-a")
        log = "".join(p.read_text() for k, p in two.logs.items() if k.startswith("gpu-a:"))
    assert counts.failed == 0 and counts.done == PROMPTS
    assert a.paused and a.paused_by == "failing", a
    assert (a.pause_reason or "").startswith("failing: HTTP 400: "), a.pause_reason
    assert "context length" in (a.pause_reason or ""), a.pause_reason
    assert f"tokenmill resume --server {a.name}" in log
    with pg_engine.connect() as conn:
        events = registry.list_events(conn, limit=10_000)
    assert any(
        e.kind == EVENT_PAUSED and e.server == a.name and "failing" in e.message for e in events
    )


def test_a_lone_failing_server_fails_at_most_ten_then_the_runbook_finishes_the_run(
    tmp_path: Path, pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path
) -> None:
    """ops/README's "A server fails everything", as printed, once the server's flags are fixed."""
    fleet = _fleet(tmp_path, pg_url, pg_engine, redis_url, kimi_tokenizer_dir, ("gpu-a",))
    fleet.node_flags["gpu-a"] = LYING
    runbook = [
        c
        for block in section_blocks((ROOT / "ops" / "README.md").read_text(), "A server fails")
        for c in commands(block)
    ]
    with fleet.serving():
        _start(fleet)
        a = _server(pg_engine, "gpu-a")

        def paused() -> bool:
            return _server(pg_engine, "gpu-a").paused

        wait_for(f"{a.name} paused as failing", paused, 120)
        wait_for("nothing in flight", lambda: not _counts(pg_engine).leased, 60)
        failed = _counts(pg_engine).failed
        assert 0 < failed <= 10, failed
        _unit(fleet, "gpu-a", [])  # the flags fixed
        # the runbook's restart uses the registered command
        restart = "'ssh {host} sudo systemctl restart sglang@{port}'"
        fleet.run(_op(f"tokenmill servers add {a.name} {a.url} --restart-command {restart}"))
        said = {}
        for command in runbook:
            (done,) = fleet.run(command)
            said[command.argv[1]] = done.stdout + done.stderr
        counts = _finished(pg_engine)
    assert "yes (failing: HTTP 400:" in said["servers"], said["servers"]
    assert "still paused as before (failing)" in said["restart"], said["restart"]
    assert f"re-queued {failed} failed items" in said["retry"], said["retry"]
    assert counts.failed == 0 and counts.done == PROMPTS
    print(f"items failed before the pause of the lone failing server: {failed}")

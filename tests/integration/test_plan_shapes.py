"""The EXPLAIN shape of every statement the worker, beat and the operator's commands send, on
a ledger of ~200K items, with the statistics of the enqueue (stale) and after ANALYZE.

The statements are the product's own: each hot path below runs against the ledger while a
hook on every engine records the SQL it sends (with the plan settings of its transaction),
and each is then run again under `EXPLAIN (ANALYZE, FORMAT JSON)` in a transaction that is
rolled back. A statement passes when it reads items through an index (no sequential scan, no
walk of the whole primary key), never sorts rows of items, and no scan of items reads more
than BOUNDED rows (the queued run has 48,000, the ending run 150,000): an index probe or a
range bounded by what is active, not by the run. The ledger functions the worker, beat and
these commands name (found in their source) must each be run by a path here or be listed in
EXEMPT with the reason its cost is bounded without a plan check, so a new query is caught.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import Connection, Engine, event, text

from app.core import contracts
from app.core.settings import Settings, get_settings
from app.ledger import (
    archive,
    claims,
    common,
    compaction,
    counters,
    dashboard_queries,
    database,
    metrics_queries,
    outcomes,
    queue,
    reads,
    registry,
    run_queries,
    turns,
)
from ops import cli
from tests.conftest import private_database
from tests.support.runs import make_run
from workers.control import reconcile

ROOT = Path(__file__).resolve().parents[2]
ENDING, QUEUED, IMAGES = 150_000, 48_000, 2_000
LIVE, EXPIRED, UNCOMPACTED = 512, 64, 2_000
BOUNDED = 12_000
OWNER = "gen@gpu-a"

# Ledger functions the worker, beat and the commands name whose statements are not run here,
# by the reason their cost is bounded by what they are given, not by the ledger's size.
EXEMPT: dict[str, str] = {
    **dict.fromkeys(
        (
            "claims.drop_hedge_marks",
            "claims.mark_hedged",
            "claims.unmark_hedged",
            "claims.item_keys",
            "claims.lease_owners",
            "compaction.shard_referenced",
            "outcomes.release_owner",
            "reads.stored_items",
            "reads.hydrated_items",
            "reads.stored_prompts",
            "turns.ready_turns",
            "turns.start_turn",
            "turns.fail_waiting_chain",
            "turns.end_chain",
            "turns.record_chain_end",
            "turns.unmark_plain_chains",
            "image_tokens.note_image_tokens",
            "retries.still_failed",
            "run_queries.item_priorities",
        ),
        "reads or writes the rows of the ids, keys or owner it is given, through their keys",
    ),
    **dict.fromkeys(
        (
            "queue.insert_items",
            "queue.existing_keys",
            "queue.pending_keys",
            "queue.refresh_statistics",
            "turns.link_turns",
            "run_queries.get_or_create_run",
            "run_queries.pin_fingerprint",
            "image_tokens.pin_run_images",
            "image_tokens.pin_image_settings",
            "reads.prompt_item_ids",
            "removal.delete_run_row",
        ),
        "an enqueue, delete or full parity pass: O(its input or its run) by design",
    ),
    **dict.fromkeys(
        (
            "registry.add_worker",
            "registry.remove_worker",
            "registry.claim_server",
            "registry.find_server",
            "registry.get_server",
            "registry.upsert_server",
            "registry.set_fingerprint",
            "registry.set_paused",
            "registry.pause_flag",
            "registry.record_probe",
            "registry.record_parity",
            "registry.parity_status",
            "registry.is_stalled",
            "dashboard_queries.server_events",
            "event_log.record_event",
            "event_log.has_event",
            "event_log.latest_kind",
            "event_log.runs_refused",
            "image_tokens.run_image_pins",
            "run_queries.get_run",
            "run_queries.get_run_by_id",
            "run_queries.run_archived",
            "run_queries.run_name",
            "spec_stats.run_has_spec_stats",
            "counters.fold_shards",
            "run_queries.run_priorities",
        ),
        "servers, runs, events, pins or counters: tables of the fleet's size, by their keys",
    ),
    "claims.refused_here": "a message's ids, by the primary key (as claims.claim_items)",
    "status_reads.refusal_reason": "the text of an event already read: no statement",
    **dict.fromkeys(
        ("run_needs.longest_prompt", "run_needs.largest_request"),
        "a run's prompt lengths: read once per run by a worker process (its RunPins keeps the "
        "answer) and once per `tokenmill restart`, never periodically",
    ),
    **dict.fromkeys(
        ("dashboard_queries.item_ranges", "dashboard_queries.failure_reasons"),
        "`tokenmill report`'s page: sums over the whole run by design, not a periodic read",
    ),
    **dict.fromkeys(
        ("registry.delete_server", "registry.note_probe", "registry.change_state"),
        "the servers table, by the server's name",
    ),
    **dict.fromkeys(
        (
            "windows.record_window",
            "windows.drop_window",
            "windows.sharing_owners",
            "windows.server_window",
        ),
        "server_windows: a row per live worker, by server and owner (server_window reads none)",
    ),
    **dict.fromkeys(
        ("registry.has_served", "registry.leases_by_run"),
        "`servers remove` and a worker that stops without ever reaching its server: one read of "
        "that server's items, not periodic",
    ),
    "counters.claimable_by_run": (
        "the counters' rows of two statuses (a few per run, never the items), which a worker's "
        "claim order reads every 2 s"
    ),
    "database.get_engine": "no statement",
    "database.dedicated_connection": "no statement (a connection for the lease heartbeat)",
    "database.limit_periodic": "sets a statement timeout",
    "common.utcnow": "no statement",
}


# Statements this test finds that are not fixed yet, by (path, statistics): what their problem
# reads like, and why. The test fails when one of them is fixed, so the entry goes.
KNOWN: dict[tuple[str, str], tuple[str, str]] = {
    ("runner", "stale"): (
        "Index Scan ix_items_run_status_id read 48000 rows: SELECT items.",
        "claim_next_groups looks up a run's keys; while the statistics know no item of the "
        "run, the planner reads the run's (run_id, status, id) range instead of its unique "
        "keys (it goes once the statistics count the run)",
    ),
}


@dataclass(frozen=True)
class Ledger:
    url: str
    engine: Engine
    ending: run_queries.RunInfo  # done, failed, live and expired leases: nothing to claim
    queued: run_queries.RunInfo  # queued text items
    images: run_queries.RunInfo  # queued image items
    message_ids: list[int]  # a message's ids: 32 queued items of the text run


# g numbers the rows: the ending run's first (done and compacted but for its last UNCOMPACTED,
# 1% failed, its last ids leased: live, then expired), then the queued text run's, then the
# queued image run's. The ending run is agentic: a tenth of its compacted chains ended (their
# endings counted), and a few uncompacted last turns of agentic chains (a tool turn in their
# history) wait for the catch-up to record their ending (its tokenizer is not on this machine,
# so they keep waiting)
_INSERT = """
INSERT INTO items (run_id, item_key, sample_index, turn_index, prompt_ids, prompt_tokens,
    status, attempts, images, server, lease_owner, lease_expires_at, started_at, finished_at,
    output_ids, completion_tokens, latency_s, finish_reason, shard_uri, shard_row, created_at,
    queued_at, messages, chain_end, ends_chain)
SELECT CASE WHEN g <= :e THEN :ending WHEN g <= :e + :q THEN :queued ELSE :images END,
    'k' || g, 0, 0, '\\x01000000'::bytea, 1,
    CASE WHEN g > :e THEN 'queued' WHEN g > :e - :l - :x THEN 'leased'
         WHEN g % 100 = 0 THEN 'failed' ELSE 'done' END,
    CASE WHEN g > :e THEN 0 ELSE 1 END,
    CASE WHEN g > :e + :q THEN CAST('[{"sha256": "' || md5(g::text) || '"}]' AS json) END,
    CASE WHEN g <= :e THEN 'gpu-' || (ARRAY['a', 'b'])[1 + g % 2] END,
    CASE WHEN g > :e THEN NULL WHEN g > :e - :x THEN 'gen@dead'
         WHEN g > :e - :l - :x THEN 'gen@gpu-' || (ARRAY['a', 'b'])[1 + g % 2] END,
    CASE WHEN g > :e THEN NULL WHEN g > :e - :x THEN now() - interval '1 hour'
         WHEN g > :e - :l - :x THEN now() + interval '1 hour' END,
    CASE WHEN g <= :e THEN now() - interval '1 hour' END,
    CASE WHEN g <= :e - :l - :x THEN now() - interval '1 hour' + g * interval '1 ms' END,
    CASE WHEN g <= :e - :l - :x AND g % 100 <> 0 THEN '\\x02000000'::bytea END,
    CASE WHEN g <= :e - :l - :x AND g % 100 <> 0 THEN 1 END,
    CASE WHEN g <= :e - :l - :x AND g % 100 <> 0 THEN 1.5 END,
    CASE WHEN g <= :e - :l - :x AND g % 100 <> 0 THEN 'stop' END,
    CASE WHEN g <= :e - :l - :x - :u AND g % 100 <> 0 THEN 'file:///s/shard.parquet' END,
    CASE WHEN g <= :e - :l - :x - :u AND g % 100 <> 0 THEN g END,
    now() - interval '2 hours', now() - interval '2 hours',
    CASE WHEN g > :e - :l - :x - :u AND g <= :e - :l - :x AND g % 100 = 7
         THEN CAST(:tool_turns AS json) END,
    CASE WHEN g <= :e - :l - :x - :u AND g % 10 = 1
         THEN (ARRAY['complete', 'no_call', 'other_tool'])[1 + g % 3] END,
    CASE WHEN g <= :e - :l - :x - :u AND g % 10 = 1 THEN true
         WHEN g > :e - :l - :x - :u AND g <= :e - :l - :x AND g % 100 = 7 THEN true END
FROM generate_series(:first, :last) AS g
"""


@pytest.fixture(scope="module")
def ledger() -> Iterator[Ledger]:
    """A private database with the three runs, autovacuum off: the statistics are those of
    the ending run alone until the fresh phase runs ANALYZE."""
    with private_database("tokenmill_plans") as url:
        engine = database.make_engine(url)
        try:
            yield _fill(url, engine)
        finally:
            engine.dispose()


def _fill(url: str, engine: Engine) -> Ledger:
    """The three runs; the statistics are those of the ending run alone."""
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE items SET (autovacuum_enabled = off)"))
        ending, queued, images = (make_run(conn, n) for n in ("ending", "queued", "images"))
        conn.execute(
            text(
                "UPDATE runs SET sampling_params = CAST(CAST(sampling_params AS jsonb) "
                '|| \'{"turns": "all"}\' AS json), chat_pins = :pins WHERE id = :r'
            ),
            {"r": ending.id, "pins": '{"tool_call_parser": "kimi_k2"}'},
        )
        ending = run_queries.get_run_by_id(conn, ending.id)
        assert ending.generation.turns == "all"
        assert ending.generation.tool_call_parser == "kimi_k2"
        for server in ("gpu-a", "gpu-b", "gpu-c"):
            registry.upsert_server(conn, server, f"http://127.0.0.1:1/{server}")
        registry.set_workers(conn, "gpu-a", [OWNER])
        sizes = {
            "e": ENDING,
            "q": QUEUED,
            "i": IMAGES,
            "l": LIVE,
            "x": EXPIRED,
            "u": UNCOMPACTED,
        }
        ids = {"ending": ending.id, "queued": queued.id, "images": images.id}
        ids |= {"tool_turns": '[{"role": "tool", "content": "sunny"}]'}
        # the ending run, ANALYZE, then the enqueue of the other two: the statistics
        # know no queued item (the minutes after a bulk enqueue, autovacuum off)
        conn.execute(text(_INSERT), sizes | ids | {"first": 1, "last": ENDING})
        conn.execute(text("ANALYZE items"))
        rest = {"first": ENDING + 1, "last": ENDING + QUEUED + IMAGES}
        conn.execute(text(_INSERT), sizes | ids | rest)
        message_ids = list(
            conn.execute(
                text("SELECT id FROM items WHERE run_id = :r ORDER BY id LIMIT 32"),
                {"r": queued.id},
            ).scalars()
        )
    return Ledger(url, engine, ending, queued, images, message_ids)


@dataclass(frozen=True)
class Sent:
    statement: str
    parameters: Any
    pins: tuple[tuple[str, Any], ...]  # the set_config calls of its transaction before it


class Capture:
    """Every statement any engine sends while active, and the ledger functions called."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []
        self.called: set[str] = set()
        self._pins: dict[int, list[tuple[str, Any]]] = {}

    def _begin(self, conn: Connection) -> None:
        self._pins.pop(id(conn), None)

    def _execute(self, *args: Any) -> None:
        conn, _cursor, statement, parameters, _context, executemany = args
        if "set_config" in statement:
            self._pins.setdefault(id(conn), []).append((statement, parameters))
        elif not executemany and statement.lstrip().split(None, 1)[0].upper() in (
            "SELECT",
            "UPDATE",
            "DELETE",
            "INSERT",
            "WITH",
        ):
            pins = tuple(self._pins.get(id(conn), ()))
            self.sent.append(Sent(statement, parameters, pins))

    def _profile(self, frame: FrameType, what: str, _arg: Any) -> None:
        if what == "call" and frame.f_code.co_filename.startswith(LEDGER_DIR):
            module = Path(frame.f_code.co_filename).stem
            self.called.add(f"{module}.{frame.f_code.co_name}")

    def __enter__(self) -> Capture:
        event.listen(Engine, "begin", self._begin)
        event.listen(Engine, "before_cursor_execute", self._execute)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *_exc: object) -> None:
        sys.setprofile(None)
        event.remove(Engine, "before_cursor_execute", self._execute)
        event.remove(Engine, "begin", self._begin)


LEDGER_DIR = str(ROOT / "app" / "ledger")


def _cli(ledger: Ledger, *argv: str) -> None:
    env = {"TOKENMILL_DATABASE_URL": ledger.url, "TOKENMILL_BROKER_URL": "memory://"}
    get_settings.cache_clear()  # an earlier test's settings would point the command elsewhere
    try:
        result = CliRunner().invoke(cli.cli, list(argv), env=env, catch_exceptions=False)
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output


def _in(ledger: Ledger, call: Callable[[Connection], object]) -> None:
    with ledger.engine.begin() as conn:
        call(conn)
        conn.rollback()


def _worker(ledger: Ledger) -> None:
    """What a Celery worker's loop asks: claims of a message's ids (text only), results,
    heartbeats, the hedge search, and the image items it passed over."""
    with ledger.engine.begin() as conn:
        ids = ledger.message_ids
        got = claims.claim_items(conn, ids, owner=OWNER, server="gpu-a", lease_s=60, text_only=True)
        claims.claimable_image_items(conn, ids)
        claims.finished_among(conn, ids)
        turns.unended_last_turns(conn, prev_ids=ids, limit=len(ids))
        claims.extend_leases(conn, owner=OWNER, lease_s=60)
        result = contracts.GenerateResult("r", [5, 6], "stop", 6, 3, 2, 0, 0.1)
        done = [outcomes.Done(c.id, result) for c in got]
        outcomes.record_outcomes(conn, done, owner=OWNER, lease_s=60)
        claims.hedge_candidates(conn, server="gpu-c", limit=8, text_only=True)
        conn.rollback()


def _runner(ledger: Ledger) -> None:
    """The embedded runner (`tokenmill run`) on a text-only server: its claims straight from
    the ledger and its "anything left for me?" probes, on a text run and an image run."""
    for run in (ledger.queued, ledger.images, ledger.ending):
        with ledger.engine.begin() as conn:
            claims.text_items_left(conn, run.id)
            claims.image_items_left(conn, run.id)
            claims.claimable_left(conn, run.id)
            for claim in (claims.claim_next, claims.claim_next_groups):
                claim(
                    conn,
                    owner="runner",
                    server="gpu-c",
                    lease_s=60,
                    limit=32,
                    run_id=run.id,
                    text_only=True,
                )
            conn.rollback()


def _beat(ledger: Ledger) -> None:
    """The periodic tasks: the watchdog, compaction's checks, the metrics, the dashboard."""
    with ledger.engine.begin() as conn:
        registry.server_load(conn, "gpu-a")
        registry.active_run_fingerprints(conn)
        registry.active_run_pins(conn)
        registry.active_runs(conn)
        registry.list_servers(conn)
        registry.stopped_enqueues(conn, [ledger.queued.id])
        counters.leased_by_server(conn)
        compaction.runs_with_compactable(conn, 1000)
        compaction.count_uncompacted(conn, ledger.ending.id, at_most=1000)
        compaction.count_compactable(conn, ledger.ending.id)
        uncompacted = compaction.compactable_ids(conn, ledger.ending.id, after_id=0, limit=100)
        compaction.mark_compacted(
            conn, "file:///s/new.parquet", [(item, row) for row, item in enumerate(uncompacted)]
        )
        archive.archive_blockers(conn, ledger.ending.id)
        queue.oldest_queued(conn, common.utcnow(), limit=100)
        reads.sample_prompt_item_ids(conn, ledger.queued.id, 8, seed=0)
        dashboard_queries.gather_dashboard(conn)
        pages = dashboard_queries.iter_item_stats(conn, ledger.ending.id, page_size=1000)
        for _ in range(3):
            next(pages)
        conn.rollback()
    metrics_queries.read_snapshot(ledger.engine)


def _reconcile(ledger: Ledger) -> None:
    settings = Settings(database_url=ledger.url, broker_url="memory://")
    reconcile.reconcile(ledger.engine, settings, run=None, publish=lambda ids, wait: None)
    # what it does to the items it finds lost (the in-memory broker loses none)
    _in(ledger, lambda conn: queue.touch_queued(conn, ledger.message_ids))
    _in(ledger, lambda conn: queue.mark_queued(conn, ledger.message_ids))


PATHS: dict[str, Callable[[Ledger], None]] = {
    "worker": _worker,
    "runner": _runner,
    "beat": _beat,
    "reconcile": _reconcile,
    "tokenmill status": lambda led: _cli(led, "status"),
    "tokenmill status RUN": lambda led: _cli(led, "status", "ending"),
    "tokenmill servers": lambda led: _cli(led, "servers"),
    "tokenmill events --run RUN": lambda led: _cli(led, "events", "--run", "queued"),
}


def _nodes(plan: dict[str, Any], under_sort: bool = False) -> Iterator[tuple[dict[str, Any], bool]]:
    yield plan, under_sort
    sorting = under_sort or plan["Node Type"] in ("Sort", "Incremental Sort")
    for child in plan.get("Plans", []):
        yield from _nodes(child, sorting)


def _problems(plan: dict[str, Any]) -> list[str]:
    found = []
    for node, under_sort in _nodes(plan):
        if node.get("Relation Name") not in ("items", "items_archive"):
            continue
        kind, index = node["Node Type"], node.get("Index Name")
        read = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * node.get(
            "Actual Loops", 1
        )
        if kind == "Seq Scan":
            found.append("a sequential scan of items")
        if index == "items_pkey" and "Index Cond" not in node:
            found.append("a walk of the whole primary key")
        if under_sort:
            found.append(f"a sort over rows of items ({kind} {index})")
        if read > BOUNDED:
            found.append(f"{kind} {index} read {read:.0f} rows")
    return found


def _explain(ledger: Ledger, sent: Sent) -> list[str]:
    with ledger.engine.connect() as conn:
        conn.begin()
        for pin, parameters in sent.pins:
            conn.exec_driver_sql(pin, parameters)
        explained = conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + sent.statement, sent.parameters
        ).scalar_one()
        conn.rollback()
    return _problems(explained[0]["Plan"])


@pytest.fixture(scope="module", params=["stale", "fresh"])
def statistics(request: pytest.FixtureRequest, ledger: Ledger) -> str:
    """The statistics from before the enqueue of 50,000 queued items, then fresh ones."""
    if request.param == "fresh":
        with ledger.engine.begin() as conn:
            conn.execute(text("ANALYZE items"))
    return str(request.param)


@pytest.mark.parametrize("path", list(PATHS))
def test_every_statement_is_an_index_probe_or_a_bounded_range(
    ledger: Ledger, statistics: str, path: str
) -> None:
    with Capture() as capture:
        PATHS[path](ledger)
    assert capture.sent, f"{path} sent no statement"
    bad, known = [], KNOWN.get((path, statistics))
    for sent in capture.sent:
        problems = _explain(ledger, sent)
        if problems:
            bad.append(f"{'; '.join(problems)}: {_short(sent.statement)}")
    if known is not None:
        matched = [b for b in bad if known[0] in b]
        assert matched, f"fixed: take {(path, statistics)} out of KNOWN"
        bad = [b for b in bad if known[0] not in b]
    assert bad == [], f"{path}, {statistics} statistics:\n" + "\n".join(bad)


def _short(statement: str) -> str:
    """The statement on one line, its long IN lists cut."""
    flat = re.sub(r"\s+", " ", statement)
    return re.sub(r"(\(%\(\w+\)s::\w+), [^)]*\)", r"\1, ...)", flat)[:400]


def _referenced() -> set[str]:
    """module.function of every app.ledger function the worker, beat and the commands of
    PATHS name in their source."""
    modules = {p.stem for p in (ROOT / "app" / "ledger").glob("*.py")} - {"__init__"}
    files = [*(ROOT / "workers").rglob("*.py"), *(ROOT / "ops" / "views").rglob("*.py")]
    files += [ROOT / "ops" / f for f in ("status_cmd.py", "fleet_cmd.py")]
    files += [ROOT / "app" / "ledger" / "status_reads.py"]  # the read model of `status`
    out: set[str] = set()
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        alias: dict[str, str] = {}
        names: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "app.ledger":
                alias |= {a.asname or a.name: a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("app.ledger."):
                module = (node.module or "").split(".")[2]
                names |= {a.asname or a.name: f"{module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("app.ledger.") and a.asname:
                        alias[a.asname] = a.name.split(".")[2]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in alias:
                    out.add(f"{alias[node.value.id]}.{node.attr}")
            elif isinstance(node, ast.Name) and node.id in names:
                out.add(names[node.id])
    return {name for name in out if _is_function(name)}


def _is_function(name: str) -> bool:
    module, attr = name.split(".")
    return inspect.isfunction(getattr(importlib.import_module(f"app.ledger.{module}"), attr, None))


def test_the_list_of_hot_statements_is_complete(ledger: Ledger) -> None:
    """Every ledger function the worker, beat and these commands name is run by a path of
    PATHS (so its statements are explained above) or is EXEMPT with its reason."""
    with Capture() as capture:
        for path in PATHS.values():
            path(ledger)
    missing = sorted(_referenced() - capture.called - set(EXEMPT))
    assert missing == [], f"add a path that runs these to PATHS, or a reason to EXEMPT: {missing}"

"""`python bench/fleet.py [--workers 16] [--items 24000] [--compare]`: the ledger's cost per item
with many workers on one Postgres (issue 40).

A private Postgres cluster (bench/fleet_cluster.py: its own WAL, commits and processes, so a
loaded machine's other databases do not count) holds the ledger. An enqueue inserts the items
(prompts of --prompt-ids, 50-200 ids by default) and marks them queued, as `tokenmill enqueue`
does, in batches of 512. Then --workers stand-in workers, each a process of its own as
`celery -A app worker` is, take messages of --batch ids from a shared queue (standing in for
Redis) and run the worker's ledger path against a server that answers at once: per message the
key lookup and the claim (app.ledger.claims, as workers/engine/generate.py), each result
(--output-ids, 60 by default) through the
worker's group-commit writer (workers/engine/writer.py ResultWriter), and the lease heartbeat
(workers/engine/heartbeat.py) on its own connection; every pool is the default
TOKENMILL_DB_POOL's.

Each phase starts after a CHECKPOINT (every page's first change then writes a full-page image,
as it does in a ledger much larger than what one checkpoint interval touches) and prints, per
item: commits, statements, WAL bytes (from pg_waldump: the ids' bytes, the payload, and the
rest, by record kind), rows written (HOT share of the updates), Postgres CPU ms (every process
of the cluster), the connections held, and the items/s the phase sustained. --compare runs the
same work on the ledger at migration 0020 (before issue 40's) and at head, in one run. A last
phase renews RENEWED leases once (one heartbeat): the cost of each renewal, which a long
generation pays every lease_s / 2.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fleet_cluster import Cluster, WalShare
from sqlalchemy import Engine, text

from app.core.contracts import GenerateResult, SamplingParams
from app.core.process_name import name_process
from app.ledger import claims, queue, run_queries
from app.ledger.database import make_engine
from app.ledger.migrate import upgrade
from app.ledger.outcomes import Done
from workers.engine.heartbeat import renew_leases
from workers.engine.window_types import WindowConfig
from workers.engine.writer import ResultWriter

CLAIM_THREADS = 4  # TOKENMILL_WORKER_THREADS' default: Celery threads taking messages
SHARED_POOL = 3  # TOKENMILL_DB_POOL's default less the heartbeat's own connection
ENQUEUE_BATCH = 512
RENEWED = 2048  # leased items one measured heartbeat renews


@dataclass(frozen=True)
class Shape:
    """An item's ids: its prompt's (uniform between two lengths) and its output's."""

    prompt_min: int = 50
    prompt_max: int = 200
    output: int = 60


SMALL = Shape()  # the measured fleet: prompts of 50-200 ids, outputs of ~60
ID_BYTES = 4  # app.core.models.TokenArray: packed 32-bit ids
BEFORE = "0020"  # the schema before issue 40's migration
# a private cluster at Postgres' defaults but for room for every worker's connections
CLUSTER_SETTINGS = {
    "max_connections": "400",
    "max_wal_size": "4GB",
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
}
TOP_STATEMENTS = 6  # of each phase, by WAL bytes
STATEMENT_CHARS = 90


@dataclass
class Snapshot:
    """Counters of the cluster at one instant."""

    lsn: str
    commits: int
    rows: Counter[str]
    cpu_s: float
    at: float


@dataclass
class Phase:
    """What one phase cost: its deltas, its items and payload bytes."""

    name: str
    items: int
    payload: int
    statements: int
    commits: int
    rows: Counter[str]
    cpu_s: float
    wall_s: float
    wal: list[WalShare]
    connections: dict[str, int]
    top: list[tuple[str, int, int]]  # (statement, calls, WAL bytes), most WAL first

    @property
    def wal_bytes(self) -> int:
        return sum(s.record_bytes + s.fpi_bytes for s in self.wal)

    def per_item(self, value: float) -> float:
        return value / max(1, self.items)


def snapshot(cluster: Cluster, db: Engine) -> Snapshot:
    # backends send their table and transaction counts when idle (at most once a second)
    time.sleep(1.2)
    with db.connect() as conn:  # a commit record flushes the WAL up to it: pg_waldump reads it
        conn.execute(text("SELECT txid_current()"))
        conn.commit()
        lsn = str(conn.execute(text("SELECT pg_current_wal_flush_lsn()")).scalar())
        commits = int(
            conn.execute(
                text("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
            ).scalar()
            or 0
        )
        row = conn.execute(
            text(
                "SELECT sum(n_tup_ins), sum(n_tup_upd), sum(n_tup_hot_upd), sum(n_tup_del) "
                "FROM pg_stat_user_tables"
            )
        ).one()
        conn.rollback()
    rows = Counter({k: int(v or 0) for k, v in zip(("ins", "upd", "hot", "del"), row, strict=True)})
    return Snapshot(lsn, commits, rows, cluster.cpu_s(), time.monotonic())


def checkpoint(db: Engine) -> None:
    with db.connect() as conn:
        conn.execute(text("CHECKPOINT"))
        conn.commit()


class ConnectionPeaks:
    """The most connections each application_name held at once (pg_stat_activity, sampled)."""

    def __init__(self, db: Engine) -> None:
        self.db = db
        self.peak: Counter[str] = Counter()
        self.total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        query = text(
            "SELECT application_name, count(*) FROM pg_stat_activity "
            "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() "
            "GROUP BY application_name"
        )
        with self.db.connect() as conn:
            while not self._stop.is_set():
                counts = dict(conn.execute(query).all())
                conn.rollback()
                for name, count in counts.items():
                    self.peak[name] = max(self.peak[name], int(count))
                self.total = max(self.total, sum(int(c) for c in counts.values()))
                self._stop.wait(0.2)

    def __enter__(self) -> ConnectionPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def by_worker(self) -> dict[str, int]:
        workers = [v for k, v in self.peak.items() if k.startswith("tokenmill-worker")]
        return {
            "total": self.total,
            "workers": len(workers),
            "per worker (max)": max(workers, default=0),
        }


def create_run(db: Engine, name: str) -> int:
    spec = run_queries.RunSpec(
        name=name,
        tokenizer_path="/models/synthetic",
        tokenizer_hash="0" * 64,
        chat_template_hash="0" * 64,
        chat_template_kwargs={},
        sampling=SamplingParams(max_new_tokens=60, temperature=0.7, seed=1),
        samples_per_prompt=1,
        think_end_id=None,
        eos_token_ids=[2],
    )
    with db.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec)
    return run.id


def enqueue(
    db: Engine, run_id: int, items: int, seed: int, shape: Shape = SMALL
) -> tuple[list[int], int]:
    """Insert and queue the items in batches of ENQUEUE_BATCH; their ids and prompt bytes."""
    rng = random.Random(seed)
    ids: list[int] = []
    payload = 0
    for start in range(0, items, ENQUEUE_BATCH):
        batch = []
        for n in range(start, min(items, start + ENQUEUE_BATCH)):
            length = rng.randint(shape.prompt_min, shape.prompt_max)
            prompt = [rng.randrange(3, 160_000) for _ in range(length)]
            payload += len(prompt) * ID_BYTES
            batch.append(
                queue.NewItem(
                    item_key=f"q{n}", sample_index=0, line_no=n, messages=None, prompt_ids=prompt
                )
            )
        with db.begin() as conn:
            queue.insert_items(conn, run_id, batch)
            new = queue.pending_ids(conn, run_id, after_id=ids[-1] if ids else 0, limit=len(batch))
        with db.begin() as conn:  # published, then marked queued (workers/intake/storing.py)
            queue.mark_queued(conn, new)
        ids += new
    return ids, payload


def _result(item: claims.ClaimedItem, shape: Shape) -> Done:
    rng = random.Random(item.id)
    output = [rng.randrange(3, 160_000) for _ in range(shape.output)]
    return Done(
        item.id,
        GenerateResult(
            rid=str(item.id),
            output_ids=output,
            finish_reason="length",
            matched_stop=None,
            prompt_tokens=len(item.prompt_ids),
            completion_tokens=shape.output,
            cached_tokens=0,
            e2e_latency_s=0.05,
            weight_version="1",
            sampling_params={"max_new_tokens": shape.output, "temperature": 0.7, "seed": item.id},
        ),
    )


def stand_in(index: int, url: str, messages: Any, writer_batch: int, shape: Shape) -> None:
    """One worker process: CLAIM_THREADS claiming messages, a group-commit writer and a lease
    heartbeat, on a pool of SHARED_POOL connections and the heartbeat's own."""
    server = f"bench-{index}:30000"
    name_process(f"tokenmill-worker {server}")
    db = make_engine(url, pool_size=SHARED_POOL)
    owner = f"{server}@bench:{os.getpid()}"
    config = WindowConfig(
        server_name=server,
        inflight=272,
        lease_s=300.0,
        heartbeat_s=2.0,
        max_attempts=5,
        retry_backoff_s=2.0,
        retry_backoff_max_s=120.0,
        unavailable_wait_s=5.0,
        writer_batch=writer_batch,
    )
    writer = ResultWriter(db, owner=owner, config=config, on_written=lambda *_: None)
    stopping = threading.Event()
    background = [
        threading.Thread(target=writer.loop),
        threading.Thread(target=renew_leases, args=(db, owner, config, stopping)),
    ]

    def claim_loop() -> None:
        while (ids := messages.get()) is not None:
            with db.connect() as conn:  # what the message's ids group by (generate.py)
                claims.item_keys(conn, ids)
            with db.begin() as conn:
                claimed = claims.claim_items(
                    conn, ids, owner=owner, server=server, lease_s=config.lease_s
                )
            for item in claimed:
                writer.put(_result(item, shape), True)

    claimers = [threading.Thread(target=claim_loop) for _ in range(CLAIM_THREADS)]
    for thread in [*background, *claimers]:
        thread.start()
    for thread in claimers:
        thread.join()
    writer.stop()
    background[0].join()
    stopping.set()
    background[1].join()
    db.dispose()


def shape_of(args: argparse.Namespace) -> Shape:
    low, high = (int(n) for n in args.prompt_ids.split(","))
    return Shape(low, high, args.output_ids)


def work(url: str, ids: list[int], args: argparse.Namespace) -> None:
    """Every id through --workers stand-ins."""
    context = multiprocessing.get_context("fork")
    messages = context.Queue()
    for start in range(0, len(ids), args.batch):
        messages.put(ids[start : start + args.batch])
    for _ in range(args.workers * CLAIM_THREADS):
        messages.put(None)
    procs = [
        context.Process(target=stand_in, args=(i, url, messages, args.writer_batch, shape_of(args)))
        for i in range(args.workers)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"a stand-in worker exited {proc.exitcode}")


def statements(db: Engine) -> tuple[int, list[tuple[str, int, int]]]:
    """Top-level statements the phase ran (the benchmark's own readings left out) and the
    statements (top-level or in a trigger) that wrote the most WAL."""
    with db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT query, toplevel, calls, wal_bytes FROM pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "AND query !~* 'pg_stat|pg_current_wal|txid_current|CHECKPOINT'"
            )
        ).all()
        conn.rollback()
    ran = sum(int(r.calls) for r in rows if r.toplevel)
    top = sorted(rows, key=lambda r: -int(r.wal_bytes))[:TOP_STATEMENTS]
    return ran, [
        (" ".join(r.query.split())[:STATEMENT_CHARS], r.calls, int(r.wal_bytes)) for r in top
    ]


def reset_statements(db: Engine) -> None:
    with db.connect() as conn:
        conn.execute(text("SELECT pg_stat_statements_reset()"))
        conn.commit()


def measure(cluster: Cluster, db: Engine, name: str, run: Any) -> Phase:
    """Run run() between two snapshots; run returns (items, payload bytes)."""
    checkpoint(db)
    before = snapshot(cluster, db)
    reset_statements(db)
    with ConnectionPeaks(db) as peaks:
        started = time.monotonic()
        items, payload = run()
        wall_s = time.monotonic() - started
    after = snapshot(cluster, db)
    ran, top = statements(db)
    return Phase(
        name=name,
        items=items,
        payload=payload,
        statements=ran,
        commits=after.commits - before.commits,
        rows=after.rows - before.rows,
        cpu_s=after.cpu_s - before.cpu_s,
        wall_s=wall_s,
        wal=cluster.wal_stats(before.lsn, after.lsn),
        connections=peaks.by_worker(),
        top=top,
    )


def item_total(enqueue: Phase, work: Phase, revision: str) -> Phase:
    """An item's whole cost: its enqueue and its work, per item of the run."""
    return Phase(
        name=f"enqueue + work ({revision})",
        items=work.items,
        payload=enqueue.payload + work.payload,
        statements=enqueue.statements + work.statements,
        commits=enqueue.commits + work.commits,
        rows=enqueue.rows + work.rows,
        cpu_s=enqueue.cpu_s + work.cpu_s,
        wall_s=enqueue.wall_s + work.wall_s,
        wal=[*enqueue.wal, *work.wal],
        connections=work.connections,
        top=[],
    )


def ledger_phases(cluster: Cluster, revision: str, args: argparse.Namespace) -> list[Phase]:
    url = cluster.create_database(f"bench_{revision}")
    db = make_engine(url, pool_size=2)
    upgrade(db, revision)
    with db.connect() as conn:
        conn.execute(text("CREATE EXTENSION pg_stat_statements"))
        conn.commit()
    run_id = create_run(db, "fleet")
    queued: list[int] = []

    def do_enqueue() -> tuple[int, int]:
        ids, payload = enqueue(db, run_id, args.items, seed=args.seed, shape=shape_of(args))
        queued.extend(ids)
        return len(ids), payload

    def do_work() -> tuple[int, int]:
        work(url, queued, args)
        with db.connect() as conn:
            done = conn.execute(
                text(
                    "SELECT count(*), coalesce(sum(octet_length(output_ids)), 0) FROM items "
                    "WHERE status = 'done'"
                )
            ).one()
        return int(done[0]), int(done[1])

    phases = [
        measure(cluster, db, f"enqueue ({revision})", do_enqueue),
        measure(cluster, db, f"work ({revision})", do_work),
    ]
    if phases[1].items != args.items:
        raise SystemExit(f"{revision}: {phases[1].items} of {args.items} items done")
    phases.append(item_total(phases[0], phases[1], revision))
    phases.append(renewals(cluster, db, revision, args))
    db.dispose()
    return phases


def renewals(cluster: Cluster, db: Engine, revision: str, args: argparse.Namespace) -> Phase:
    """One heartbeat over RENEWED leased items past half their term: what one renewal of a
    leased item costs (a long generation's item is renewed every lease_s / 2, 150 s)."""
    run_id = create_run(db, "renewals")
    ids, _ = enqueue(db, run_id, RENEWED, seed=args.seed + 1)
    with db.begin() as conn:
        claims.claim_items(conn, ids, owner="held", server="held:1", lease_s=100.0)

    def renew() -> tuple[int, int]:
        with db.begin() as conn:
            renewed = claims.extend_leases(conn, owner="held", lease_s=300.0, heartbeat_s=30.0)
        return renewed, 0

    return measure(cluster, db, f"renewal ({revision})", renew)


# record kinds by what they are: the items' and counters' rows, index entries, commits
WAL_GROUPS = (
    ("heap rows", ("Heap/INSERT", "Heap/UPDATE", "Heap/HOT_UPDATE", "Heap2/MULTI_INSERT")),
    ("row locks, pruning", ("Heap/LOCK", "Heap2/PRUNE", "Heap2/VACUUM", "Heap2/VISIBLE")),
    ("index entries", ("Btree/",)),
    ("commits", ("Transaction/",)),
)


def wal_breakdown(phase: Phase) -> list[tuple[str, float]]:
    """Bytes per item of each record group, full-page images apart."""
    groups: Counter[str] = Counter()
    for share in phase.wal:
        group = next(
            (g for g, kinds in WAL_GROUPS if any(share.kind.startswith(k) for k in kinds)),
            "other",
        )
        groups[group] += share.record_bytes
        groups["full-page images"] += share.fpi_bytes
    return [(g, phase.per_item(b)) for g, b in groups.most_common()]


def row_of(phase: Phase) -> list[str]:
    rows = phase.rows
    written = rows["ins"] + rows["upd"] + rows["del"]
    hot = 100.0 * rows["hot"] / rows["upd"] if rows["upd"] else 0.0
    overhead = phase.wal_bytes - phase.payload
    return [
        phase.name,
        f"{phase.items:,}",
        f"{phase.per_item(phase.commits):.3f}",
        f"{phase.per_item(phase.statements):.3f}",
        f"{phase.per_item(phase.wal_bytes):,.0f}",
        f"{phase.per_item(phase.payload):,.0f}",
        f"{phase.per_item(overhead):,.0f}",
        f"{overhead / phase.payload:.2f}" if phase.payload else "—",
        f"{phase.per_item(written):.2f} ({hot:.0f}% HOT)",
        f"{1000 * phase.per_item(phase.cpu_s):.3f}",
        f"{phase.items / phase.wall_s:,.0f}",
        f"{phase.connections['per worker (max)']} / {phase.connections['total']}",
    ]


HEADERS = [
    "phase",
    "items",
    "commits/item",
    "statements/item",
    "WAL B/item",
    "payload B/item",
    "overhead B/item",
    "overhead/payload",
    "rows written/item",
    "PG CPU ms/item",
    "items/s",
    "conns per worker / all",
]


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16, help="stand-in worker processes")
    parser.add_argument("--items", type=int, default=24_000)
    parser.add_argument("--batch", type=int, default=32, help="ids per message")
    parser.add_argument("--writer-batch", type=int, default=256, help="outcomes per commit")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--prompt-ids", default="50,200", help="a prompt's length in ids: MIN,MAX (uniform)"
    )
    parser.add_argument("--output-ids", type=int, default=60, help="an output's length in ids")
    parser.add_argument("--compare", action="store_true", help=f"also at migration {BEFORE}")
    args = parser.parse_args()
    cluster = Cluster(CLUSTER_SETTINGS)
    cluster.start()
    try:
        revisions = [BEFORE, "head"] if args.compare else ["head"]
        phases = [p for revision in revisions for p in ledger_phases(cluster, revision, args)]
    finally:
        cluster.stop()
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"bench/fleet.py --workers {args.workers} --items {args.items} --batch {args.batch} "
        f"--writer-batch {args.writer_batch} --prompt-ids {args.prompt_ids} "
        f"--output-ids {args.output_ids}{' --compare' if args.compare else ''}, {when}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    )
    print_table(HEADERS, [row_of(p) for p in phases])
    print("\nWAL bytes per item by record kind (full-page images apart):")
    groups = sorted({g for p in phases for g, _ in wal_breakdown(p)})
    print_table(
        ["phase", *groups],
        [[p.name, *(f"{dict(wal_breakdown(p)).get(g, 0.0):,.0f}" for g in groups)] for p in phases],
    )
    for phase in (p for p in phases if p.top):
        print(f"\n{phase.name}: the statements that wrote the most WAL (bytes per item)")
        print_table(
            ["statement", "calls", "WAL B/item"],
            [[q, f"{calls:,}", f"{phase.per_item(b):,.0f}"] for q, calls, b in phase.top],
        )


if __name__ == "__main__":
    main()

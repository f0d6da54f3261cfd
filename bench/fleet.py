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
same work on the ledger just before issue 40's migration and at head, in one run. A last
phase renews RENEWED leases once (one heartbeat): the cost of each renewal, which a long
generation pays every lease_s / 2.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fleet_cluster import Cluster
from fleet_phase import HEADERS, Phase, item_total, measure, print_table, row_of, wal_breakdown
from sqlalchemy import Engine, text

from app.core.contracts import GenerateResult, SamplingParams
from app.core.process_name import name_process
from app.ledger import claims, database, migrate, outcomes, queue, run_queries
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
LEAN_ROWS = "_lean_item_rows.py"  # issue 40's migration, found by its file name
# a private cluster at Postgres' defaults but for room for every worker's connections
CLUSTER_SETTINGS = {
    "max_connections": "400",
    "max_wal_size": "4GB",
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
}


def before_lean_rows() -> str:
    """The revision just before issue 40's migration (its down_revision): the schema --compare
    measures against, whatever number the migration has."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrate.alembic_config("sqlite://"))
    for rev in script.walk_revisions():
        if rev.path.endswith(LEAN_ROWS) and isinstance(rev.down_revision, str):
            return rev.down_revision
    raise SystemExit(f"no migration *{LEAN_ROWS} in {script.dir}")


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


def _result(item: claims.ClaimedItem, shape: Shape) -> outcomes.Done:
    rng = random.Random(item.id)
    output = [rng.randrange(3, 160_000) for _ in range(shape.output)]
    return outcomes.Done(
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
    db = database.make_engine(url, pool_size=SHARED_POOL)
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


def ledger_phases(cluster: Cluster, revision: str, args: argparse.Namespace) -> list[Phase]:
    url = cluster.create_database(f"bench_{revision}")
    db = database.make_engine(url, pool_size=2)
    migrate.upgrade(db, revision)
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


def main() -> None:
    before = before_lean_rows()
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
    parser.add_argument("--compare", action="store_true", help=f"also at migration {before}")
    args = parser.parse_args()
    cluster = Cluster(CLUSTER_SETTINGS)
    cluster.start()
    try:
        revisions = [before, "head"] if args.compare else ["head"]
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

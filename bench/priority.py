"""A small run behind a big one on a shared fleet: its time to finish there, divided by its time
alone on the same fleet, when it is urgent (`--priority 10`), when it has the big run's
priority (round robin between the two), and, for comparison, with the workers' claim order of
before run priorities (each message's own ids, first in first out).

One emulator (16 slots, ~1.5 s an item by default) and one `celery -A app worker -E`; each
case gets a fresh database, an empty Redis and a fresh worker. `alone`: the small run is the
only one. `urgent` and `equal`: a big run is enqueued first (its messages fill the queue) and
the small one once the big run has finished a window's worth of items, with `--priority 10`
or none. `fifo`: as `equal`, with the worker's claim order replaced by a sitecustomize on its
PYTHONPATH that grants the room to the message's own ids only, in message order (what every
worker did before run priorities; nothing in the project changes). A run's time to finish:
from its creation (the start of its `tokenmill enqueue`) to its last result, from the ledger.
The big run is left unfinished (it only has to outlast the small one; the case ends when the
small run is done).

    python bench/priority.py                          # 48 small items behind 1,500
    python bench/priority.py --small 96 --big 3000 --step-ms 40
    python bench/priority.py --cases alone,urgent,equal  # without the slow fifo case
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    REDIS_URL,
    bench_database,
    emulator,
    engine_for,
    flush_redis,
    machine_note,
    run_tokenmill,
    service_env,
    start_worker,
    stop_process,
    table,
    wait_run_finished,
    write_chat_prompts,
)
from sqlalchemy import func, select

CASES = ("alone", "urgent", "equal", "fifo")
# `fifo`: the claim order of before run priorities, put in place in the worker only
FIFO = """
import celery.signals

@celery.signals.worker_init.connect
def _message_order(**_):
    from workers.engine import scheduling

    def plan(self, room, in_hand, **_):
        grants = []
        for run, n in in_hand.items():
            if room > 0 and n > 0:
                grants.append((run, min(n, room)))
                room -= min(n, room)
        return grants

    scheduling.ClaimOrder.plan = plan
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--small", type=int, default=48, help="items of the small run")
    p.add_argument("--big", type=int, default=1500, help="items of the big run")
    p.add_argument("--max-running", type=int, default=16, help="the emulator's batch slots")
    p.add_argument("--step-ms", type=float, default=60.0)
    p.add_argument("--median-tokens", type=float, default=25.0)
    p.add_argument("--sigma", type=float, default=0.2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--cases", default=",".join(CASES), help="of " + ", ".join(CASES))
    args = p.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = set(args.cases) - set(CASES)
    if unknown or "alone" not in args.cases:
        p.error(f"--cases: {', '.join(sorted(unknown)) or 'alone is needed'} (of {CASES})")
    return args


def enqueue(env: dict[str, str], prompts: Path, run: str, *flags: str) -> None:
    from common import fixture_tokenizer_dir

    run_tokenmill(
        [
            *("enqueue", str(prompts), "--run", run),
            *("--tokenizer", str(fixture_tokenizer_dir()), "--max-new-tokens", "512"),
            *flags,
        ],
        env,
    )


def time_to_finish(db: Any, run: str) -> float:
    """Seconds from the run's creation to its last result."""
    from app.ledger import common, run_queries

    with db.connect() as conn:
        info = run_queries.get_run(conn, run)
        last = conn.execute(
            select(func.max(common.items.c.finished_at)).where(common.items.c.run_id == info.id)
        ).scalar_one()
    return float((last - info.created_at).total_seconds())


def big_finished(db: Any) -> int:
    from app.ledger import reads, run_queries

    with db.connect() as conn:
        counts = reads.run_counts(conn, run_queries.get_run(conn, "big"))
    return int(counts.done + counts.failed)


def run_case(case: str, args: argparse.Namespace, url: str, folder: Path) -> dict[str, Any]:
    """One case on a fresh database, Redis and worker; the small run's figures."""
    small = write_chat_prompts(folder / "small.jsonl", args.small, words=60, seed=2)
    big = write_chat_prompts(folder / "big.jsonl", args.big, words=60, seed=1)
    flush_redis()
    with bench_database() as pg_url:
        settings = {"TOKENMILL_SGLANG_URL": url, "TOKENMILL_SERVER_NAME": "gpu-a"}
        env = service_env(pg_url, REDIS_URL, folder / case, **settings)
        if case == "fifo":
            site = folder / "fifo-site"
            site.mkdir(exist_ok=True)
            (site / "sitecustomize.py").write_text(FIFO)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
        db = engine_for(pg_url)
        worker = start_worker(env, f"prio-{case}", folder / f"worker-{case}.log")
        try:
            if case != "alone":
                enqueue(env, big, "big")
                deadline = time.monotonic() + args.timeout
                while big_finished(db) < args.max_running:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the big run did not start")
                    time.sleep(0.25)
            flags = ("--priority", "10") if case == "urgent" else ()
            enqueue(env, small, "small", *flags)
            wait_run_finished(
                db, "small", timeout_s=args.timeout, alive=lambda: worker.poll() is None
            )
            seconds = time_to_finish(db, "small")
            behind = big_finished(db) if case != "alone" else 0
        finally:
            stop_process(worker)
            db.dispose()
            flush_redis()
    return {"case": case, "seconds": seconds, "big_finished": behind}


def main() -> None:
    args = parse_args()
    print(machine_note())
    flags = [
        *("--max-running", str(args.max_running), "--step-ms", str(args.step_ms)),
        *("--median-tokens", str(args.median_tokens), "--sigma", str(args.sigma)),
        *("--log-level", "WARNING"),
    ]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, emulator(flags) as server:
        for case in args.cases:
            results[case] = run_case(case, args, server.url, Path(tmp))
            print(f"{case}: {results[case]['seconds']:.1f} s", flush=True)
    alone = results["alone"]["seconds"]
    rows = [
        [
            case,
            results[case]["seconds"],
            results[case]["seconds"] / alone,
            results[case]["big_finished"] if case != "alone" else "-",
        ]
        for case in args.cases
    ]
    print(
        f"\n{args.small} small items, {args.big} big ones, {args.max_running} slots, "
        f"step {args.step_ms} ms, median {args.median_tokens} tokens"
    )
    print(table(["small run", "time to finish s", "÷ alone", "big run finished by then"], rows))


if __name__ == "__main__":
    main()

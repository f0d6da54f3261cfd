"""Per-item overhead: tokenmill end to end against an emulator that answers at once.

Against ONE emulator started with `--step-ms 0` (no batching delay: every request is
answered as soon as it is parsed), in the same run:

  bare       a bare client keeping a window of requests in flight (N threads, each with its
             own single-connection httpx client): the most this machine can push through
             the emulator;
  tokenmill  per TOKENMILL_INFLIGHT:TOKENMILL_BATCH_SIZE config, a fresh run of the same
             prompt ids and sampling enqueued with `workers.intake.producer.enqueue` and published
             to Redis, then ONE `celery -A app worker` (claim in Postgres, request, durable
             group-commit write) until the ledger says the run is finished.

Items/s = items / busy span (bare: first send to last answer; tokenmill: the ledger's first
claim to its last written result). CPU ms per item is measured per process over the run:
the worker (or the bare client), the Postgres backends of the benchmark database, Redis
(whole server) and the emulator.

    python bench/overhead.py                           # 20,000 items a config, ~4 minutes
    python bench/overhead.py --items 5000 --configs 64:8,16:32
    python bench/overhead.py --configs 64:32,64:32@TOKENMILL_HEDGE=false   # with a setting
    python bench/overhead.py --profile /tmp/oh         # py-spy profile of every worker
    python bench/overhead.py --max-running 1024 --configs 64:32,256:32,1024:32,auto:32
                                                       # the window's cost as it grows

INFLIGHT `auto` is the default (sized by the emulator's --max-running). The worker's peak RSS
(VmHWM) and its RSS at the end of each config are printed beside its CPU.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bare_client import Request, bare_client_run
from common import (
    REDIS_URL,
    bench_database,
    emulator,
    emulator_stats,
    engine_for,
    fixture_tokenizer_dir,
    flush_redis,
    machine_note,
    run_items,
    run_span,
    service_env,
    start_worker,
    stop_process,
    table,
    wait_first_claim,
    wait_run_finished,
)
from meters import CpuMeter, profile_summary, start_profile
from sqlalchemy import text

DEFAULT_CONFIGS = "64:8,64:32,16:32"
# where the worker's time goes, by the functions that own it (py-spy frame names)
FOCUS = (
    "Slot.loop",
    "SGLangClient.generate",
    "SGLangClient._send",
    "parse_generate_response",
    "ResultWriter.loop",
    "record_outcomes",
    "Timer.loop",
    "handle_message",
    "claim_items",
    "InflightWindow.wait_for_room",
    "trace_task",
    "Consumer.start",
    "EventDispatcher.send",
    "Connection.commit",
    "Session.commit",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--items", type=int, default=20_000, help="items per tokenmill config")
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="comma-separated INFLIGHT:BATCH_SIZE[:WORKER_THREADS][@NAME=VALUE...] tokenmill "
        "configs; each @NAME=VALUE is one more worker setting",
    )
    p.add_argument("--bare-window", type=int, default=64, help="window of the bare client")
    p.add_argument(
        "--bare-items", type=int, default=10_000, help="items per bare client run (≤ --items)"
    )
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (ids)")
    p.add_argument("--median-tokens", type=float, default=128.0, help="output length")
    p.add_argument("--sigma", type=float, default=0.0, help="log-normal sigma of outputs")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="the emulator's --max-running (what an auto window is sized by; default: its own)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--no-analyze",
        action="store_true",
        help="skip ANALYZE after enqueueing (claims then run on stale planner statistics)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="print the plans of a claim and of the producer's key lookup before and after "
        "ANALYZE (EXPLAIN ANALYZE in a rolled-back transaction)",
    )
    p.add_argument("--profile", type=Path, default=None, help="folder for py-spy profiles")
    p.add_argument("--profile-s", type=int, default=10, help="seconds to profile each worker")
    p.add_argument("--timeout", type=float, default=900.0, help="per-config limit, seconds")
    return p.parse_args()


Config = tuple[int | str, int, int | None, dict[str, str]]


def parse_configs(text: str) -> list[Config]:
    configs = []
    for part in text.split(","):
        sizes, *extra = part.strip().split("@")
        first, *rest = sizes.split(":")
        try:
            inflight: int | str = first if first == "auto" else int(first)
            values = [int(v) for v in rest]
        except ValueError:
            values = []
        if len(values) not in (1, 2) or not all("=" in kv for kv in extra):
            raise SystemExit(
                f"bad config {part!r}: want INFLIGHT|auto:BATCH_SIZE[:THREADS][@NAME=VALUE...]"
            )
        settings = dict(kv.split("=", 1) for kv in extra)
        configs.append((inflight, values[0], values[1] if len(values) == 2 else None, settings))
    return configs


def write_id_prompts(path: Path, count: int, tokens: int, seed: int) -> Path:
    """JSONL of pre-tokenized prompts ({"id", "input_ids"}): no templating in the way."""
    import json

    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for i in range(count):
            n = max(8, int(tokens * rng.uniform(0.75, 1.25)))
            ids = [163587, *(rng.randrange(300, 1500) for _ in range(n - 3)), 163601, 163606]
            out.write(json.dumps({"id": f"o{i:07d}", "input_ids": ids}) + "\n")
    return path


def enqueue_run(
    args: argparse.Namespace, db: Any, tokenizer: Any, prompts: Path, run: str
) -> float:
    """Producer path with publish=None (ledger rows only); seconds taken."""
    from app.core.contracts import SamplingParams
    from workers.intake.producer import EnqueueOptions, enqueue

    options = EnqueueOptions(
        input_path=prompts,
        run=run,
        sampling=SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed),
    )
    t0 = time.perf_counter()
    report = enqueue(db, tokenizer, options, publish=None)
    if report.inserted != args.items:
        raise RuntimeError(f"enqueue of {run}: {report.to_json()}")
    return time.perf_counter() - t0


def publish_run(db: Any, run: str, batch: int) -> float:
    """Publish the run's pending ids in messages of `batch` ids and mark them queued, as the
    producer does; only now, so no other config's worker can take them."""
    from app.ledger import queue, run_queries
    from workers.intake.publish import publish_items

    t0 = time.perf_counter()
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, run).id
    after = 0
    while True:
        with db.connect() as conn:
            ids = queue.pending_ids(conn, run_id, after_id=after)
        if not ids:
            return time.perf_counter() - t0
        publish_items(ids, batch_size=batch)
        with db.begin() as conn:
            queue.mark_queued(conn, ids)
        after = ids[-1]


def explain(db: Any, run: str, when: str) -> None:
    """EXPLAIN ANALYZE, rolled back, of the claim of 8 queued ids (the statement
    `ledger.claim_items` builds) and of the producer's existing-keys lookup of 512 keys."""
    from datetime import UTC, datetime

    from sqlalchemy import select, update

    from app.ledger import claims, common, run_queries

    t = common.items
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, run).id
        ids = list(
            conn.execute(
                select(t.c.id).where(t.c.run_id == run_id).order_by(t.c.id.desc()).limit(512)
            ).scalars()
        )
        keys = list(conn.execute(select(t.c.item_key).where(t.c.id.in_(ids))).scalars())
        claim = (
            update(t)
            .where(t.c.id.in_(ids[:8]), claims.claimable(datetime.now(UTC)))
            .values(status="leased")
            .returning(t.c.id)
        )
        lookup = select(t.c.item_key).where(t.c.run_id == run_id, t.c.item_key.in_(keys))
        for name, stmt in (("claim of 8 ids", claim), ("existing_keys of 512 keys", lookup)):
            sql = str(stmt.compile(db, compile_kwargs={"literal_binds": True}))
            plan = [r[0] for r in conn.execute(text("EXPLAIN ANALYZE " + sql))]
            conn.rollback()
            keep = [line[:150] for line in plan if "Filter:" not in line and "Cond:" not in line]
            print(f"  plan, {name}, {when}:\n    " + "\n    ".join(keep), flush=True)


def run_tokenmill(
    args: argparse.Namespace,
    pg_url: str,
    data_dir: Path,
    emu: Any,
    run: str,
    config: Config,
) -> dict[str, Any]:
    inflight, batch, threads, extra = config
    settings = {
        "TOKENMILL_SGLANG_URL": emu.url,
        "TOKENMILL_INFLIGHT": str(inflight),
        "TOKENMILL_BATCH_SIZE": str(batch),
    }
    if threads:
        settings["TOKENMILL_WORKER_THREADS"] = str(threads)
    settings.update(extra)
    env = service_env(pg_url, REDIS_URL, data_dir, **settings)
    db = engine_for(pg_url)
    log = data_dir / f"{run}.log"
    started = time.monotonic()
    worker = start_worker(env, run, log)
    profiler = None
    try:
        wait_first_claim(db, run)
        meter = CpuMeter(
            {"worker": worker.pid, "emulator": emu.popen.pid}, db=db, redis_url=REDIS_URL
        ).start()
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            profiler = start_profile(
                worker.pid, args.profile / f"{run}.raw", duration_s=args.profile_s, gil=True
            )
        counts = wait_run_finished(
            db, run, timeout_s=args.timeout, alive=lambda: worker.poll() is None
        )
        whole_s = time.monotonic() - started
        cpu = meter.stop()
        rss = memory_mib(worker.pid)
        del cpu["bench"]  # this process only polled the ledger
    finally:
        if profiler is not None:
            profiler.wait()
        stop_process(worker)
    first, last = run_span(db, run)
    db.dispose()
    if counts.done != args.items:
        print(f"  !! {run}: {counts.to_json()}; see {log}")
    span_s = (last - first).total_seconds()
    label = f"tokenmill {inflight}:{batch}" + (f":{threads}" if threads else "")
    label += "".join(f" {k}={v}" for k, v in extra.items())
    result = {
        "label": label,
        "items": counts.done,
        "span_s": span_s,
        "rate": counts.done / span_s,
        "whole_s": whole_s,
        "cpu": cpu,
        "rss": rss,
    }
    if args.profile is not None:
        summary = profile_summary(args.profile / f"{run}.raw", focus=FOCUS)
        (args.profile / f"{run}-summary.txt").write_text(summary + "\n")
        result["profile"] = summary
    return result


def memory_mib(pid: int) -> tuple[float, float]:
    """(peak RSS, RSS now) of a process in MiB, from /proc (VmHWM, VmRSS)."""
    found = {"VmHWM:": 0.0, "VmRSS:": 0.0}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            name, *value = line.split()
            if name in found:
                found[name] = int(value[0]) / 1024
    return found["VmHWM:"], found["VmRSS:"]


def run_bare(emu: Any, requests: list[Request], window: int, tag: str) -> dict[str, Any]:
    reqs = [Request(r.input_ids, r.sampling, f"{tag}-{r.rid}") for r in requests]
    meter = CpuMeter({"emulator": emu.popen.pid}).start()
    run = bare_client_run(emu.url, reqs, window=window)
    cpu = meter.stop()
    if run.errors:
        raise RuntimeError(f"bare client: {len(run.errors)} errors, first: {run.errors[0]}")
    return {
        "label": f"bare client w={window}",
        "items": len(reqs),
        "span_s": run.span_s,
        "rate": len(reqs) / run.span_s,
        "whole_s": run.wall_s,
        "cpu": {"worker": cpu["bench"], "emulator": cpu["emulator"]},
    }


def main() -> None:
    args = parse_args()
    configs = parse_configs(args.configs)
    print(f"overhead benchmark — {machine_note()}")
    emu_args = ["--step-ms", "0", "--median-tokens", str(args.median_tokens)]
    emu_args += ["--sigma", str(args.sigma), "--log-level", "WARNING"]
    if args.max_running is not None:
        emu_args += ["--max-running", str(args.max_running)]
    print(
        f"{args.items} items per config, ~{args.prompt_tokens} prompt ids, emulator: "
        f"{' '.join(emu_args)}, max_new_tokens {args.max_new_tokens}"
        + (", no ANALYZE after enqueue" if args.no_analyze else ", ANALYZE after enqueue"),
        flush=True,
    )
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tm-bench-oh-") as tmp, bench_database() as pg_url:
        data_dir = Path(tmp)
        # this process publishes: its settings must name the benchmark's Redis and Postgres
        os.environ.update(service_env(pg_url, REDIS_URL, data_dir))
        from app.prompts.tokenization import load_tokenizer

        flush_redis()
        try:
            tokenizer = load_tokenizer(fixture_tokenizer_dir())
            prompts = write_id_prompts(
                data_dir / "prompts.jsonl", args.items, args.prompt_tokens, args.seed
            )
            db = engine_for(pg_url)
            runs = []
            for i in range(len(configs)):
                run = f"overhead-{i + 1}"
                took = enqueue_run(args, db, tokenizer, prompts, run)
                print(f"enqueued {run} in {took:.1f} s", flush=True)
                runs.append(run)
            if args.explain:
                explain(db, runs[-1], "planner statistics as left by the enqueue")
            if not args.no_analyze:
                # what autovacuum does within a minute or so of a big enqueue; without it the
                # claim UPDATE may plan a bitmap scan over every queued item (see README)
                with db.begin() as conn:
                    conn.execute(text("ANALYZE items"))
                if args.explain:
                    explain(db, runs[-1], "after ANALYZE items")
            items, sampling = run_items(db, runs[0])
            requests = [
                Request(it.prompt_ids, sampling.for_sample(it.sample_index), str(it.id))
                for it in items
            ]
            bare_requests = requests[: args.bare_items]
            with emulator(emu_args) as emu:
                # the bare client before and after every config: its neighbours are its
                # baseline, so a noisy neighbour on the machine shows up on both sides
                plan: list[tuple[str, Any]] = [("bare", None)]
                for run, config in zip(runs, configs, strict=True):
                    plan += [(run, config), ("bare", None)]
                for k, (what, config) in enumerate(plan):
                    if what == "bare":
                        r = run_bare(emu, bare_requests, args.bare_window, f"bare{k}")
                    else:
                        flush_redis()
                        took = publish_run(db, what, config[1])
                        print(f"  published {what} in {took:.1f} s", flush=True)
                        r = run_tokenmill(args, pg_url, data_dir, emu, what, config)
                    results.append(r)
                    parts = ", ".join(
                        f"{name} {1000 * v / r['items']:.2f}" for name, v in r["cpu"].items()
                    )
                    memory = ""
                    if "rss" in r:
                        memory = "; worker RSS MiB peak {:.0f}, end {:.0f}".format(*r["rss"])
                    print(
                        f"  {r['label']}: {r['items']} items in {r['span_s']:.1f} s = "
                        f"{r['rate']:.0f} items/s; CPU ms/item: {parts}{memory}",
                        flush=True,
                    )
                    if "profile" in r:
                        print(r["profile"], flush=True)
                stats = emulator_stats(emu.url)
            db.dispose()
            print(f"emulator answered {stats['completed']} requests", flush=True)
        finally:
            flush_redis()
    report(results)


def report(results: list[dict[str, Any]]) -> None:
    """Each tokenmill config against the mean of the bare runs just before and after it."""
    rows = []
    ratios: list[tuple[float, dict[str, Any], float]] = []
    for i, r in enumerate(results):
        baseline: Any = "-"
        if r["label"].startswith("tokenmill"):
            neighbours = [results[j]["rate"] for j in (i - 1, i + 1) if 0 <= j < len(results)]
            baseline = sum(neighbours) / len(neighbours)
            ratios.append((r["rate"] / baseline, r, baseline))
        per = {k: 1000 * v / r["items"] for k, v in r["cpu"].items()}
        rows.append(
            [
                r["label"],
                r["items"],
                r["span_s"],
                r["rate"],
                r["rate"] / baseline if baseline != "-" else "-",
                per.get("worker", 0.0),
                per.get("postgres", "-"),
                per.get("redis", "-"),
                per.get("emulator", 0.0),
                r["rss"][0] if "rss" in r else "-",
            ]
        )
    print()
    headers = ["run", "items", "span s", "items/s", "/ bare"]
    headers += ["worker|client CPU ms/item", "postgres ms/item", "redis ms/item"]
    headers += ["emulator ms/item", "worker peak RSS MiB"]
    print(table(headers, rows))
    print("(/ bare: items/s over the mean of the bare client runs just before and after)")
    ratio, best, baseline = max(ratios, key=lambda x: x[0])
    verdict = "meets" if ratio >= 0.5 else "MISSES"
    print(
        f"\nbest tokenmill config: {best['label']} at {best['rate']:.0f} items/s = {ratio:.2f} "
        f"of the bare client ({baseline:.0f} items/s around it); {verdict} the 0.5 target"
    )


if __name__ == "__main__":
    main()

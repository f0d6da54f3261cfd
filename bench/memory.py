"""Memory: a worker's RSS over a long run, and the peak RSS of exports of a large run.

Two parts (both by default):

  worker   ONE `celery -A app worker` against an emulator that answers at once (`--step-ms
           0`, 16-token outputs), N short pre-tokenized items (100,000 by default) published
           to Redis; the RSS of the worker's process tree (VmRSS of the main process and its
           children) is sampled every second against the ledger's done count. Prints start
           (after the first ~5,000 items), end, max, the growth per 10,000 items, and a few
           points between. `--tracemalloc` runs the worker with Python's tracemalloc and
           prints the allocation sites that grew most between the start and the end.
  export   a done run built directly in the ledger (bulk insert of items with prompt and
           output ids of a few hundred tokens each), exported with `tokenmill export RUN
           --format F --out FILE` in a subprocess per format (specforge, conversations, and
           parquet when the build has it); each export's peak RSS from wait4(), next to the
           same export of a 10x smaller run, to show memory does not grow with the run.

    python bench/memory.py                                  # both parts, ~5 minutes
    python bench/memory.py --part worker --items 20000
    python bench/memory.py --part export --export-items 10000,100000
    python bench/memory.py --part worker --tracemalloc      # where a growing worker grows
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    REDIS_URL,
    ROOT,
    bench_database,
    emulator,
    engine_for,
    fixture_tokenizer_dir,
    flush_redis,
    machine_note,
    service_env,
    start_worker,
    stop_process,
    table,
)

# run inside the worker with --tracemalloc: a thread takes the first snapshot when the file
# OUT.start appears and the second when OUT.stop appears, then writes the top growth between
# them to OUT (files, not signals: Celery's worker owns SIGUSR1 and SIGUSR2)
TRACEMALLOC_HOOK = """
import os, threading, time, tracemalloc

def _watch(out):
    while not os.path.exists(out + ".start"):
        time.sleep(0.2)
    first = tracemalloc.take_snapshot()
    while not os.path.exists(out + ".stop"):
        time.sleep(0.2)
    second = tracemalloc.take_snapshot()
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    a, b = first.filter_traces(ignore), second.filter_traces(ignore)
    with open(out + ".tmp", "w") as f:
        for key in ("lineno", "traceback"):
            f.write(f"--- top growth by {key}\\n")
            for stat in b.compare_to(a, key)[:12]:
                f.write(f"{stat.size_diff / 1024:+.0f} KiB {stat.count_diff:+d} blocks: {stat}\\n")
                if key == "traceback":
                    f.write("    " + "\\n    ".join(stat.traceback.format()[-8:]) + "\\n")
    os.replace(out + ".tmp", out)

if os.environ.get("TM_BENCH_TRACE_OUT"):
    tracemalloc.start(int(os.environ.get("TM_BENCH_TRACE_FRAMES", "8")))
    threading.Thread(target=_watch, args=(os.environ["TM_BENCH_TRACE_OUT"],), daemon=True).start()
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=("worker", "export", "both"), default="both")
    p.add_argument("--items", type=int, default=100_000, help="worker part: items to run")
    p.add_argument("--prompt-tokens", type=int, default=32, help="worker part: prompt length")
    p.add_argument("--start-at", type=int, default=5_000, help="worker part: the 'start' RSS")
    p.add_argument("--tracemalloc", action="store_true", help="worker part: trace allocations")
    p.add_argument("--export-items", default="10000,100000", help="export part: run sizes")
    p.add_argument("--export-tokens", type=int, default=300, help="export part: prompt/output")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


# --- RSS of a process tree -------------------------------------------------------------


def vm_rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def tree_rss_mb(pid: int) -> float:
    """VmRSS of pid and all its descendants, in MB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += vm_rss_kb(p)
        todo += children(p)
    return total / 1024


# --- worker part ---------------------------------------------------------------------------


def done_count(db: Any, run_id: int) -> int:
    from sqlalchemy import func, select

    from app.ledger import common

    t = common.items
    with db.connect() as conn:
        stmt = select(func.count()).where(t.c.run_id == run_id, t.c.status == "done")
        return int(conn.execute(stmt).scalar_one())


def build_id_run(db: Any, run: str, items: int, tokens: int, seed: int) -> int:
    """A run of `items` pre-tokenized prompts inserted straight into the ledger; its id."""
    from app.core.contracts import SamplingParams
    from app.ledger import run_queries

    rng = random.Random(seed)
    spec = run_queries.RunSpec(
        name=run,
        tokenizer_path=str(fixture_tokenizer_dir()),
        tokenizer_hash="bench",
        chat_template_hash="bench",
        chat_template_kwargs={},
        sampling=SamplingParams(max_new_tokens=64, seed=seed),
        samples_per_prompt=1,
        think_end_id=None,
        eos_token_ids=[163586],
    )
    with db.begin() as conn:
        run_info, _ = run_queries.get_or_create_run(conn, spec)
    insert_random_items(db, run_info.id, items, tokens, rng, chat=False)
    return int(run_info.id)


def insert_random_items(
    db: Any, run_id: int, items: int, tokens: int, rng: random.Random, *, chat: bool
) -> None:
    """`items` prompts of about `tokens` random ids each, inserted 5,000 at a time; with chat,
    a short user message and a line number each (what an export writes out)."""
    from app.ledger import queue

    chunk: list[Any] = []
    for i in range(items):
        n = max(8, int(tokens * rng.uniform(0.75, 1.25)))
        ids = [rng.randrange(300, 1500) for _ in range(n)]
        if chat:
            messages = [{"role": "user", "content": f"question {i}: " + "word " * 40}]
            chunk.append(queue.NewItem(f"x{i:07d}", 0, i + 1, messages, ids))
        else:
            chunk.append(queue.NewItem(f"m{i:07d}", 0, None, None, ids))
        if len(chunk) == 5000 or i == items - 1:
            with db.begin() as conn:
                queue.insert_items(conn, run_id, chunk)
            chunk = []


def publish_all(db: Any, run_id: int, batch: int) -> None:
    from app.ledger import queue
    from workers.intake.publish import publish_items

    after = 0
    while True:
        with db.connect() as conn:
            ids = queue.pending_ids(conn, run_id, after_id=after)
        if not ids:
            return
        publish_items(ids, batch_size=batch)
        with db.begin() as conn:
            queue.mark_queued(conn, ids)
        after = ids[-1]


def worker_part(args: argparse.Namespace, tmp: Path) -> None:
    print(f"\n== worker RSS over {args.items:,} items ==", flush=True)
    with bench_database() as pg_url:
        flush_redis()
        # this process publishes: its Celery app reads the broker from the environment
        os.environ.update(service_env(pg_url, REDIS_URL, tmp))
        db = engine_for(pg_url)
        t0 = time.perf_counter()
        run_id = build_id_run(db, "memory", args.items, args.prompt_tokens, args.seed)
        print(f"run built in {time.perf_counter() - t0:.1f} s", flush=True)
        emu_args = ["--step-ms", "0", "--median-tokens", "16", "--sigma", "0"]
        emu_args += ["--max-running", "256", "--log-level", "warning"]
        with emulator(emu_args) as emu:
            settings = {"TOKENMILL_SGLANG_URL": emu.url}
            env = service_env(pg_url, REDIS_URL, tmp, **settings)
            trace_out = tmp / "tracemalloc.txt"
            if args.tracemalloc:
                hook = tmp / "hook"
                hook.mkdir(exist_ok=True)
                (hook / "sitecustomize.py").write_text(TRACEMALLOC_HOOK)
                env["PYTHONPATH"] = os.pathsep.join([str(hook), str(ROOT)])
                env["TM_BENCH_TRACE_OUT"] = str(trace_out)
            publish_all(db, run_id, 32)
            worker = start_worker(env, "memory", tmp / "worker.log")
            samples: list[tuple[float, int, float]] = []  # (time, done, rss MB)
            snapped = False
            t_start = time.monotonic()
            try:
                while True:
                    done = done_count(db, run_id)
                    samples.append((time.monotonic() - t_start, done, tree_rss_mb(worker.pid)))
                    if args.tracemalloc and not snapped and done >= args.start_at:
                        Path(f"{trace_out}.start").touch()  # the first snapshot
                        snapped = True
                    if done >= args.items:
                        break
                    if worker.poll() is not None:
                        raise RuntimeError(f"the worker exited; see {tmp / 'worker.log'}")
                    if time.monotonic() - t_start > args.timeout:
                        raise TimeoutError(f"{done} of {args.items} done")
                    time.sleep(1.0)
                time.sleep(2.0)  # let the last group commits and acks settle
                samples.append((time.monotonic() - t_start, args.items, tree_rss_mb(worker.pid)))
                if args.tracemalloc:
                    Path(f"{trace_out}.stop").touch()  # second snapshot, comparison written
                    deadline = time.monotonic() + 120
                    while not trace_out.exists() and time.monotonic() < deadline:
                        time.sleep(0.5)
            finally:
                stop_process(worker)
        db.dispose()
    report_worker(args, samples)
    if args.tracemalloc:
        print(trace_out.read_text() if trace_out.exists() else "(no tracemalloc output)")


def report_worker(args: argparse.Namespace, samples: list[tuple[float, int, float]]) -> None:
    after = [s for s in samples if s[1] >= args.start_at]
    if len(after) < 2:
        print("too few samples after the start point")
        return
    start, end = after[0], after[-1]
    peak = max(s[2] for s in samples)
    marks = sorted({args.start_at, *(int(args.items * f) for f in (0.1, 0.25, 0.5, 0.75))})
    rows = []
    for mark in marks:
        s = next((x for x in samples if x[1] >= mark), None)
        if s is not None:
            rows.append([f"≥ {mark:,} done", s[0], s[1], s[2]])
    rows.append(["end", end[0], end[1], end[2]])
    print(table(["point", "t s", "items done", "worker tree RSS MB"], rows))
    # least squares over every sample after the start: less noisy than end - start
    xs = [s[1] for s in after]
    ys = [s[2] for s in after]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    growth = (end[2] - start[2]) / max(1, end[1] - start[1]) * 10_000
    rate = (end[1] - start[1]) / max(1e-9, end[0] - start[0])
    print(
        f"RSS start {start[2]:.1f} MB (at {start[1]:,} done), end {end[2]:.1f} MB "
        f"(at {end[1]:,}), max {peak:.1f} MB; growth {growth:+.2f} MB per 10,000 items "
        f"(end - start), {slope * 10_000:+.2f} MB per 10,000 (least squares over "
        f"{len(after)} samples); {rate:.0f} items/s"
    )


# --- export part ---------------------------------------------------------------------------


def build_done_run(db: Any, run: str, items: int, tokens: int, seed: int) -> None:
    """A run of `items` done samples: prompt and output ids of about `tokens` each and a short
    chat, inserted in bulk and then marked done in one UPDATE."""
    from sqlalchemy import text

    from app.core.contracts import SamplingParams
    from app.ledger import queue, run_queries
    from app.prompts.tokenization import load_tokenizer

    tok = load_tokenizer(fixture_tokenizer_dir())
    spec = run_queries.RunSpec(
        name=run,
        tokenizer_path=str(tok.path),
        tokenizer_hash=tok.tokenizer_hash,
        chat_template_hash=tok.chat_template_hash,
        chat_template_kwargs={},
        sampling=SamplingParams(seed=seed),
        samples_per_prompt=1,
        think_end_id=tok.think_end_id,
        eos_token_ids=list(tok.eos_token_ids),
    )
    rng = random.Random(seed)
    with db.begin() as conn:
        run_info, _ = run_queries.get_or_create_run(conn, spec)
    insert_random_items(db, run_info.id, items, tokens, rng, chat=True)
    with db.begin() as conn:
        # the output: the prompt's ids reversed is as good as any (a few hundred tokens)
        conn.execute(
            text(
                "UPDATE items SET status = 'done', output_ids = prompt_ids, "
                "completion_tokens = prompt_tokens, finish_reason = 'length', attempts = 1, "
                "server = 'bench', started_at = now(), finished_at = now() WHERE run_id = :r"
            ),
            {"r": run_info.id},
        )
        queue.refresh_statistics(conn)


def export_formats() -> list[str]:
    """The JSONL formats, and parquet when this build has the Parquet export
    (app/outputs/parquet_export.py)."""
    import importlib.util

    from app.outputs.export import FORMATS

    formats: list[str] = list(FORMATS)
    if (
        "parquet" not in formats
        and importlib.util.find_spec("app.outputs.parquet_export") is not None
    ):
        formats.append("parquet")  # --out is a folder of shards and a manifest
    return formats


def output_mb(out: Path) -> float:
    """Size of an export: the file, or every file under the folder (parquet); then removed."""
    import shutil

    if out.is_dir():
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        shutil.rmtree(out)
    else:
        size = out.stat().st_size
        out.unlink()
    return size / 1e6


def measure_export(env: dict[str, str], run: str, fmt: str, out: Path) -> tuple[float, float]:
    """(peak RSS MB, wall s) of `tokenmill export` in its own process, from wait4()."""
    return measure_command(env, ["export", run, "--format", fmt, "--out", str(out)])


def measure_command(env: dict[str, str], argv: list[str]) -> tuple[float, float]:
    """(peak RSS MB, wall s) of `tokenmill ARGV` in its own process, from wait4()."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops", *argv],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    output = [b""]

    def drain() -> None:
        assert proc.stdout is not None
        output[0] = proc.stdout.read()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"tokenmill {argv} failed:\n{output[0].decode(errors='replace')}")
    return usage.ru_maxrss / 1024, wall


def export_part(args: argparse.Namespace, tmp: Path) -> None:
    sizes = [int(s) for s in args.export_items.split(",")]
    print(f"\n== export peak RSS, runs of {', '.join(f'{s:,}' for s in sizes)} items ==")
    with bench_database() as pg_url:
        db = engine_for(pg_url)
        for size in sizes:
            t0 = time.perf_counter()
            build_done_run(db, f"export-{size}", size, args.export_tokens, args.seed)
            print(f"run of {size:,} done items built in {time.perf_counter() - t0:.1f} s")
        db.dispose()
        env = service_env(pg_url, REDIS_URL, tmp)
        # what the CLI costs before it exports anything: imports, settings, one connection
        base, _ = measure_command(env, ["status", f"export-{sizes[0]}"])
        rows: list[list[Any]] = [["(tokenmill status)", sizes[0], "-", "-", base, ""]]
        for fmt in export_formats():
            peaks = []
            for size in sizes:
                out = tmp / f"export-{size}.{fmt}"
                peak, wall = measure_export(env, f"export-{size}", fmt, out)
                mb = output_mb(out)
                peaks.append(peak)
                rows.append([fmt, size, wall, mb, peak])
                print(f"  {fmt} {size:,}: peak RSS {peak:.1f} MB, {wall:.1f} s", flush=True)
            rows[-1].append(f"{peaks[-1] / peaks[0]:.2f}× the {sizes[0]:,}-item export")
        for row in rows:
            if len(row) == 5:
                row.append("")
    print()
    print(table(["format", "items", "wall s", "file MB", "peak RSS MB", "ratio"], rows))


def main() -> None:
    args = parse_args()
    print(f"memory benchmark — {machine_note()}")
    with tempfile.TemporaryDirectory(prefix="tm-bench-mem-") as tmp:
        if args.part in ("worker", "both"):
            worker_part(args, Path(tmp))
        if args.part in ("export", "both"):
            export_part(args, Path(tmp))


if __name__ == "__main__":
    main()

"""Boundary samples and the servers' prefix caches: how much of the prompt tokens the servers
find cached, against one server with an unbounded cache serving the same items one by one.

40 long multi-turn chats (deterministic: a long system prompt, then 8-16 assistant turns, some
of them tool calls answered by tool turns) go through the real pipeline: `tokenmill enqueue
--turns each` into Postgres and Redis, one `celery -A app worker` per emulator, three emulators
with a bounded prefix cache (`--prefix-cache-tokens`) that report `cached_tokens` as SGLang
does. From the ledger: the prompt tokens each item found cached (sum over items) divided by
what one server with an unbounded radix cache would find serving the items one after another,
each conversation shortest history first (target >= 0.9); and each server's share of the items
(target: every server >= 20%).

The `ungrouped` mode enqueues the same boundary prompts as independent rows (`--turns last`,
one line per boundary), so nothing keeps a conversation on one server or in order: what the
caches find without the grouping.

    python bench/prefix_cache.py
    python bench/prefix_cache.py --modes each --cache-tokens 32000
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    REDIS_URL,
    bench_database,
    emulator,
    emulator_stats,
    engine_for,
    fixture_tokenizer_dir,
    flush_redis,
    machine_note,
    run_tokenmill,
    service_env,
    start_worker,
    stop_process,
    synthetic_text,
    table,
    wait_run_finished,
)
from sqlalchemy import select

from app.core.run_kinds import TurnsMode

SERVERS = ("gpu-a", "gpu-b", "gpu-c")
MODES = ("each", "ungrouped")
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
    for name in ("search", "read_file", "run_tests")
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=40)
    parser.add_argument("--cache-tokens", type=int, default=96_000, help="per emulator")
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--inflight", type=int, default=8, help="TOKENMILL_INFLIGHT")
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--prefill-ms-per-1k", type=float, default=20.0)
    parser.add_argument("--median-tokens", type=float, default=48.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=900.0)
    return parser.parse_args()


# --- the chats ---------------------------------------------------------------------------------


def chat(rng: random.Random, index: int) -> dict[str, Any]:
    """One long conversation: a long system prompt, 8-16 assistant turns (a third of them tool
    calls answered by a tool turn), ending with a user turn."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": synthetic_text(rng, rng.randint(300, 500))},
        {"role": "user", "content": synthetic_text(rng, rng.randint(80, 200))},
    ]
    for turn in range(rng.randint(8, 16)):
        if rng.random() < 0.35:
            call_id = f"call_{index}_{turn}"
            tool = rng.choice(TOOLS)["function"]["name"]
            arguments = json.dumps({"query": synthetic_text(rng, 6)})
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": tool, "arguments": arguments},
                        }
                    ],
                }
            )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": synthetic_text(rng, rng.randint(60, 180)),
                }
            )
        else:
            messages.append(
                {"role": "assistant", "content": synthetic_text(rng, rng.randint(60, 160))}
            )
            messages.append({"role": "user", "content": synthetic_text(rng, rng.randint(20, 80))})
    return {"id": f"chat{index:03d}", "tools": TOOLS, "messages": messages}


def write_chats(folder: Path, count: int, seed: int) -> tuple[Path, Path]:
    """The chats (one line each, for `--turns each`) and the same boundary prompts as one
    independent line each (for the ungrouped mode)."""
    rng = random.Random(seed)
    chats = [chat(rng, i) for i in range(count)]
    grouped = folder / "chats.jsonl"
    grouped.write_text("".join(json.dumps(c) + "\n" for c in chats))
    flat = folder / "boundaries.jsonl"
    with flat.open("w") as out:
        for c in chats:
            messages = c["messages"]
            cuts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            cuts.append(len(messages))
            for turn, cut in enumerate(cuts):
                row = {"id": f"{c['id']}-t{turn:02d}", "tools": c["tools"]}
                out.write(json.dumps(row | {"messages": messages[:cut]}) + "\n")
    return grouped, flat


# --- one round --------------------------------------------------------------------------------


def wait_workers(env: dict[str, str], names: list[str], timeout_s: float = 120) -> None:
    import os

    os.environ.update(env)
    from app.celery_app import celery_app

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        replies = celery_app.control.ping(timeout=1.0) or []
        seen = {name.split("@")[0] for reply in replies for name in reply}
        if all(n in seen for n in names):
            return
    raise TimeoutError(f"workers {names} did not answer a ping in {timeout_s:.0f} s")


def one_round(
    args: argparse.Namespace, pg_url: str, tmp: Path, prompts: Path, run: str, turns: str
) -> tuple[list[Any], dict[str, dict[str, Any]], float]:
    from app.ledger import common, run_queries

    db = engine_for(pg_url)
    flush_redis()
    emulator_flags = [
        "--max-running",
        str(args.max_running),
        "--step-ms",
        str(args.step_ms),
        "--prefill-ms-per-1k-tokens",
        str(args.prefill_ms_per_1k),
        "--median-tokens",
        str(args.median_tokens),
        "--sigma",
        "0.5",
        "--prefix-cache-tokens",
        str(args.cache_tokens),
        "--log-level",
        "WARNING",
    ]
    base = service_env(pg_url, REDIS_URL, tmp)
    with (
        emulator(emulator_flags) as emu_a,
        emulator(emulator_flags) as emu_b,
        emulator(emulator_flags) as emu_c,
    ):
        urls = dict(zip(SERVERS, (emu_a.url, emu_b.url, emu_c.url), strict=True))
        workers = {}
        try:
            for name, url in urls.items():
                env = service_env(
                    pg_url,
                    REDIS_URL,
                    tmp,
                    TOKENMILL_SGLANG_URL=url,
                    TOKENMILL_SERVER_NAME=name,
                    TOKENMILL_INFLIGHT=str(args.inflight),
                )
                workers[name] = start_worker(env, f"{run}-{name}", tmp / f"{run}-{name}.log")
            wait_workers(base, [f"{run}-{n}" for n in SERVERS])
            started = time.monotonic()
            run_tokenmill(
                [
                    "enqueue",
                    str(prompts),
                    "--run",
                    run,
                    "--tokenizer",
                    str(fixture_tokenizer_dir()),
                    "--turns",
                    turns,
                    "--max-new-tokens",
                    str(args.max_new_tokens),
                    "--seed",
                    str(args.seed),
                ],
                base,
            )
            wait_run_finished(
                db,
                run,
                timeout_s=args.timeout,
                alive=lambda: all(w.poll() is None for w in workers.values()),
            )
            elapsed_s = time.monotonic() - started
            stats = {name: emulator_stats(url) for name, url in urls.items()}
        finally:
            for w in workers.values():
                stop_process(w)
    t = common.items
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, run).id
        rows = conn.execute(
            select(
                t.c.id,
                t.c.item_key,
                t.c.turn_index,
                t.c.server,
                t.c.status,
                t.c.prompt_ids,
                t.c.output_ids,
                t.c.cached_tokens,
                t.c.hedge_owner,
            )
            .where(t.c.run_id == run_id)
            .order_by(t.c.id)
        ).all()
    db.dispose()
    return list(rows), stats, elapsed_s


# --- figures ----------------------------------------------------------------------------------


def conversation_of(row: Any, turns: str) -> str:
    whole = TurnsMode(turns).boundary_samples
    return str(row.item_key) if whole else str(row.item_key).rsplit("-t", 1)[0]


def ideal_cached(rows: list[Any], turns: str) -> int:
    """Prompt tokens one server with an unbounded radix cache finds, serving the items one
    after another: conversation by conversation, each shortest history first; every prompt
    cached once prefilled, and with its output once finished (as the emulator does)."""
    from emulator.prefix_cache import RadixCache

    cache = RadixCache(None)
    order: dict[str, list[Any]] = {}
    for row in rows:
        order.setdefault(conversation_of(row, turns), []).append(row)
    total = 0
    for items in order.values():
        for row in sorted(items, key=lambda r: len(r.prompt_ids)):
            prompt = list(row.prompt_ids)
            total += cache.match(prompt)
            cache.insert(prompt)
            cache.insert(prompt + list(row.output_ids or [])[:-1])
    return total


def report(
    args: argparse.Namespace, turns: str, rows: list[Any], stats: Any, elapsed: float
) -> None:
    done = [r for r in rows if r.status == "done"]
    prompt_tokens = sum(len(r.prompt_ids) for r in done)
    cached = sum(int(r.cached_tokens or 0) for r in done)
    ideal = ideal_cached(done, turns)
    per_server: dict[str, int] = {}
    for r in done:
        per_server[str(r.server)] = per_server.get(str(r.server), 0) + 1
    by_conv: dict[str, set[str]] = {}
    for r in done:
        by_conv.setdefault(conversation_of(r, turns), set()).add(str(r.server))
    one_server = sum(1 for servers in by_conv.values() if len(servers) == 1)
    hedged = sum(1 for r in done if r.hedge_owner)
    print(
        f"  {len(done)} of {len(rows)} items done in {elapsed:.1f} s; {prompt_tokens:,} prompt "
        f"tokens; conversations wholly on one server: {one_server} of {len(by_conv)}; "
        f"items that got a hedge copy: {hedged}"
    )
    print(
        f"  cached prompt tokens: {cached:,} ({cached / prompt_tokens:.3f} of all prompt "
        f"tokens); one server, unbounded cache, one by one: {ideal:,} "
        f"({ideal / prompt_tokens:.3f}); ratio {cached / ideal:.3f} (target >= 0.9)"
    )
    server_rows = []
    for name in SERVERS:
        s = stats[name]
        server_rows.append(
            [
                name,
                per_server.get(name, 0),
                f"{per_server.get(name, 0) / max(1, len(done)):.1%}",
                f"{s['cached_tokens']:,}",
                f"{s['prefill_tokens']:,}",
            ]
        )
    print(
        table(
            ["server", "items", "share (>= 20%)", "cached tokens", "prefilled tokens"],
            server_rows,
        )
    )


def main() -> None:
    args = parse_args()
    print(f"prefix cache benchmark — {machine_note()}")
    print(
        f"{args.chats} chats; 3 emulators: {args.max_running} slots, step {args.step_ms} ms, "
        f"prefill {args.prefill_ms_per_1k} ms per 1k tokens, median {args.median_tokens:.0f} "
        f"tokens, prefix cache {args.cache_tokens:,} tokens each; TOKENMILL_INFLIGHT "
        f"{args.inflight}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="tm-bench-pc-") as tmp, bench_database() as pg_url:
        grouped, flat = write_chats(Path(tmp), args.chats, args.seed)
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            turns, prompts = ("each", grouped) if mode == "each" else ("last", flat)
            rows, stats, elapsed = one_round(args, pg_url, Path(tmp), prompts, f"pc-{mode}", turns)
            print(f"\n{mode} (--turns {turns}):")
            report(args, turns, rows, stats, elapsed)
    flush_redis()


if __name__ == "__main__":
    main()

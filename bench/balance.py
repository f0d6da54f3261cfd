"""Two servers, one twice as fast as the other, one shared queue: does each get its share,
and do both finish together (no stragglers)?

Two emulators with the same batch slots and the same seed-deterministic output lengths, one
with a decode step twice as long as the other's; one `celery -A app worker` bound to each
(TOKENMILL_SGLANG_URL, TOKENMILL_SERVER_NAME); both consume the same Redis queue. Once both
answer a ping, `tokenmill enqueue` publishes N chat prompts. From the ledger: items completed
per server and their ratio (target about the speed ratio), each server's last finish, the gap
between them and the median item time (target: gap at most one median item time). A sampler
polls the ledger's leased items per server, to show what the slow server still held when the
fast one ran dry; another polls each emulator's running requests, which gives the moment each
server last worked on the run (a hedge that lost is aborted, so it ends then too). Hedging
(on by default): items won by a second copy, copies aborted, and the tokens generated beyond
the ones kept (what hedging costs in GPU time, spent while a server would otherwise idle).

    python bench/balance.py                        # 2,000 prompts, step 2 ms vs 4 ms
    python bench/balance.py --prompts 1000 --sigma 0.5
    python bench/balance.py --repeat 2
    python bench/balance.py --modes current,no-hedge,claim-then-wait
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    REDIS_URL,
    StatsSampler,
    bench_database,
    emulator,
    emulator_stats,
    engine_for,
    enqueue_cli,
    flush_redis,
    machine_note,
    service_env,
    start_worker,
    stop_process,
    table,
    wait_run_finished,
    write_chat_prompts,
)
from sqlalchemy import func, select

SERVERS = ("fast", "slow")
MODES = ("current", "no-hedge", "claim-then-wait")
# extra worker settings of each mode
MODE_ENV = {
    "current": {},
    "no-hedge": {"TOKENMILL_HEDGE": "false"},
    # the handler before the hoarding fix, with the fixed backlog of that time, no hedging
    "claim-then-wait": {"TOKENMILL_BACKLOG_S": "0", "TOKENMILL_HEDGE": "false"},
}

# `claim-then-wait` (for comparison, in the same run): the workers' message handler as it was
# before this benchmark (claim every id of the message, then wait with them for room), put in
# place by a sitecustomize on the workers' PYTHONPATH, with the fixed backlog of that time
# (TOKENMILL_BACKLOG_S=0); nothing in the project changes
CLAIM_THEN_WAIT = """
import celery.signals

def _claim_then_wait(rt, item_ids, *, requeue):
    from app.ledger import claims, outcomes
    ids = [int(i) for i in item_ids]
    with rt.db.begin() as conn:
        claimed = claims.claim_items(
            conn, ids, owner=rt.owner, server=rt.server_name, lease_s=rt.settings.lease_s
        )
    if claimed and not rt.window.wait_for_room(len(claimed)):
        # given back without spending an attempt
        with rt.db.begin() as conn:
            released = outcomes.record_outcomes(
                conn,
                [outcomes.Released(c.id, "stopping") for c in claimed],
                owner=rt.owner,
                lease_s=rt.settings.lease_s,
            )
        requeue(released, 0.0)
        return {"claimed": 0}
    rt.window.submit(claimed)
    return {"claimed": len(claimed)}

@celery.signals.worker_init.connect
def _patch(**_):
    import workers.tasks
    workers.tasks.handle_message = _claim_then_wait
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--fast-step-ms", type=float, default=2.0)
    p.add_argument("--slow-step-ms", type=float, default=4.0)
    p.add_argument("--max-running", type=int, default=32, help="batch slots of each emulator")
    p.add_argument("--inflight", type=int, default=None, help="TOKENMILL_INFLIGHT (slots)")
    p.add_argument("--batch-size", type=int, default=None, help="TOKENMILL_BATCH_SIZE")
    p.add_argument("--median-tokens", type=float, default=128.0)
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of lengths")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--words", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument(
        "--modes",
        default="current,no-hedge",
        help="what to compare, each round: current (the project as it is), no-hedge (the same "
        "with TOKENMILL_HEDGE=false), claim-then-wait (the message handler before the hoarding "
        "fix, patched in, no hedging)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra worker setting, e.g. TOKENMILL_ROOM_WAIT_S=0.25 (repeatable)",
    )
    p.add_argument("--timeout", type=float, default=900.0)
    return p.parse_args()


def emulator_args(args: argparse.Namespace, step_ms: float) -> list[str]:
    return [
        "--max-running",
        str(args.max_running),
        "--step-ms",
        str(step_ms),
        "--median-tokens",
        str(args.median_tokens),
        "--sigma",
        str(args.sigma),
        "--log-level",
        "WARNING",
    ]


def wait_workers(env: dict[str, str], names: list[str], timeout_s: float = 120) -> None:
    """Ping until every named worker answers (so neither gets a head start)."""
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


class LeaseSampler:
    """Polls leased items per server every interval_s: [(time, {server: leased})]."""

    def __init__(self, db: Any, run: str, interval_s: float = 0.25) -> None:
        self.db, self.run, self.interval_s = db, run, interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.running: dict[str, StatsSampler] = {}  # each server's emulator, sampled
        self.emulator_stats: dict[str, dict[str, Any]] = {}  # at the end of the round
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        from app.ledger import common, run_queries

        t = common.items
        run_id = None
        while not self._stop.is_set():
            try:
                with self.db.connect() as conn:
                    if run_id is None:
                        run_id = run_queries.get_run(conn, self.run).id
                    rows = conn.execute(
                        select(t.c.server, func.count())
                        .where(t.c.run_id == run_id, t.c.status == "leased")
                        .group_by(t.c.server)
                    ).all()
                self.samples.append((time.time(), {str(r[0]): int(r[1]) for r in rows}))
            except Exception:  # the run may not exist yet
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> LeaseSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def unsent_after(self, server: str, when: float) -> int:
        """Most items `server` held leased but not running on its emulator at any sample
        after `when`: claimed items waiting in the worker while the other server sat idle."""
        stats = self.running[server].samples
        worst = 0
        for ts, held in self.samples:
            if ts < when:
                continue
            before = [s for s in stats if s[0] <= ts]
            running = before[-1][1] if before else 0
            worst = max(worst, held.get(server, 0) - running)
        return worst

    def last_busy(self, server: str) -> float | None:
        """The last sample at which `server`'s emulator was running a request."""
        busy = [s[0] for s in self.running[server].samples if s[1] > 0]
        return busy[-1] if busy else None

    def held_at(self, when: float) -> dict[str, int]:
        before = [s for s in self.samples if s[0] <= when]
        return before[-1][1] if before else {}


def one_round(
    args: argparse.Namespace, pg_url: str, tmp: Path, prompts: Path, run: str, mode: str
) -> Any:
    from app.ledger import common, run_queries

    db = engine_for(pg_url)
    flush_redis()
    steps = {"fast": args.fast_step_ms, "slow": args.slow_step_ms}
    with (
        emulator(emulator_args(args, steps["fast"])) as fast,
        emulator(emulator_args(args, steps["slow"])) as slow,
    ):
        workers = {}
        # the enqueue publishes messages of TOKENMILL_BATCH_SIZE ids too
        size = {"TOKENMILL_BATCH_SIZE": str(args.batch_size)} if args.batch_size else {}
        base = service_env(pg_url, REDIS_URL, tmp, **size)
        try:
            for name, emu in (("fast", fast), ("slow", slow)):
                settings = {"TOKENMILL_SGLANG_URL": emu.url, "TOKENMILL_SERVER_NAME": name}
                settings["TOKENMILL_INFLIGHT"] = str(args.inflight or args.max_running)
                settings.update(kv.split("=", 1) for kv in args.env)
                if args.batch_size:
                    settings["TOKENMILL_BATCH_SIZE"] = str(args.batch_size)
                env = service_env(pg_url, REDIS_URL, tmp, **settings)
                if mode == "claim-then-wait":
                    site = tmp / "claim-then-wait"
                    site.mkdir(exist_ok=True)
                    (site / "sitecustomize.py").write_text(CLAIM_THEN_WAIT)
                    env["PYTHONPATH"] = str(site)
                env.update(MODE_ENV[mode])
                workers[name] = start_worker(env, f"{run}-{name}", tmp / f"{run}-{name}.log")
            wait_workers(base, [f"{run}-{n}" for n in SERVERS])
            with (
                LeaseSampler(db, run) as sampler,
                StatsSampler(fast.url) as fast_stats,
                StatsSampler(slow.url) as slow_stats,
            ):
                sampler.running = {"fast": fast_stats, "slow": slow_stats}
                enqueue_cli(args, base, prompts, run)
                counts = wait_run_finished(
                    db,
                    run,
                    timeout_s=args.timeout,
                    alive=lambda: all(w.poll() is None for w in workers.values()),
                )
                time.sleep(1.0)  # copies that lost are aborted within a hedge interval
            sampler.emulator_stats = {
                "fast": emulator_stats(fast.url),
                "slow": emulator_stats(slow.url),
            }
        finally:
            for w in workers.values():
                stop_process(w)
    t = common.items
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, run).id
        rows = conn.execute(
            select(
                t.c.server,
                t.c.started_at,
                t.c.finished_at,
                t.c.latency_s,
                t.c.hedge_owner,
                t.c.completion_tokens,
            ).where(t.c.run_id == run_id, t.c.status == "done")
        ).all()
    db.dispose()
    return counts, rows, sampler


def report(args: argparse.Namespace, counts: Any, rows: Any, sampler: LeaseSampler) -> None:
    """One round's figures: per server, the finishes against each other, the servers' last busy
    moments and what hedging cost."""
    t0 = min(r.started_at for r in rows).timestamp()
    per = _per_server(rows, t0)
    median = statistics.median(r.latency_s for r in rows)
    _print_finishes(args, counts, rows, sampler, per, t0, median)
    _print_busy(sampler, t0, median)
    _print_hedging(rows, sampler)


def _per_server(rows: Any, t0: float) -> dict[str, dict[str, Any]]:
    """Each server's items done, median item time and last finish (from the first claim), and
    their table."""
    per: dict[str, dict[str, Any]] = {}
    for name in SERVERS:
        mine = [r for r in rows if r.server == name]
        per[name] = {
            "items": len(mine),
            "last": max(r.finished_at.timestamp() for r in mine) - t0 if mine else 0.0,
            "median": statistics.median(r.latency_s for r in mine) if mine else 0.0,
        }
    table_rows = [[n, per[n]["items"], per[n]["median"], per[n]["last"]] for n in SERVERS]
    print(
        table(
            ["server", "items done", "median item s", "last finish s (from first claim)"],
            table_rows,
        )
    )
    return per


def _print_finishes(
    args: argparse.Namespace,
    counts: Any,
    rows: Any,
    sampler: LeaseSampler,
    per: dict[str, dict[str, Any]],
    t0: float,
    median: float,
) -> None:
    """How far apart the servers finished, and what the later one still held."""
    ratio = per["fast"]["items"] / max(1, per["slow"]["items"])
    gap = abs(per["fast"]["last"] - per["slow"]["last"])
    later = max(SERVERS, key=lambda n: per[n]["last"])
    earlier = min(SERVERS, key=lambda n: per[n]["last"])
    held = sampler.held_at(t0 + per[earlier]["last"])
    last_item = max((r for r in rows if r.server == later), key=lambda r: r.finished_at)
    unsent = sampler.unsent_after(later, t0 + per[earlier]["last"])
    print(
        f"after {earlier} finished its last item, {later} held at most {unsent} claimed items "
        f"not yet running on its server (waiting in the worker); {later}'s last item took "
        f"{last_item.latency_s:.2f} s on its own"
    )
    last_claim = max(r.started_at.timestamp() for r in rows)
    held_dry = sampler.held_at(last_claim)
    print(
        f"the last item was claimed at {last_claim - t0:.2f} s; then the servers held "
        + ", ".join(f"{n} {held_dry.get(n, 0)}" for n in SERVERS)
        + " leased items (in flight or waiting in the worker)"
    )
    print(
        f"fast/slow items {ratio:.2f} (speed ratio {args.slow_step_ms / args.fast_step_ms:.1f}); "
        f"last finishes {gap:.2f} s apart ({later} later); median item time {median:.2f} s "
        f"(all items): gap = {gap / median:.2f} median item times "
        f"({'meets' if gap <= median else 'MISSES'} the 'within one median item' target); "
        f"when {earlier} finished its last item, {later} still held "
        f"{held.get(later, 0)} leased items; done {counts.done}, failed {counts.failed}"
    )


def _print_busy(sampler: LeaseSampler, t0: float, median: float) -> None:
    """The last moment each server ran a request, as its emulator's samples saw it."""
    busy = {n: sampler.last_busy(n) for n in SERVERS}
    if all(b is not None for b in busy.values()):
        last = {n: float(busy[n] or 0.0) - t0 for n in SERVERS}
        busy_gap = abs(last["fast"] - last["slow"])
        print(
            "last moment each server ran a request (emulator samples, 0.1 s): "
            + ", ".join(f"{n} {last[n]:.2f} s" for n in SERVERS)
            + f"; {busy_gap:.2f} s apart = {busy_gap / median:.2f} median item times"
        )


def _print_hedging(rows: Any, sampler: LeaseSampler) -> None:
    """Items hedged and won by their copy, requests aborted, tokens spent on copies that lost."""
    hedged = [r for r in rows if r.hedge_owner is not None]
    # the owner id names the worker's server: host:pid:server:random
    won = [r for r in hedged if f":{r.server}:" in r.hedge_owner]
    kept = sum(r.completion_tokens or 0 for r in rows)
    made = sum(int(s.get("generated_tokens", 0)) for s in sampler.emulator_stats.values())
    aborted = {n: int(s.get("aborted", 0)) for n, s in sampler.emulator_stats.items()}
    print(
        f"hedging: {len(hedged)} items got a second copy, {len(won)} were won by it; "
        f"requests aborted on the emulators: "
        + ", ".join(f"{n} {aborted.get(n, 0)}" for n in SERVERS)
        + f"; tokens generated {made:,}, kept {kept:,} "
        f"(+{(made - kept) / max(1, kept):.1%} spent on copies that lost)"
    )


def main() -> None:
    args = parse_args()
    print(f"balance benchmark — {machine_note()}")
    print(
        f"{args.prompts} prompts; emulators: {args.max_running} slots, step "
        f"{args.fast_step_ms} ms (fast) and {args.slow_step_ms} ms (slow), median "
        f"{args.median_tokens:.0f} tokens, sigma {args.sigma}; TOKENMILL_INFLIGHT "
        f"{args.inflight or args.max_running}, batch size {args.batch_size or 'default'}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="tm-bench-bal-") as tmp, bench_database() as pg_url:
        prompts = write_chat_prompts(
            Path(tmp) / "prompts.jsonl", args.prompts, words=args.words, seed=args.seed
        )
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        for i in range(args.repeat):
            for mode in modes:
                run = f"balance-{i}-{mode}"
                counts, rows, sampler = one_round(args, pg_url, Path(tmp), prompts, run, mode)
                print(f"\nround {i + 1}, {mode}:")
                report(args, counts, rows, sampler)
    flush_redis()


if __name__ == "__main__":
    main()

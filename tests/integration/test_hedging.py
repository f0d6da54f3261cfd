"""Hedging the end of a run: the ledger queries on SQLite and Postgres, then real emulators (a
slow and a fast one) driven by two in-process worker runtimes against Postgres.

Every wait is bounded and every assertion is on ledger rows, window stats or emulator counters.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
from sqlalchemy import Connection, Engine, select, update

from app.core.constants import EVENT_FINGERPRINT_MISMATCH
from app.core.contracts import GenerateResult, SamplingParams
from app.core.settings import Settings
from app.ledger import claims, common, outcomes, reads, run_queries
from app.ledger import queue as ledger_queue
from emulator.config import KIMI_IM_END_ID, EmulatorConfig
from emulator.model import generate_output
from tests.support import runs as support_runs
from tests.support.emulator import EmulatorProcess, running_emulator
from tests.support.procs import wait_for
from workers.engine.generate import handle_message
from workers.engine.runtime import WorkerRuntime

EOS = KIMI_IM_END_ID
SAMPLING = SamplingParams(max_new_tokens=64, seed=1)
# fixed lengths (sigma 0): every output is 30 tokens and EOS, so an item on the slow emulator
# takes 31 steps (3.1 s), on the fast one a tenth of that
SLOW = EmulatorConfig(port=0, step_ms=100, max_running=16, median_tokens=30, sigma=0)
FAST = dataclasses.replace(SLOW, step_ms=10)
OUTPUT_TOKENS = 31


# --- ledger helpers ---------------------------------------------------------------------------


def make_run(conn: Connection, name: str) -> run_queries.RunInfo:
    return support_runs.make_run(conn, name, max_new_tokens=SAMPLING.max_new_tokens)


def add_items(
    conn: Connection, run: run_queries.RunInfo, n: int, *, queue: bool = True
) -> list[int]:
    """n single-sample items of run, queued (as a producer leaves them) unless queue=False."""
    new = [
        ledger_queue.NewItem(f"{run.name}-{i}", 0, i + 1, None, [1, 2, 3, 100 + i])
        for i in range(n)
    ]
    assert ledger_queue.insert_items(conn, run.id, new) == n
    ids = ledger_queue.pending_ids(conn, run.id)
    if queue:
        assert ledger_queue.mark_queued(conn, ids) == n
    return ids


def lease(conn: Connection, ids: list[int], server: str) -> None:
    claimed = claims.claim_items(conn, ids, owner=f"{server}-worker", server=server, lease_s=600)
    assert [c.id for c in claimed] == sorted(ids)


def result(ids: list[int], finish: str = "stop") -> GenerateResult:
    return GenerateResult("rid", ids, finish, ids[-1], 4, len(ids), 0, 0.5)  # type: ignore[arg-type]


def row(conn: Connection, item_id: int) -> Any:
    return conn.execute(select(common.items).where(common.items.c.id == item_id)).one()


# --- the ledger on SQLite and Postgres ----------------------------------------------------------


def test_hedge_candidates_are_live_unhedged_leases_elsewhere_in_runs_at_their_end(
    db: Engine,
) -> None:
    with db.begin() as conn:
        end, busy, fresh = (make_run(conn, n) for n in ("end", "busy", "fresh"))
        e = add_items(conn, end, 6)
        b = add_items(conn, busy, 2)
        f = add_items(conn, fresh, 2, queue=False)
        lease(conn, [e[0], e[1], e[3], e[4], e[5]], "a")
        lease(conn, [e[2]], "b")  # already on the hedging server
        outcomes.record_outcomes(
            conn, [outcomes.Done(e[5], result([7, EOS]))], owner="a-worker", lease_s=60
        )
        past = common.utcnow() - timedelta(seconds=1)
        conn.execute(
            update(common.items).where(common.items.c.id == e[3]).values(lease_expires_at=past)
        )
        assert [c.id for c in claims.mark_hedged(conn, [e[4]], owner="h0")] == [e[4]]
        # started_at, not id, sets the order: the longest-running item comes first
        now = common.utcnow()
        for item_id, age_s in ((e[0], 10), (e[1], 60)):
            started = now - timedelta(seconds=age_s)
            conn.execute(
                update(common.items).where(common.items.c.id == item_id).values(started_at=started)
            )
        lease(conn, [b[0]], "a")  # b[1] is still queued
        lease(conn, [f[0]], "a")  # f[1] is still pending
    with db.connect() as conn:
        assert claims.hedge_candidates(conn, server="b", limit=10) == [
            (e[1], end.id),
            (e[0], end.id),
        ]
        assert claims.hedge_candidates(conn, server="b", limit=1) == [(e[1], end.id)]
        assert claims.hedge_candidates(conn, server="b", limit=0) == []
        assert claims.hedge_candidates(conn, server="a", limit=10) == [(e[2], end.id)]
    with db.begin() as conn:
        lease(conn, [b[1]], "a")  # busy has nothing left to claim now
    with db.connect() as conn:
        assert claims.hedge_candidates(conn, server="b", limit=10) == [
            (e[1], end.id),
            (e[0], end.id),
            (b[0], busy.id),
            (b[1], busy.id),
        ]


def test_mark_hedged_marks_once_and_skips_items_no_longer_leased(db: Engine) -> None:
    with db.begin() as conn:
        run = make_run(conn, "end")
        ids = add_items(conn, run, 5)
        lease(conn, ids, "a")
        outcomes.record_outcomes(
            conn,
            [
                outcomes.Released(ids[3], "server went away"),
                outcomes.Done(ids[4], result([7, EOS])),
            ],
            owner="a-worker",
            lease_s=60,
        )
        hedged = claims.mark_hedged(conn, [ids[2], ids[0]], owner="h1")
        assert [c.id for c in hedged] == [ids[2], ids[0]]  # in the order asked for
        assert hedged[0].prompt_ids == [1, 2, 3, 102] and hedged[0].run_id == run.id
        assert hedged[0].attempts == 0
        # a second hedger racing for the same items gets only the one nobody marked
        again = claims.mark_hedged(conn, [ids[0], ids[1], ids[2], ids[3], ids[4]], owner="h2")
        assert [c.id for c in again] == [ids[1]]
        assert claims.mark_hedged(conn, ids, owner="h3") == []
        assert claims.mark_hedged(conn, [], owner="h3") == []
    with db.connect() as conn:
        owners = [row(conn, i).hedge_owner for i in ids]
        assert claims.hedge_candidates(conn, server="b", limit=10) == []
        # the lease stays with its holder
        assert {row(conn, i).lease_owner for i in ids[:3]} == {"a-worker"}
    assert owners == ["h1", "h2", "h1", None, None]


def test_a_new_claim_clears_the_hedge_mark(db: Engine) -> None:
    with db.begin() as conn:
        run = make_run(conn, "end")
        (item_id,) = add_items(conn, run, 1)
        lease(conn, [item_id], "a")
        assert claims.mark_hedged(conn, [item_id], owner="hb")
        # its holder died: the lease expires and the item goes back to the queue
        past = common.utcnow() - timedelta(seconds=1)
        conn.execute(
            update(common.items).where(common.items.c.id == item_id).values(lease_expires_at=past)
        )
        assert outcomes.requeue_expired(conn, run_id=run.id) == [item_id]
        assert row(conn, item_id).hedge_owner == "hb"  # requeueing alone keeps it
        lease(conn, [item_id], "c")
        claimed = row(conn, item_id)
        assert (claimed.hedge_owner, claimed.server, claimed.status) == (None, "c", "leased")
        # the new lease may be hedged once more
        assert claims.hedge_candidates(conn, server="b", limit=5) == [(item_id, run.id)]
        assert [c.id for c in claims.mark_hedged(conn, [item_id], owner="hb2")] == [item_id]


def test_the_hedgers_result_wins_and_the_holders_later_answer_changes_nothing(
    db: Engine,
) -> None:
    with db.begin() as conn:
        run = make_run(conn, "end")
        hedged_id, plain_id = add_items(conn, run, 2)
        lease(conn, [hedged_id, plain_id], "a")
        assert claims.mark_hedged(conn, [hedged_id], owner="b-worker")
    with db.begin() as conn:
        outcomes.record_outcomes(
            conn,
            [outcomes.Done(hedged_id, result([7, 8, EOS]), server="b")],
            owner="b-worker",
            lease_s=60,
        )
    with db.begin() as conn:
        # the holder's copy answers after all, then is reported aborted, then failed
        assert (
            outcomes.record_outcomes(
                conn,
                [outcomes.Done(hedged_id, result([9] * 5, "length"), server="a")],
                owner="a-worker",
                lease_s=60,
            )
            == []
        )
        released = outcomes.record_outcomes(
            conn,
            [outcomes.Released(hedged_id, "finished on another server")],
            owner="a-worker",
            lease_s=60,
        )
        assert released == []
        outcomes.record_outcomes(
            conn, [outcomes.Failed(hedged_id, "late")], owner="a-worker", lease_s=60
        )
        # a result without a server keeps the claimer's
        outcomes.record_outcomes(
            conn, [outcomes.Done(plain_id, result([5, EOS]))], owner="a-worker", lease_s=60
        )
    with db.connect() as conn:
        hedged, plain = reads.stored_items(conn, [hedged_id, plain_id])
        raw = row(conn, hedged_id)
        counts = reads.run_counts(conn, run)
    assert hedged.status == "done" and hedged.output_ids == [7, 8, EOS]
    assert (hedged.finish_reason, hedged.completion_tokens, hedged.server) == ("stop", 3, "b")
    assert hedged.attempts == 1 and hedged.error is None
    assert (raw.lease_owner, raw.lease_expires_at, raw.hedge_owner) == (None, None, "b-worker")
    assert (plain.server, plain.output_ids) == ("a", [5, EOS])
    assert (counts.done, counts.failed, counts.output_tokens) == (2, 0, 5)


def test_finished_among_names_exactly_the_done_and_failed_items(db: Engine) -> None:
    with db.begin() as conn:
        run = make_run(conn, "mixed")
        pending, queued, leased, done, failed = add_items(conn, run, 5, queue=False)
        ledger_queue.mark_queued(conn, [queued, leased, done, failed])
        lease(conn, [leased, done, failed], "a")
        outcomes.record_outcomes(
            conn,
            [
                outcomes.Done(done, result([7, EOS])),
                outcomes.Failed(failed, "permanent: bad prompt"),
            ],
            owner="a-worker",
            lease_s=60,
        )
    with db.connect() as conn:
        every = [pending, queued, leased, done, failed, failed + 1000]
        assert claims.finished_among(conn, every) == {done, failed}
        assert claims.finished_among(conn, [pending, leased]) == set()
        assert claims.finished_among(conn, []) == set()


# --- two real emulators, two worker runtimes, Postgres -----------------------------------------


def worker_settings(*, hedge: bool = True, inflight: int = 8) -> Settings:
    return Settings(
        inflight=inflight,
        batch_size=8,
        backlog_s=0,
        room_wait_s=5,
        hedge=hedge,
        hedge_interval_s=0.1,
        lease_s=60,
        heartbeat_s=5,
        drain_timeout_s=5,
        unavailable_wait_s=1,
        connect_timeout_s=2,
        info_timeout_s=5,
        generate_timeout_s=30,
    )


@dataclasses.dataclass
class Worker:
    """One in-process worker runtime serving one emulator, and what it gave back to the queue."""

    rt: WorkerRuntime
    emulator: EmulatorProcess
    released: list[int]

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = httpx.get(f"{self.emulator.url}/emulator/stats").json()
        return stats

    def server_idle(self) -> bool:
        stats = self.stats()
        return bool(stats["running"] == 0 and stats["waiting"] == 0)


def make_worker(
    db: Engine,
    emulator: EmulatorProcess,
    name: str,
    settings: Settings,
    *,
    backlog: int | None = None,
) -> Worker:
    released: list[int] = []
    rt = WorkerRuntime(
        settings,
        db=db,
        server_url=emulator.url,
        server_name=name,
        on_released=lambda ids, wait_s: released.extend(ids),
        backlog=backlog,
    )
    return Worker(rt, emulator, released)


def start(stack: contextlib.ExitStack, worker: Worker) -> None:
    worker.rt.start()
    stack.callback(worker.rt.stop)


def hold(db: Engine, holder: Worker, run: run_queries.RunInfo, ids: list[int]) -> None:
    """The holder claims every item and sends them; back once all run on its server."""
    assert holder.rt.pins.run_matches_server(run.id)  # pins the run's fingerprint, as a claim does
    rt = holder.rt
    with db.begin() as conn:
        claimed = claims.claim_items(
            conn, ids, owner=rt.owner, server=rt.server_name, lease_s=rt.settings.lease_s
        )
    assert [c.id for c in claimed] == ids
    rt.window.submit(claimed)
    wait_for(
        f"{len(ids)} requests running on {rt.server_name}",
        lambda: holder.stats()["running"] == len(ids),
        10,
        lambda: str(holder.stats()),
    )


def finished(db: Engine, run: run_queries.RunInfo) -> Callable[[], bool]:
    def check() -> bool:
        with db.connect() as conn:
            return reads.run_counts(conn, run).finished

    return check


def rows(db: Engine, ids: list[int]) -> list[Any]:
    with db.connect() as conn:
        return list(
            conn.execute(
                select(common.items).where(common.items.c.id.in_(ids)).order_by(common.items.c.id)
            )
        )


def settle(*workers: Worker) -> None:
    """Until every window has settled its items and every emulator has stopped working."""
    for worker in workers:
        wait_for(f"{worker.rt.server_name} window idle", worker.rt.window.idle, 10)
        wait_for(f"{worker.rt.server_name} emulator idle", worker.server_idle, 10)


def hedged_run(
    stack: contextlib.ExitStack,
    db: Engine,
    run_name: str,
    n: int,
    holder: tuple[str, EmulatorConfig, Settings],
    hedger: tuple[str, EmulatorConfig, Settings],
) -> tuple[Worker, Worker, run_queries.RunInfo, list[int]]:
    """The holder's worker claims and sends all n items of a new run; once they all run on its
    emulator the hedger's worker starts, idle, with nothing left to claim. Back when the run
    has finished and both windows and emulators have settled."""
    (holder_name, holder_cfg, holder_settings) = holder
    (hedger_name, hedger_cfg, hedger_settings) = hedger
    holder_emu = stack.enter_context(running_emulator(holder_cfg))
    hedger_emu = stack.enter_context(running_emulator(hedger_cfg))
    holding = make_worker(db, holder_emu, holder_name, holder_settings)
    hedging = make_worker(db, hedger_emu, hedger_name, hedger_settings)
    with db.begin() as conn:
        run = make_run(conn, run_name)
        ids = add_items(conn, run, n)
    start(stack, holding)
    hold(db, holding, run, ids)
    start(stack, hedging)
    wait_for("the run finished", finished(db, run), 20)
    settle(holding, hedging)
    return holding, hedging, run, ids


def test_a_fast_server_hedges_the_slow_servers_last_items_and_wins(pg_engine: Engine) -> None:
    with contextlib.ExitStack() as stack:
        slow, fast, run, ids = hedged_run(
            stack,
            pg_engine,
            "hedged",
            6,
            ("slow", SLOW, worker_settings()),
            ("fast", FAST, worker_settings()),
        )
        slow_emu_stats, fast_emu_stats = slow.stats(), fast.stats()
        slow_stats, fast_stats = slow.rt.window.stats, fast.rt.window.stats
        stored = rows(pg_engine, ids)
        with pg_engine.connect() as conn:
            outputs = reads.stored_items(conn, ids)
            counts = reads.run_counts(conn, run)

    assert (counts.done, counts.failed, counts.total) == (6, 0, 6)
    for r in stored:
        assert (r.status, r.server, r.hedge_owner) == ("done", "fast", fast.rt.owner)
        assert (r.attempts, r.lease_owner, r.error) == (1, None, None)
    for item in outputs:
        expected, finish = generate_output(item.prompt_ids, SAMPLING.for_sample(0), FAST)
        assert item.output_ids == expected and finish["type"] == item.finish_reason == "stop"
        assert item.completion_tokens == len(expected) == OUTPUT_TOKENS
    # the slow copies were aborted: none ran to its end (each would have taken 3.1 s)
    assert (slow_emu_stats["requests"], slow_emu_stats["aborted"]) == (6, 6)
    assert slow_emu_stats["completed"] == 0
    assert (fast_emu_stats["requests"], fast_emu_stats["completed"]) == (6, 6)
    assert fast_emu_stats["aborted"] == 0
    # the slow window settled every item without spending an attempt or re-queueing it
    assert (slow_stats.sent, slow_stats.cancelled, slow_stats.done) == (6, 6, 0)
    assert (slow_stats.failed, slow_stats.retried, slow_stats.released) == (0, 0, 0)
    assert slow_stats.hedges == 0 and slow.released == []
    assert slow.rt.window.outstanding == 0
    assert (fast_stats.hedges, fast_stats.hedge_results, fast_stats.cancelled) == (6, 6, 0)
    assert fast_stats.sent == 0 and fast.released == []


def test_with_hedging_off_the_idle_server_leaves_the_slow_items_alone(pg_engine: Engine) -> None:
    slow_cfg = dataclasses.replace(SLOW, step_ms=40)  # 1.2 s an item
    with contextlib.ExitStack() as stack:
        slow, fast, _, ids = hedged_run(
            stack,
            pg_engine,
            "unhedged",
            3,
            ("slow", slow_cfg, worker_settings(hedge=False)),
            ("fast", FAST, worker_settings(hedge=False)),
        )
        slow_emu_stats, fast_emu_stats = slow.stats(), fast.stats()
        stored = rows(pg_engine, ids)

    for r in stored:
        assert (r.status, r.server, r.hedge_owner, r.attempts) == ("done", "slow", None, 1)
    assert (slow_emu_stats["completed"], slow_emu_stats["aborted"]) == (3, 0)
    assert fast_emu_stats["requests"] == 0 and fast.rt.window.stats.hedges == 0


def test_a_server_whose_fingerprint_differs_from_the_runs_does_not_hedge_it(
    pg_engine: Engine,
) -> None:
    slow_cfg = dataclasses.replace(SLOW, step_ms=40)
    other_weights = dataclasses.replace(FAST, weight_version="other")
    with contextlib.ExitStack() as stack:
        _, fast, run, ids = hedged_run(
            stack,
            pg_engine,
            "pinned",
            3,
            ("slow", slow_cfg, worker_settings()),
            ("fast", other_weights, worker_settings()),
        )
        fast_emu_stats = fast.stats()
        stored = rows(pg_engine, ids)
        with pg_engine.connect() as conn:
            refusals = conn.execute(
                select(common.events.c.server).where(
                    common.events.c.kind == EVENT_FINGERPRINT_MISMATCH,
                    common.events.c.run_id == run.id,
                )
            ).all()

    # the fast worker did look at the run's items, and refused the run
    assert [r.server for r in refusals] == ["fast"]
    for r in stored:
        assert (r.status, r.server, r.hedge_owner, r.attempts) == ("done", "slow", None, 1)
    assert fast_emu_stats["requests"] == 0 and fast.rt.window.stats.hedges == 0


def test_a_refused_run_does_not_keep_the_hedger_from_other_runs(pg_engine: Engine) -> None:
    # the fast server may serve run "mine" (pinned to its fingerprint) but not run "theirs";
    # the longest-running leased items are theirs, and the fast window has two slots: they
    # must not fill every hedge search
    other_weights = dataclasses.replace(FAST, weight_version="other")
    with contextlib.ExitStack() as stack:
        slow_emu = stack.enter_context(running_emulator(SLOW))
        fast_emu = stack.enter_context(running_emulator(other_weights))
        slow = make_worker(pg_engine, slow_emu, "slow", worker_settings())
        fast = make_worker(pg_engine, fast_emu, "fast", worker_settings(inflight=2))
        with pg_engine.begin() as conn:
            theirs = make_run(conn, "theirs")
            their_ids = add_items(conn, theirs, 2)
            mine = make_run(conn, "mine")
            my_ids = add_items(conn, mine, 1)
        assert fast.rt.pins.run_matches_server(mine.id)  # pins "mine" to the fast server
        start(stack, slow)
        hold(pg_engine, slow, theirs, their_ids)
        with pg_engine.begin() as conn:  # the slow window runs it without a fingerprint check
            claimed = claims.claim_items(
                conn, my_ids, owner=slow.rt.owner, server="slow", lease_s=60
            )
        slow.rt.window.submit(claimed)
        start(stack, fast)
        wait_for("the run 'mine' finished", finished(pg_engine, mine), 20)
        wait_for("the run 'theirs' finished", finished(pg_engine, theirs), 20)
        settle(slow, fast)

    [my_row] = rows(pg_engine, my_ids)
    assert (my_row.status, my_row.server, my_row.hedge_owner) == ("done", "fast", fast.rt.owner)
    their_rows = rows(pg_engine, their_ids)
    for r in their_rows:
        assert (r.status, r.server, r.hedge_owner) == ("done", "slow", None)
    # hedged while the refused run's items still ran, not only once they were out of the way
    assert my_row.finished_at < min(r.finished_at for r in their_rows)
    assert fast.rt.window.stats.hedges == 1


def test_hedges_give_their_slots_back_when_real_work_arrives(pg_engine: Engine) -> None:
    hedger_cfg = dataclasses.replace(FAST, step_ms=60)  # a copy takes 1.9 s: still running
    with contextlib.ExitStack() as stack:
        slow_emu = stack.enter_context(running_emulator(SLOW))
        fast_emu = stack.enter_context(running_emulator(hedger_cfg))
        # the slow worker does not hedge: it would take the new run's items back
        slow = make_worker(pg_engine, slow_emu, "slow", worker_settings(hedge=False))
        fast = make_worker(pg_engine, fast_emu, "fast", worker_settings(inflight=2), backlog=1)
        with pg_engine.begin() as conn:
            ending = make_run(conn, "ending")
            held = add_items(conn, ending, 2)
        start(stack, slow)
        hold(pg_engine, slow, ending, held)
        start(stack, fast)
        wait_for(
            "both slots of the fast worker hedging",
            lambda: fast.rt.window.stats.hedges == 2 and fast.stats()["running"] == 2,
            10,
            lambda: f"{fast.rt.window.stats} {fast.stats()}",
        )
        with pg_engine.begin() as conn:
            new = make_run(conn, "new")
            fresh = add_items(conn, new, 3)
        requeued: list[int] = []
        outcome = handle_message(fast.rt, fresh, requeue=lambda ids, wait_s: requeued.extend(ids))
        wait_for("the new run finished", finished(pg_engine, new), 30)
        wait_for("the ending run finished", finished(pg_engine, ending), 30)
        settle(slow, fast)
        fast_emu_stats = fast.stats()
        fast_stats = fast.rt.window.stats
        ending_rows, new_rows = rows(pg_engine, held), rows(pg_engine, fresh)

    assert outcome == {
        "claimed": 3,
        "skipped": 0,
        "deferred": 0,
        "ahead": 0,
        "priority": 0,
        "server": "fast",
    }
    assert requeued == []
    # both hedges made room (aborted on the fast server) instead of holding the new items back
    assert (fast_stats.hedges, fast_stats.cancelled, fast_stats.hedge_results) == (2, 2, 0)
    assert (fast_emu_stats["aborted"], fast_emu_stats["completed"]) == (2, 3)
    for r in new_rows:
        assert (r.status, r.server, r.hedge_owner, r.attempts) == ("done", "fast", None, 1)
    # the items stay hedged (no second copy is started) and their holder finishes them
    for r in ending_rows:
        assert (r.status, r.server, r.hedge_owner, r.attempts) == ("done", "slow", fast.rt.owner, 1)


def test_a_hedge_that_loses_is_aborted_on_the_hedgers_server(pg_engine: Engine) -> None:
    holder_cfg = dataclasses.replace(SLOW, step_ms=60)  # 1.9 s an item
    hedger_cfg = dataclasses.replace(SLOW, step_ms=150)  # 4.7 s: its copies cannot win
    with contextlib.ExitStack() as stack:
        holder, hedger, _, ids = hedged_run(
            stack,
            pg_engine,
            "outrun",
            3,
            ("holder", holder_cfg, worker_settings()),
            ("hedger", hedger_cfg, worker_settings()),
        )
        hedger_emu_stats = hedger.stats()
        hedger_stats, holder_stats = hedger.rt.window.stats, holder.rt.window.stats
        stored = rows(pg_engine, ids)

    for r in stored:
        assert (r.status, r.server, r.hedge_owner) == ("done", "holder", hedger.rt.owner)
        assert r.attempts == 1
    # every copy was sent, none answered: each was aborted once the holder's result was written
    assert (hedger_stats.hedges, hedger_stats.cancelled, hedger_stats.hedge_results) == (3, 3, 0)
    assert (hedger_emu_stats["requests"], hedger_emu_stats["aborted"]) == (3, 3)
    assert hedger_emu_stats["completed"] == 0 and hedger.rt.window.outstanding == 0
    assert (holder_stats.done, holder_stats.cancelled, holder_stats.released) == (3, 0, 0)

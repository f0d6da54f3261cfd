"""Hedging in the in-flight window, with an abortable fake SGLang client and a SQLite ledger:
an idle window runs a second copy of items leased to another server and its result wins; a
copy of an item finished elsewhere is aborted on its server and spends nothing; hedges give
their slots back when real work comes and are aborted, not waited for, at shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, select

from app.core.contracts import GenerateResult
from app.core.errors import RetryableError
from app.ledger import claims, common, outcomes, queue, run_queries
from workers.engine.fake_client import UNTIL_ABORTED, FakePolicy, FakeServer
from workers.engine.window import InflightWindow, WindowConfig

BLOCK = UNTIL_ABORTED  # the script's answer for "run until aborted"


class Server(FakeServer):
    """An abortable fake server whose aborts can hang (a wedged server) until released, or be
    lost the first time (an abort that reaches the server before its request)."""

    def __init__(self, script: Callable[[list[int]], float | Exception]) -> None:
        super().__init__(lambda input_ids, call: script(input_ids), abortable=True)
        self.hung = threading.Event()  # set: aborts hang until `release` is set
        self.release = threading.Event()
        self.lose_first_abort = False

    def abort(self, rid: str) -> bool:
        if self.hung.is_set():
            self.release.wait(30.0)
        with self.lock:
            self.aborted.append(rid)
            lost = self.lose_first_abort and self.aborted.count(rid) == 1
        if not lost:
            self.end_of(rid).set()
        return True


@pytest.fixture
def windows() -> Iterator[list[InflightWindow]]:
    started: list[InflightWindow] = []
    yield started
    for window in started:
        window.stop(drain_timeout_s=1)


def hedge_source(db: Engine, owner: str, server: str) -> Callable[[int], list[claims.ClaimedItem]]:
    """What WorkerRuntime.find_hedges does, for a server that may serve every run."""

    def find(limit: int) -> list[claims.ClaimedItem]:
        with db.connect() as conn:
            picked = [i for i, _ in claims.hedge_candidates(conn, server=server, limit=limit)]
        with db.begin() as conn:
            return claims.mark_hedged(conn, picked, owner=owner)

    return find


def make_window(
    db: Engine,
    windows: list[InflightWindow],
    server: Server,
    *,
    name: str = "fast",
    inflight: int = 4,
    hedge: bool = True,
    search: Callable[[Callable[[int], list[claims.ClaimedItem]]], Any] = lambda find: find,
) -> InflightWindow:
    """A started window of server `name` (owner `owner-<name>`); search wraps its hedge source."""
    owner = f"owner-{name}"
    window = InflightWindow(
        WindowConfig(
            server_name=name,
            inflight=inflight,
            lease_s=60,
            heartbeat_s=0.2,
            max_attempts=3,
            retry_backoff_s=0.01,
            retry_backoff_max_s=0.05,
            unavailable_wait_s=0.05,
            backlog=inflight,
            hedge_interval_s=0.02,
            hedge=hedge,
        ),
        db=db,
        owner=owner,
        policy=FakePolicy(
            server,
            hedges=search(hedge_source(db, owner, name)),
            unmark=lambda marked: unmark(db, marked, owner),
        ),
    )
    windows.append(window)
    window.start()
    return window


def add_items(db: Engine, run: run_queries.RunInfo, n: int, start: int = 0) -> list[int]:
    with db.begin() as conn:
        queue.insert_items(
            conn,
            run.id,
            [queue.NewItem(f"k{i}", 0, i, None, [1, i]) for i in range(start, start + n)],
        )
        return queue.pending_ids(conn, run.id)[-n:]


def lease_to(db: Engine, ids: list[int], owner: str, server: str) -> list[claims.ClaimedItem]:
    with db.begin() as conn:
        return claims.claim_items(conn, ids, owner=owner, server=server, lease_s=60)


def rows(db: Engine, ids: list[int]) -> dict[int, Any]:
    t = common.items
    with db.connect() as conn:
        found = conn.execute(select(t).where(t.c.id.in_(ids))).all()
    return {r.id: r for r in found}


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_an_idle_window_hedges_items_running_elsewhere_and_its_result_wins(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    ids = add_items(sqlite_engine, run, 3)
    lease_to(sqlite_engine, ids, "owner-slow", "slow")  # the slow server is still at it
    fast = make_window(sqlite_engine, windows, Server(lambda prompt: 0.01))
    wait_for(lambda: {r.status for r in rows(sqlite_engine, ids).values()} == {"done"}, "hedges")
    got = rows(sqlite_engine, ids)
    assert {(r.server, r.hedge_owner, r.attempts) for r in got.values()} == {
        ("fast", "owner-fast", 1)
    }
    assert [r.output_ids for r in sorted(got.values(), key=lambda r: r.id)] == [
        [300, 163586],
        [301, 163586],
        [302, 163586],
    ]
    wait_for(fast.idle, "the window to settle")
    assert (fast.stats.hedges, fast.stats.hedge_results, fast.stats.done) == (3, 3, 0)

    # the slow server's answer comes later: the first result stays
    late = GenerateResult("late", [7, 7, 7], "length", None, 2, 3, 0, 9.0)
    with sqlite_engine.begin() as conn:
        outcomes.record_outcomes(
            conn, [outcomes.Done(i, late) for i in ids], owner="owner-slow", lease_s=60
        )
    after = rows(sqlite_engine, ids)
    assert {(r.server, tuple(r.output_ids), r.attempts) for r in after.values()} == {
        (got[i].server, tuple(got[i].output_ids), 1) for i in ids
    }


def test_no_hedges_while_the_run_still_has_work_to_claim(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    leased = add_items(sqlite_engine, run, 2)
    lease_to(sqlite_engine, leased, "owner-slow", "slow")
    queued = add_items(sqlite_engine, run, 1, start=2)
    with sqlite_engine.begin() as conn:
        queue.mark_queued(conn, queued)
    server = Server(lambda prompt: 0.01)
    fast = make_window(sqlite_engine, windows, server)
    time.sleep(0.3)  # fifteen hedge rounds
    assert fast.stats.hedges == 0 and server.calls_by_prompt == {}
    assert {r.hedge_owner for r in rows(sqlite_engine, leased).values()} == {None}

    # the last queued item is claimed (by the slow server): now the run is at its end
    lease_to(sqlite_engine, queued, "owner-slow", "slow")
    wait_for(lambda: fast.stats.hedge_results == 3, "hedges once nothing is left to claim")


def test_a_failed_hedge_changes_nothing_and_is_not_repeated(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    ids = add_items(sqlite_engine, run, 1)
    before = rows(sqlite_engine, ids)[ids[0]]
    lease_to(sqlite_engine, ids, "owner-slow", "slow")
    server = Server(lambda prompt: RetryableError("HTTP 500: boom", status_code=500))
    fast = make_window(sqlite_engine, windows, server)
    wait_for(lambda: fast.stats.hedges == 1 and fast.idle(), "the hedge to fail")
    time.sleep(0.2)  # ten more hedge rounds: one copy per lease, not one per round
    row = rows(sqlite_engine, ids)[ids[0]]
    assert (row.status, row.lease_owner, row.server, row.attempts, row.error) == (
        "leased",
        "owner-slow",
        "slow",
        before.attempts,
        None,
    )
    assert server.calls_by_prompt == {0: 1} and fast.stats.hedges == 1


def holding_two(
    db: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> tuple[list[int], Server, InflightWindow]:
    """A window of server "slow" (no hedging) with two items of its own running until aborted."""
    ids = add_items(db, run, 2)
    server = Server(lambda prompt: BLOCK)
    slow = make_window(db, windows, server, name="slow", hedge=False)
    slow.submit(lease_to(db, ids, slow.owner, "slow"))
    wait_for(lambda: len(server.sent) == 2, "both requests to be sent")
    return ids, server, slow


def finish_elsewhere(db: Engine, item_id: int) -> None:
    """Server "fast"'s copy of the item is written first."""
    won = GenerateResult("h", [5, 163586], "stop", 163586, 2, 2, 0, 0.1)
    with db.begin() as conn:
        outcomes.record_outcomes(
            conn, [outcomes.Done(item_id, won, server="fast")], owner="owner-fast", lease_s=60
        )


def test_a_copy_is_aborted_when_its_item_finishes_elsewhere(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    ids, server, slow = holding_two(sqlite_engine, run, windows)
    finish_elsewhere(sqlite_engine, ids[0])
    wait_for(lambda: slow.outstanding == 1, "the copy that lost to settle")
    assert server.aborted == server.sent[0]
    assert server.calls_by_prompt == {0: 1, 1: 1}  # aborted, not retried
    assert slow.stats.cancelled == 1 and slow.stats.retried == 0
    first, second = (rows(sqlite_engine, ids)[i] for i in ids)
    assert (first.status, first.server, first.output_ids, first.attempts) == (
        "done",
        "fast",
        [5, 163586],
        1,
    )
    assert (second.status, second.lease_owner) == ("leased", slow.owner)


def test_a_hanging_abort_does_not_hold_up_the_timer(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    ids, server, slow = holding_two(sqlite_engine, run, windows)
    server.hung.set()  # from now on an abort waits until released

    for item_id in ids:  # finished elsewhere, one after the other
        finish_elsewhere(sqlite_engine, item_id)
        wait_for(
            lambda: slow.stats.cancelled == ids.index(item_id) + 1,  # noqa: B023
            "the timer to notice, while the first abort hangs",
        )
    assert server.aborted == []
    server.release.set()
    wait_for(lambda: slow.outstanding == 0, "both copies to settle once aborts go through")
    assert sorted(server.aborted) == sorted(server.sent[0] + server.sent[1])


def test_hedges_give_their_slots_to_real_work(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    elsewhere = add_items(sqlite_engine, run, 2)
    lease_to(sqlite_engine, elsewhere, "owner-slow", "slow")
    # hedges run until aborted; real items answer at once
    server = Server(lambda prompt: BLOCK if prompt[-1] < 2 else 0.01)
    fast = make_window(sqlite_engine, windows, server, inflight=2)
    wait_for(lambda: len(server.sent) == 2, "two hedges in flight")
    assert fast.room() == 2  # the backlog's room only: both slots hold hedges

    mine = add_items(sqlite_engine, run, 2, start=2)
    admitted = fast.admit(
        2, lambda n: lease_to(sqlite_engine, mine[:n], fast.owner, "fast"), timeout_s=10
    )
    assert admitted.held == 2
    wait_for(lambda: {r.status for r in rows(sqlite_engine, mine).values()} == {"done"}, "work")
    assert sorted(server.aborted) == sorted(server.sent[0] + server.sent[1])
    assert {(r.status, r.lease_owner) for r in rows(sqlite_engine, elsewhere).values()} == {
        ("leased", "owner-slow")
    }
    assert fast.stats.cancelled == 2 and fast.stats.hedge_results == 0


def test_an_abort_that_is_lost_is_sent_again(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    elsewhere = add_items(sqlite_engine, run, 1)
    lease_to(sqlite_engine, elsewhere, "owner-slow", "slow")
    server = Server(lambda prompt: BLOCK if prompt[-1] == 0 else 0.01)
    server.lose_first_abort = True  # as when the abort reaches the server before the request
    fast = make_window(sqlite_engine, windows, server, inflight=1)
    wait_for(lambda: len(server.sent) == 1, "the hedge in flight")

    mine = add_items(sqlite_engine, run, 1, start=1)
    fast.submit(lease_to(sqlite_engine, mine, fast.owner, "fast"))
    wait_for(lambda: rows(sqlite_engine, mine)[mine[0]].status == "done", "the real item")
    hedge_rid = server.sent[0][0]
    assert server.aborted[:2] == [hedge_rid, hedge_rid]
    assert fast.stats.cancelled == 1


def test_hedges_stay_while_free_slots_are_enough_for_the_work(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    elsewhere = add_items(sqlite_engine, run, 1)
    lease_to(sqlite_engine, elsewhere, "owner-slow", "slow")
    server = Server(lambda prompt: BLOCK if prompt[-1] == 0 else 0.01)
    fast = make_window(sqlite_engine, windows, server, inflight=4)
    wait_for(lambda: len(server.sent) == 1, "the hedge in flight")

    mine = add_items(sqlite_engine, run, 3, start=1)  # three free slots for three items
    fast.submit(lease_to(sqlite_engine, mine, fast.owner, "fast"))
    wait_for(lambda: {r.status for r in rows(sqlite_engine, mine).values()} == {"done"}, "work")
    assert server.aborted == [] and fast.stats.cancelled == 0
    assert fast.outstanding == 1  # the hedge, still running


def test_stop_aborts_hedges_instead_of_waiting_for_them(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    ids = add_items(sqlite_engine, run, 1)
    lease_to(sqlite_engine, ids, "owner-slow", "slow")
    server = Server(lambda prompt: BLOCK)
    fast = make_window(sqlite_engine, windows, server)
    wait_for(lambda: len(server.sent) == 1, "the hedge in flight")
    fast.stop(drain_timeout_s=30)
    assert server.aborted == server.sent[0]
    assert fast.outstanding == 0
    row = rows(sqlite_engine, ids)[ids[0]]
    assert (row.status, row.lease_owner) == ("leased", "owner-slow")


def test_stop_during_a_hedge_search_sends_nothing_and_takes_the_marks_back(
    sqlite_engine: Engine, run: run_queries.RunInfo
) -> None:
    ids = add_items(sqlite_engine, run, 2)
    lease_to(sqlite_engine, ids, "owner-slow", "slow")
    searching, resume = threading.Event(), threading.Event()
    server = Server(lambda prompt: 0.01)
    fast = make_window(
        sqlite_engine,
        [],  # stopped here
        server,
        search=lambda find: slow_search(find, searching, resume),
    )
    assert searching.wait(10)
    stopper = threading.Thread(target=fast.stop, kwargs={"drain_timeout_s": 2})
    stopper.start()
    wait_for(fast.is_stopping, "stop() to begin")
    resume.set()  # the search returns the two items, marked, after stop() began
    stopper.join(30)
    assert not stopper.is_alive()
    assert fast.outstanding == 0 and server.calls_by_prompt == {}
    assert {(r.status, r.hedge_owner) for r in rows(sqlite_engine, ids).values()} == {
        ("leased", None)
    }


def slow_search(
    find: Callable[[int], list[claims.ClaimedItem]],
    searching: threading.Event,
    resume: threading.Event,
) -> Callable[[int], list[claims.ClaimedItem]]:
    def search(limit: int) -> list[claims.ClaimedItem]:
        searching.set()
        assert resume.wait(10)
        return find(limit)

    return search


def unmark(db: Engine, ids: list[int], owner: str) -> None:
    with db.begin() as conn:
        claims.unmark_hedged(conn, ids, owner=owner)

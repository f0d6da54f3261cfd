"""The in-flight window with a fake SGLang client and a SQLite ledger: constant window,
retries that spend attempts, outages that do not, permanent failures, clean shutdown."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from sqlalchemy import Engine

from app.core.errors import PermanentError, RetryableError, ServerUnavailable
from app.ledger import claims, queue, reads, run_queries
from workers.engine.fake_client import Answer, FakePolicy, FakeServer
from workers.engine.window import InflightWindow, WindowConfig
from workers.engine.window_types import Admitted


def make_window(
    db: Engine,
    script: Answer,
    *,
    inflight: int = 4,
    max_attempts: int = 3,
    released: list[int] | None = None,
    server_up: bool = True,
    priority_of: Callable[[int], int | None] = lambda run_id: None,
) -> tuple[InflightWindow, FakeServer]:
    server = FakeServer(script, up=server_up)

    window = InflightWindow(
        WindowConfig(
            server_name="fake",
            inflight=inflight,
            lease_s=60,
            heartbeat_s=0.2,
            max_attempts=max_attempts,
            retry_backoff_s=0.01,
            retry_backoff_max_s=0.05,
            unavailable_wait_s=0.05,
            backlog=inflight,
        ),
        db=db,
        owner="owner-1",
        policy=FakePolicy(
            server,
            on_released=lambda ids, wait_s: (released if released is not None else []).extend(ids),
            priority_of=priority_of,
        ),
    )
    return window, server


def feed(
    db: Engine, window: InflightWindow, run: run_queries.RunInfo, n: int, *, key: str = "k"
) -> list[int]:
    with db.begin() as conn:
        queue.insert_items(
            conn, run.id, [queue.NewItem(f"{key}{i}", 0, i, None, [1, i]) for i in range(n)]
        )
        ids = queue.pending_ids(conn, run.id)
    step = min(4, window.capacity())
    for start in range(0, len(ids), step):
        assert window.wait_for_room(step, timeout_s=30)
        with db.begin() as conn:
            window.submit(
                claims.claim_items(
                    conn, ids[start : start + step], owner=window.owner, server="fake", lease_s=60
                )
            )
    return ids


def wait_idle(window: InflightWindow, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not window.idle():
        assert time.monotonic() < deadline, "window never settled"
        time.sleep(0.01)


def statuses(db: Engine, run: run_queries.RunInfo) -> dict[int, reads.StoredItem]:
    with db.connect() as conn:
        return {
            i.id: i
            for i in reads.iter_items(
                conn, run.id, statuses=("pending", "queued", "leased", "done", "failed")
            )
        }


def test_window_keeps_exactly_n_in_flight_with_heavy_tail(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    # one prompt in ten takes 20x longer: a batch-and-wait client would idle on it
    window, server = make_window(
        sqlite_engine, lambda ids, call: 0.2 if ids[-1] % 10 == 0 else 0.01, inflight=4
    )
    started.append(window)
    window.start()
    feed(sqlite_engine, window, run, 40)
    wait_idle(window)
    rows = statuses(sqlite_engine, run)
    assert {r.status for r in rows.values()} == {"done"}
    assert server.peak == 4
    assert all(r.attempts == 1 for r in rows.values())


def test_retryable_errors_spend_attempts_then_succeed(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    failures: dict[int, int] = {}

    def script(ids: list[int], call: int) -> float | Exception:
        n = failures.get(ids[-1], 0)
        if n < 2:
            failures[ids[-1]] = n + 1
            return RetryableError("HTTP 500: boom", status_code=500)
        return 0.0

    window, _ = make_window(sqlite_engine, script, max_attempts=5)
    started.append(window)
    window.start()
    feed(sqlite_engine, window, run, 6)
    wait_idle(window)
    rows = statuses(sqlite_engine, run)
    assert {(r.status, r.attempts) for r in rows.values()} == {("done", 3)}


def test_retries_stop_at_the_attempt_budget(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    window, _ = make_window(
        sqlite_engine, lambda ids, call: RetryableError("timeout"), max_attempts=3
    )
    started.append(window)
    window.start()
    feed(sqlite_engine, window, run, 2)
    wait_idle(window)
    rows = statuses(sqlite_engine, run)
    assert {(r.status, r.attempts) for r in rows.values()} == {("failed", 3)}
    assert all("gave up after 3 attempts: timeout" in (r.error or "") for r in rows.values())


def test_permanent_error_fails_at_once_with_the_server_message(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    msg = "The input (9000 tokens) is longer than the model's context length (8192 tokens)."
    window, server = make_window(
        sqlite_engine,
        lambda ids, call: PermanentError(msg, status_code=400) if ids[-1] == 1 else 0.0,
    )
    started.append(window)
    window.start()
    feed(sqlite_engine, window, run, 3)
    wait_idle(window)
    rows = sorted(statuses(sqlite_engine, run).values(), key=lambda r: r.id)
    assert [r.status for r in rows] == ["done", "failed", "done"]
    assert rows[1].attempts == 1 and msg in (rows[1].error or "")
    assert server.calls == 3


def test_unavailable_server_releases_items_without_spending_attempts(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    released: list[int] = []
    window, _ = make_window(
        sqlite_engine, lambda ids, call: ServerUnavailable("refused"), released=released
    )
    started.append(window)
    window.start()
    ids = feed(sqlite_engine, window, run, 5)
    wait_idle(window)
    rows = statuses(sqlite_engine, run)
    assert sorted(released) == ids
    assert {(r.status, r.attempts) for r in rows.values()} == {("queued", 0)}


def test_stop_gives_back_unsent_work(sqlite_engine: Engine, run: run_queries.RunInfo) -> None:
    released: list[int] = []
    window, _ = make_window(sqlite_engine, lambda ids, call: 0.3, inflight=2, released=released)
    window.start()
    ids = feed(sqlite_engine, window, run, 4)
    window.stop(drain_timeout_s=5)
    rows = statuses(sqlite_engine, run)
    done = [i for i, r in rows.items() if r.status == "done"]
    assert sorted(done + released) == ids
    assert all(rows[i].status == "queued" and rows[i].attempts == 0 for i in released)


def test_reset_by_a_dying_server_costs_no_attempt(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    released: list[int] = []
    window, _ = make_window(
        sqlite_engine,
        lambda ids, call: RetryableError("Server disconnected"),
        released=released,
        server_up=False,
    )
    started.append(window)
    window.start()
    ids = feed(sqlite_engine, window, run, 3)
    wait_idle(window)
    rows = statuses(sqlite_engine, run)
    assert sorted(released) == ids
    assert {(r.status, r.attempts) for r in rows.values()} == {("queued", 0)}


def pending(db: Engine, run: run_queries.RunInfo, n: int) -> list[int]:
    with db.begin() as conn:
        queue.insert_items(
            conn, run.id, [queue.NewItem(f"k{i}", 0, i, None, [1, i]) for i in range(n)]
        )
        return queue.pending_ids(conn, run.id)


def ledger_down(n: int) -> list[claims.ClaimedItem]:
    raise RuntimeError("ledger down")


def test_admit_holds_only_the_room_there_is(
    sqlite_engine: Engine, run: run_queries.RunInfo
) -> None:
    """Room is held before anything is claimed: all of it when it fits, what fits once the
    wait is over, none when the window is full (the claim is not asked); the room a claim
    does not fill, or a claim that raises, is given back; nothing while stopping."""
    window, _ = make_window(sqlite_engine, lambda ids, call: 0.0, inflight=4)  # capacity 8
    pool = pending(sqlite_engine, run, 8)
    asked: list[int] = []

    def claim(n: int) -> list[claims.ClaimedItem]:
        asked.append(n)
        take, pool[:] = pool[:n], pool[n:]
        with sqlite_engine.begin() as conn:
            return claims.claim_items(conn, take, owner=window.owner, server="fake", lease_s=60)

    assert window.admit(5, lambda n: [], timeout_s=0.01) == Admitted(5, [])
    assert window.room() == 8  # a claim that found nothing holds no room
    with pytest.raises(RuntimeError):
        window.admit(3, ledger_down)
    assert window.room() == 8
    first = window.admit(6, claim, timeout_s=0.01)
    assert first.held == 6 and len(first.items) == 6
    assert window.admit(5, claim, timeout_s=0.01).held == 2  # waited, then took the 2 that fit
    assert window.admit(1, claim, timeout_s=0.01) == Admitted(0, [])
    assert asked == [6, 2] and window.outstanding == 8 and window.room() == 0
    window.start()
    wait_idle(window)
    window.stop(drain_timeout_s=1)
    assert window.admit(1, claim, timeout_s=0.01) == Admitted(0, [])
    assert asked == [6, 2]


def test_a_claim_may_not_fill_more_room_than_was_held(
    sqlite_engine: Engine, run: run_queries.RunInfo
) -> None:
    window, _ = make_window(sqlite_engine, lambda ids, call: 0.0, inflight=1)  # capacity 2
    ids = pending(sqlite_engine, run, 3)

    def greedy(n: int) -> list[claims.ClaimedItem]:
        with sqlite_engine.begin() as conn:
            return claims.claim_items(conn, ids, owner=window.owner, server="fake", lease_s=60)

    with pytest.raises(ValueError, match="claimed 3 units of room, 2 were held"):
        window.admit(3, greedy)
    assert window.room() == 2


def test_admitted_items_are_not_counted_twice(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    window, server = make_window(sqlite_engine, lambda ids, call: 0.0, inflight=2)
    started.append(window)
    window.start()
    ids = pending(sqlite_engine, run, 3)

    def claim(n: int) -> list[claims.ClaimedItem]:
        with sqlite_engine.begin() as conn:
            return claims.claim_items(conn, ids[:n], owner=window.owner, server="fake", lease_s=60)

    assert window.admit(3, claim, timeout_s=0.01).held == 3
    wait_idle(window)
    assert window.outstanding == 0 and server.calls == 3
    assert {i.status for i in statuses(sqlite_engine, run).values()} == {"done"}


def test_backlog_shrinks_to_what_the_server_finishes_in_backlog_s(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    """A slow server keeps fewer claimed items waiting: with backlog_s the backlog is its
    recent completion rate times backlog_s (1 to `backlog`), the full backlog until the rate
    is known."""
    now = [1000.0]
    window = InflightWindow(
        WindowConfig(
            server_name="fake",
            inflight=4,
            lease_s=60,
            heartbeat_s=3600,
            max_attempts=3,
            retry_backoff_s=0.01,
            retry_backoff_max_s=0.05,
            unavailable_wait_s=0.05,
            backlog=8,
            backlog_s=0.1,
        ),
        db=sqlite_engine,
        owner="owner-1",
        policy=FakePolicy(),
        clock=lambda: now[0],
    )
    started.append(window)
    assert window.capacity() == 12  # no completions yet: the full backlog
    window.start()
    with sqlite_engine.begin() as conn:
        queue.insert_items(
            conn, run.id, [queue.NewItem(f"k{i}", 0, i, None, [1, i]) for i in range(12)]
        )
        ids = queue.pending_ids(conn, run.id)
        claimed = claims.claim_items(conn, ids, owner=window.owner, server="fake", lease_s=60)
    window.submit(claimed)
    wait_idle(window)
    now[0] = 1000.5  # 12 finished in the last 0.5 s: 24/s, 2.4 items in 0.1 s
    assert window.capacity() == 4 + 3
    now[0] = 1010.0  # 1.2/s: one waiting item is enough
    assert window.capacity() == 4 + 1
    assert window.admit(10, lambda n: [], timeout_s=0.0).held == 5
    now[0] = 1031.0  # nothing finished for 30 s: the rate is unknown again
    assert window.capacity() == 12


def test_a_resize_moves_the_slots_and_the_room_without_a_restart(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    window, server = make_window(sqlite_engine, lambda ids, call: 0.05, inflight=2)
    started.append(window)
    window.start()
    assert window.resize(6, backlog=6) == 2
    assert window.capacity() == 12
    feed(sqlite_engine, window, run, 36)
    wait_idle(window)
    assert server.peak == 6
    assert window.resize(2, backlog=2) == 6
    server.peak = 0
    feed(sqlite_engine, window, run, 12, key="m")
    wait_idle(window)
    assert server.peak <= 2
    assert {r.status for r in statuses(sqlite_engine, run).values()} == {"done"}


def test_requests_carry_the_priority_the_policy_gives_their_run(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    # a server that schedules by priority: each request names its run's; another: none
    window, server = make_window(sqlite_engine, lambda ids, call: 0.0, priority_of=lambda r: 7)
    started.append(window)
    window.start()
    feed(sqlite_engine, window, run, 6)
    wait_idle(window)
    assert sorted(server.priorities.values()) == [7] * 6
    plain, plain_server = make_window(sqlite_engine, lambda ids, call: 0.0)
    started.append(plain)
    plain.start()
    feed(sqlite_engine, plain, run, 3, key="p")
    wait_idle(plain)
    assert plain_server.priorities == {} and plain_server.calls == 3

"""Conversations in the window (`--turns each`): a conversation's items go out one at a time,
shortest first, while other items fill the free slots; a slot that would idle takes the next
item early once the one before is past its prefill; a stop gives held items back."""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator

import pytest
from sqlalchemy import Engine

from app.ledger import claims, queue, reads, run_queries
from workers.engine.fake_client import FakePolicy, FakeServer, LogEntry
from workers.engine.groups import Conversations
from workers.engine.window import InflightWindow, WindowConfig


def grouped(run_id: int, key: str) -> Hashable | None:
    return (run_id, key) if key.startswith("conv") else None


@pytest.fixture
def windows() -> Iterator[list[InflightWindow]]:
    made: list[InflightWindow] = []
    yield made
    for window in made:
        window.stop(drain_timeout_s=1)


def make_window(
    db: Engine,
    made: list[InflightWindow],
    log: list[LogEntry],
    *,
    inflight: int,
    delay_s: float,
    stagger_s: float = 0.0,
) -> InflightWindow:
    window = InflightWindow(
        WindowConfig(
            server_name="fake",
            inflight=inflight,
            lease_s=60,
            heartbeat_s=0.2,
            max_attempts=3,
            retry_backoff_s=0.01,
            retry_backoff_max_s=0.05,
            unavailable_wait_s=0.05,
            backlog=inflight,
            group_stagger_s=stagger_s,
        ),
        db=db,
        owner="owner-1",
        policy=FakePolicy(FakeServer(lambda ids, call: delay_s, log=log), conversation_of=grouped),
    )
    made.append(window)
    window.start()
    return window


def insert(db: Engine, run: run_queries.RunInfo, new: list[queue.NewItem]) -> list[int]:
    with db.begin() as conn:
        queue.insert_items(conn, run.id, new)
        return queue.pending_ids(conn, run.id)


def claim(db: Engine, ids: list[int]) -> list[claims.ClaimedItem]:
    with db.begin() as conn:
        return claims.claim_items(conn, ids, owner="owner-1", server="fake", lease_s=60)


def conversation(key: str, marker: int, lengths: list[int]) -> list[queue.NewItem]:
    """Boundary items of one conversation, inserted longest first (the window reorders)."""
    return [
        queue.NewItem(key, 0, 1, None, [marker + turn] + [7] * (length - 1), turn)
        for turn, length in sorted(enumerate(lengths), key=lambda p: -p[1])
    ]


def wait_idle(window: InflightWindow) -> None:
    deadline = time.monotonic() + 30
    while not window.idle():
        assert time.monotonic() < deadline, "window never settled"
        time.sleep(0.01)


def test_a_conversation_goes_out_one_at_a_time_shortest_first(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    log: list[LogEntry] = []
    window = make_window(sqlite_engine, windows, log, inflight=4, delay_s=0.05)
    new = conversation("conv-a", 1000, [10, 40, 20, 30])
    new += [queue.NewItem(f"single-{i}", 0, 2, None, [2000 + i, 1], 0) for i in range(3)]
    ids = insert(sqlite_engine, run, new)
    claimed = claim(sqlite_engine, ids)
    assert window.units(claimed) == 4  # one conversation and three single items
    window.submit(claimed)
    wait_idle(window)

    conv = [(what, marker - 1000, at) for what, marker, _, at in log if marker < 2000]
    # turns in order of their prompt length: 0 (10), 2 (20), 3 (30), 1 (40)
    assert [m for what, m, _ in conv if what == "sent"] == [0, 2, 3, 1]
    # never two of them out at once: each is sent after the one before came back
    events = [what for what, _, _ in conv]
    assert events == ["sent", "done"] * 4
    # the single items did not wait for the conversation: all three went out at the start
    first_done = min(at for what, _, _, at in log if what == "done")
    singles_sent = [at for what, marker, _, at in log if what == "sent" and marker >= 2000]
    assert len(singles_sent) == 3 and max(singles_sent) < first_done
    with sqlite_engine.connect() as conn:
        done = list(reads.iter_items(conn, run.id))
    assert len(done) == len(new)


def test_a_conversation_arriving_in_two_parts_still_goes_one_at_a_time(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    log: list[LogEntry] = []
    window = make_window(sqlite_engine, windows, log, inflight=4, delay_s=0.05)
    ids = insert(sqlite_engine, run, conversation("conv-b", 1000, [10, 20, 30, 40]))
    first, second = claim(sqlite_engine, ids[:2]), claim(sqlite_engine, ids[2:])
    window.submit(first)
    window.submit(second)
    wait_idle(window)
    assert [what for what, *_ in log] == ["sent", "done"] * 4


def test_an_idle_slot_takes_the_next_item_once_the_one_before_is_past_prefill(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    log: list[LogEntry] = []
    # each answer takes 1.5 s; after 0.1 s out, the next item may take a free slot
    window = make_window(sqlite_engine, windows, log, inflight=4, delay_s=1.5, stagger_s=0.1)
    ids = insert(sqlite_engine, run, conversation("conv-c", 1000, [10, 20, 30]))
    window.submit(claim(sqlite_engine, ids))
    wait_idle(window)
    sent = [(m - 1000, at) for what, m, _, at in log if what == "sent"]
    assert [m for m, _ in sent] == [0, 1, 2]
    # staggered, not waiting for each answer: the third went out before the first came back
    first_done = min(at for what, _, _, at in log if what == "done")
    assert sent[2][1] < first_done


def test_stopping_gives_held_items_back(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    log: list[LogEntry] = []
    window = make_window(sqlite_engine, windows, log, inflight=2, delay_s=0.3)
    ids = insert(sqlite_engine, run, conversation("conv-d", 1000, [10, 20, 30]))
    window.submit(claim(sqlite_engine, ids))
    deadline = time.monotonic() + 10
    while not log:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    window.stop(drain_timeout_s=5)
    with sqlite_engine.connect() as conn:
        found = {
            i.turn_index: i.status
            for i in reads.iter_items(conn, run.id, statuses=("queued", "leased", "done"))
        }
    # the first finished while draining; the two held ones went back to the queue unsent
    assert found == {0: "done", 1: "queued", 2: "queued"}
    assert [what for what, *_ in log] == ["sent", "done"]


def test_conversations_order_hold_and_release() -> None:
    groups: Conversations[str] = Conversations(order=lambda job: (len(job),))
    assert groups.admit("a", ["xxx", "x", "xx"]) == "x"
    assert groups.held == 2
    assert groups.admit("a", ["xxxx"]) is None  # joins the head already out
    groups.sent("a", "x", at=10.0)
    assert groups.early(now=10.5, after_s=1.0, limit=4) == []
    assert groups.early(now=11.0, after_s=1.0, limit=4) == ["xx"]
    assert groups.settled("a", "x") is None  # not the head any more
    assert groups.settled("a", "xx") == "xxx"
    assert groups.drop("a") == ["xxxx"]
    assert groups.settled("a", "xxx") is None
    assert groups.held == 0


def test_a_window_serving_conversations_holds_one_waiting_at_most(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    log: list[LogEntry] = []
    window = make_window(sqlite_engine, windows, log, inflight=2, delay_s=0.05)
    assert window.capacity() == 2 + 2  # the configured backlog
    ids = insert(sqlite_engine, run, conversation("conv-e", 1000, [10, 20]))
    window.submit(claim(sqlite_engine, ids))
    # a conversation is many items' work: beyond the slots, one waits at most
    assert window.capacity() == 2 + 1
    wait_idle(window)

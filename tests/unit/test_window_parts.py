"""The in-flight window's parts on their own: the backlog and its delayed retries, the room and
the rate that sizes the backlog, the hedges and their aborts."""

from __future__ import annotations

import threading

from app.core.contracts import SamplingParams
from app.ledger import claims
from workers.engine.backlog import Backlog
from workers.engine.fake_client import FakeServer
from workers.engine.hedging import ABORT_AGAIN_S, Hedges
from workers.engine.policies import GenerationPolicy
from workers.engine.room import RATE_WINDOW_S, InFlight, Room
from workers.engine.window_types import Job, WindowConfig, WindowStats


def job(item_id: int, **fields: object) -> Job:
    item = claims.ClaimedItem(item_id, 1, 0, [1, 2], 0, item_key=f"k{item_id}")
    made = Job(item=item, policy=GenerationPolicy(SamplingParams(seed=1)))
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def config(**fields: object) -> WindowConfig:
    base = WindowConfig(
        server_name="s",
        inflight=4,
        lease_s=60,
        heartbeat_s=1,
        max_attempts=3,
        retry_backoff_s=0.1,
        retry_backoff_max_s=1,
        unavailable_wait_s=1,
        backlog=8,
    )
    for name, value in fields.items():
        setattr(base, name, value)
    return base


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backlog_sends_retries_when_due_in_due_order() -> None:
    backlog = Backlog()
    a, b, c = job(1), job(2), job(3)
    backlog.later(b, due=5.0)
    backlog.later(a, due=2.0)
    backlog.later(c, due=5.0)
    assert backlog.due(1.0) == []
    assert backlog.due(5.0) == [a, b, c]  # same due time: in the order they were put
    backlog.later(a, due=9.0)
    assert backlog.drop_delayed() == [a] and backlog.due(10.0) == []


def test_backlog_stop_marks_come_after_the_jobs_before_them() -> None:
    backlog = Backlog()
    first = job(1)
    backlog.put(first)
    backlog.stop_slots(2)
    taken: list[Job | None] = []
    slots = [threading.Thread(target=lambda: taken.append(backlog.take())) for _ in range(3)]
    for slot in slots:
        slot.start()
    for slot in slots:
        slot.join(timeout=5)
    assert taken[0] is first and taken[1:] == [None, None] and backlog.empty()


def test_room_sizes_the_backlog_by_the_recent_rate() -> None:
    clock = Clock()
    room = Room(config(backlog=8, backlog_s=1.0), clock)
    assert room.capacity() == 4 + 8  # too few completions yet: the full backlog
    room.take(10)
    for _ in range(10):  # 10 items a second for a second: 10 s of work in the last second
        room.handed_to_writer()
        room.committed(1, 1)
    clock.now += 2.0
    assert room.backlog_limit() == 5  # 10 items over 2 s: 5 items a second × 1 s
    clock.now += RATE_WINDOW_S + 1
    assert room.backlog_limit() == 8  # those completions are too old to count
    assert room.idle()


def test_room_holds_one_conversation_beyond_the_slots() -> None:
    room = Room(config(), Clock())
    room.serves_conversations = True
    room.take(5)
    assert (room.capacity(), room.free(), room.free_slots(), room.waiting()) == (5, 0, -1, 1)


def hedges_with(stats: WindowStats, clock: Clock, aborted: list[str]) -> Hedges:
    return Hedges(
        stats=stats,
        clock=clock,
        client_factory=FakeServer(abortable=True, aborted=aborted).client,
    )


def test_hedges_make_room_queued_ones_first_then_the_latest_sent() -> None:
    stats, clock, aborted = WindowStats(), Clock(), []
    hedges = hedges_with(stats, clock, aborted)
    queued = job(1, hedge=True)
    early = job(2, hedge=True, rid="r2", sent_at=1.0)
    late = job(3, hedge=True, rid="r3", sent_at=2.0)
    for each in (early, queued, late):
        hedges.add(each)
    hedges.make_room(2)
    assert (queued.cancelled, late.cancelled, early.cancelled) == (True, True, False)
    assert hedges.leaving() == 2 and stats.cancelled == 2
    hedges.abort_again([])  # too soon to ask again
    clock.now += ABORT_AGAIN_S + 0.1
    hedges.abort_again([])
    hedges.stop_aborts()
    hedges.abort_loop()  # sends what was queued before the stop, then ends
    # late was aborted when cancelled and once more after ABORT_AGAIN_S; queued was never sent
    assert aborted == ["r3", "r3"]


def test_abandon_drops_sent_hedges_and_cancels_queued_ones() -> None:
    hedges = hedges_with(WindowStats(), Clock(), [])
    sent, queued = job(1, hedge=True, rid="r1"), job(2, hedge=True)
    hedges.add(sent)
    hedges.add(queued)
    assert hedges.abandon() == [sent]
    assert sent.abandoned and queued.cancelled and hedges.jobs() == [queued]


def test_in_flight_map_by_item() -> None:
    inflight = InFlight()
    a = job(1)
    inflight.add(a)
    inflight.add(job(2))
    inflight.remove(a)
    inflight.remove(a)
    assert [j.item.id for j in inflight.jobs()] == [2]

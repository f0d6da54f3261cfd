"""The claim order's rule, on a fake read of the ledger: the highest priority first, runs of one
priority round robin, a joining run level with the least served, room left to the next
priority; and the message priorities that carry a run's priority to the broker."""

from __future__ import annotations

from collections import Counter

from app.core.constants import BROKER_PRIORITY_STEPS
from app.ledger import metrics_queries
from ops.views.metrics import ledger_families
from workers.engine.scheduling import ClaimOrder, RunWork
from workers.intake.publish import DEFAULT_STEP, broker_priority


class Ledger:
    """The runs with items waiting, as the order reads them; counts how often it is read."""

    def __init__(self, work: dict[int, RunWork]) -> None:
        self.work = work
        self.reads = 0
        self.broken = False

    def read(self) -> dict[int, RunWork]:
        self.reads += 1
        if self.broken:
            raise OSError("ledger away")
        return dict(self.work)


def order_of(work: dict[int, RunWork]) -> tuple[ClaimOrder, Ledger, list[float]]:
    ledger = Ledger(work)
    now = [0.0]
    return ClaimOrder(ledger.read, refresh_s=2.0, clock=lambda: now[0]), ledger, now


def plan(order: ClaimOrder, room: int, in_hand: dict[int, int] | None = None) -> dict[int, int]:
    return dict(
        order.plan(room, in_hand or {}, priority_of=lambda run: 0, from_ledger=lambda run: True)
    )


def test_the_highest_priority_takes_the_room_first() -> None:
    order, _, _ = order_of({1: RunWork(0, 300), 2: RunWork(10, 48)})
    # the message in hand is the big run's: the urgent run's items go first all the same
    assert plan(order, 16, {1: 32}) == {2: 16}


def test_room_left_by_a_priority_goes_to_the_next() -> None:
    order, _, _ = order_of({1: RunWork(0, 300), 2: RunWork(10, 3)})
    assert plan(order, 8, {1: 32}) == {2: 3, 1: 5}


def test_runs_of_one_priority_share_round_robin() -> None:
    order, _, _ = order_of({1: RunWork(0, 300), 3: RunWork(0, 48)})
    granted: Counter[int] = Counter()
    for _ in range(10):
        granted.update(plan(order, 3, {1: 32}))
    assert granted == {1: 15, 3: 15}


def test_a_joining_run_starts_level_with_the_least_served() -> None:
    order, ledger, now = order_of({1: RunWork(0, 300)})
    assert plan(order, 16, {1: 32}) == {1: 16}
    ledger.work[3] = RunWork(0, 48)
    now[0] += 2.0  # the next read sees run 3: it shares from now on, no catching up
    granted: Counter[int] = Counter()
    for _ in range(4):
        granted.update(plan(order, 4, {1: 32}))
    assert granted == {1: 8, 3: 8}


def test_the_ledger_is_read_again_every_refresh() -> None:
    order, ledger, now = order_of({1: RunWork(0, 300), 2: RunWork(0, 10)})
    plan(order, 4)
    plan(order, 4)
    assert ledger.reads == 1
    ledger.work[2] = RunWork(5, 10)  # `tokenmill priority` raised run 2
    now[0] += 2.0
    assert plan(order, 4, {1: 32}) == {2: 4}
    assert ledger.reads == 2
    assert order.priority(2) == 5


def test_runs_this_worker_may_not_claim_from_the_ledger_are_left() -> None:
    order, _, _ = order_of({1: RunWork(0, 300), 2: RunWork(10, 48)})
    got = order.plan(4, {1: 32}, priority_of=lambda run: 0, from_ledger=lambda run: run != 2)
    assert dict(got) == {1: 4}


def test_a_run_in_hand_not_yet_read_has_the_priority_it_was_created_with() -> None:
    order, _, _ = order_of({1: RunWork(0, 300)})
    got = order.plan(4, {7: 32}, priority_of=lambda run: 3, from_ledger=lambda run: True)
    assert dict(got) == {7: 4}


def test_a_failed_read_keeps_the_last_one() -> None:
    order, ledger, now = order_of({2: RunWork(10, 48)})
    plan(order, 1)
    ledger.broken = True
    now[0] += 2.0
    assert plan(order, 4, {1: 32}) == {2: 4}


def test_broker_priorities_order_runs_as_their_priorities() -> None:
    assert broker_priority(0) == DEFAULT_STEP
    assert broker_priority(10) == BROKER_PRIORITY_STEPS[0]  # Redis serves step 0 first
    assert broker_priority(1) < broker_priority(0) < broker_priority(-1)
    assert broker_priority(-100) == BROKER_PRIORITY_STEPS[-1]


def test_metrics_show_each_runs_priority() -> None:
    snapshot = metrics_queries.LedgerSnapshot(
        run_names=["big", "eval"],
        groups=[],
        latencies=[],
        servers=[],
        run_priorities={"big": 0, "eval": 10},
    )
    (family,) = [f for f in ledger_families(snapshot) if f.name == "tokenmill_run_priority"]
    assert {s.labels["run"]: s.value for s in family.samples} == {"big": 0, "eval": 10}

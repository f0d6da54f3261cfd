"""One worker's claim order: which runs' items its free room takes, so a shared fleet serves
the urgent run first and runs of equal standing side by side.

The rule: room goes to the highest-priority run that has items for this worker's server; runs
of one priority share it round robin (each grant to the run of that priority granted least so
far; a run that joins starts level with the least, so it neither waits behind the others nor
catches up on what they got before it). Room left when that priority's runs have no more goes
to the next priority. Nothing in flight is taken back: the order decides the next claims only.

The worker's message says which items woke it; the order says whose items it claims. A
message's own ids are claimed when its run is next; otherwise the worker claims the next run's
items from the ledger (app.ledger.claims.claim_next, in id order) and sends the message's ids
back to the broker unclaimed (each keeps a message, so reconcile never finds them lost; the
messages of the items claimed ahead are skipped when they come). So a worker holding prefetched
messages of a big run still serves an urgent run's items first, without claiming early: items
wait unleased, in the ledger, not in a worker's backlog, and no lease expires behind other work.

What the order reads: every PRIORITY_REFRESH_S, the runs' priorities and how many items each
has waiting (the item counters: a few rows per run), so `tokenmill priority` reaches every
worker within that long, for items already queued too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sqlalchemy import Engine

from app.core.constants import PRIORITY_REFRESH_S
from app.ledger import counters, run_queries

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunWork:
    """A run's priority and its items waiting for a worker (pending or queued)."""

    priority: int
    waiting: int


def read_work(db: Engine) -> dict[int, RunWork]:
    """Every run with items waiting, by id: its priority and how many (the counters)."""
    with db.connect() as conn:
        waiting = counters.claimable_by_run(conn)
        ranks = run_queries.run_priorities(conn, waiting) if waiting else {}
    return {run: RunWork(ranks.get(run, 0), n) for run, n in waiting.items()}


class ClaimOrder:
    """The order this worker grants room in (thread-safe: the pool's threads ask it at once).

    read: the runs with items waiting (read_work), called at most every refresh_s."""

    def __init__(
        self,
        read: Callable[[], dict[int, RunWork]],
        *,
        refresh_s: float = PRIORITY_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._work: dict[int, RunWork] = {}
        self._read_at: float | None = None
        self._granted: dict[int, int] = {}  # room granted to each run so far (round robin)

    def work(self) -> dict[int, RunWork]:
        """The runs with items waiting, read again when the last read is refresh_s old (a
        failed read keeps the last one: the order is a preference, the claims stay exact)."""
        with self._lock:
            due = self._read_at is None or self._clock() - self._read_at >= self._refresh_s
            if due:
                self._read_at = self._clock()  # one reader at a time; the others use the last
        if due:
            try:
                fresh = self._read()
            except Exception as exc:  # the ledger went away a moment: claims will say so
                log.debug("claim order not read again (%s)", exc)
            else:
                with self._lock:
                    self._work = fresh
        with self._lock:
            return dict(self._work)

    def priority(self, run_id: int) -> int:
        """The run's priority as last read (0 for a run with nothing waiting)."""
        work = self.work().get(run_id)
        return 0 if work is None else work.priority

    def outranked(self, priority: int, *, from_ledger: Callable[[int], bool]) -> bool:
        """Whether a run of a higher priority than this has items waiting that this worker
        may claim from the ledger (a message of `--turns each` conversations then goes back
        whole, and its room goes to that run)."""
        return any(
            w.priority > priority and w.waiting > 0 and from_ledger(run)
            for run, w in self.work().items()
        )

    def plan(
        self,
        room: int,
        in_hand: Mapping[int, int],
        *,
        priority_of: Callable[[int], int],
        from_ledger: Callable[[int], bool],
    ) -> list[tuple[int, int]]:
        """Who gets `room` units, as (run id, units) in the order granted: the runs of the
        message in hand (in_hand: run → its ids in the message) and the runs with items
        waiting that this worker may claim from the ledger (from_ledger(run)); priority_of
        gives a run's priority when the last read does not have it (a run just enqueued)."""
        work = self.work()
        supply: dict[int, int] = {}
        ranks: dict[int, int] = {}
        for run, n in in_hand.items():
            # beyond the message's ids, the run's items waiting in the ledger
            waiting = work[run].waiting if run in work and from_ledger(run) else 0
            supply[run] = max(n, waiting)
            ranks[run] = work[run].priority if run in work else priority_of(run)
        for run, w in work.items():
            if run not in in_hand and w.waiting > 0 and from_ledger(run):
                supply[run] = w.waiting
                ranks[run] = w.priority
        grants: dict[int, int] = {}
        with self._lock:
            for run in [r for r in self._granted if r not in ranks]:
                del self._granted[run]  # gone from view: it starts level again if it comes back
            for rank in sorted(set(ranks.values()), reverse=True):
                if room <= 0:
                    break
                tier = sorted(r for r in ranks if ranks[r] == rank)
                room -= self._share(tier, supply, room, grants)
        return list(grants.items())

    def _share(
        self, tier: list[int], supply: dict[int, int], room: int, grants: dict[int, int]
    ) -> int:
        """Grant up to room units round robin to the runs of one priority (under the lock);
        returns the units granted."""
        known = [self._granted[r] for r in tier if r in self._granted]
        floor = min(known) if known else 0
        for run in tier:  # a run joining starts level with the least granted of its tier
            self._granted.setdefault(run, floor)
        given = 0
        while given < room:
            open_runs = [r for r in tier if supply[r] > grants.get(r, 0)]
            if not open_runs:
                break
            run = min(open_runs, key=lambda r: (self._granted[r], r))
            self._granted[run] += 1
            grants[run] = grants.get(run, 0) + 1
            given += 1
        return given


# a server whose /server_info could not be read is asked again after this long (meanwhile its
# requests carry no priority: a server that does not schedule by one may abort a request that
# names one)
SERVER_INFO_RETRY_S = 10.0


class ServerPriority:
    """Whether the server orders its own queue by request priority (SGLang's
    `--enable-priority-scheduling`), and in which direction: `/server_info` says, read once
    and again after forget() (the server restarted, its fingerprint was read anew).

    read: the server's /server_info."""

    def __init__(
        self,
        read: Callable[[], Mapping[str, object]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._clock = clock
        self._lock = threading.Lock()
        # +1: higher values first (SGLang's default); -1: lower first; 0: no priority scheduling
        self._direction: int | None = None
        self._retry_at = 0.0

    def forget(self) -> None:
        with self._lock:
            self._direction = None
            self._retry_at = 0.0

    def direction(self) -> int:
        with self._lock:
            known, retry_at = self._direction, self._retry_at
        if known is not None:
            return known
        if self._clock() < retry_at:
            return 0
        try:
            info = self._read()
        except Exception as exc:
            log.debug("server_info not read for request priorities (%s)", exc)
            with self._lock:
                self._retry_at = self._clock() + SERVER_INFO_RETRY_S
            return 0
        found = 0
        if info.get("enable_priority_scheduling") is True:
            found = -1 if info.get("schedule_low_priority_values_first") is True else 1
        with self._lock:
            self._direction = found
        return found

    def request_priority(self, run_priority: int) -> int | None:
        """What a request of a run of run_priority carries: the run's priority in the server's
        direction, or None (sent without one) when the server does not schedule by it."""
        direction = self.direction()
        return None if direction == 0 else direction * run_priority

"""The in-flight window: keeps a constant number of requests in flight to one SGLang server.

Claimed items wait in a small backlog; each of N slot threads (one single-connection client
each) takes the next item the moment its previous request finishes (slots.py beside this
module), so there are no batch barriers and heavy-tailed output lengths never idle the server.
Outcomes go to one writer thread that commits them in small groups (writer.py); a heartbeat
thread with its own connection keeps this worker's leases alive (heartbeat.py).

Hedging (the end of a run, hedging.py): when slots are free and the run has nothing
left to claim, the timer asks for items still running on other servers and sends a second copy
of each to this server. The first result written wins (the ledger never writes a finished item
again); the copy that lost is aborted on its server (`/abort_request`) once the ledger shows
the item finished, and hedges give their slots back at once when real work arrives.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable

from sqlalchemy import Engine

from app import ledger
from app.core.contracts import GenerateResult, SamplingParams
from app.ledger import ClaimedItem, Done, Failed, Outcome, Released
from workers.engine.groups import Conversations
from workers.engine.heartbeat import renew_leases
from workers.engine.hedging import Hedges
from workers.engine.slots import run_job
from workers.engine.window_types import Delayed, GenerateClient, Job

# the window's own records, named here too: callers build and read a window with them
from workers.engine.window_types import WindowConfig as WindowConfig
from workers.engine.window_types import WindowStats as WindowStats
from workers.engine.writer import ResultWriter

log = logging.getLogger(__name__)

_STOP = object()
RATE_WINDOW_S = 30.0  # completions this far back set the server's rate (backlog_s)


class InflightWindow:
    """N slot threads, a writer and a heartbeat around one server; thread-safe submit()."""

    def __init__(
        self,
        config: WindowConfig,
        *,
        db: Engine,
        owner: str,
        client_factory: Callable[[], GenerateClient],
        sampling_for_run: Callable[[int], SamplingParams],
        on_released: Callable[[list[int], float], None],
        is_paused: Callable[[], bool] = lambda: False,
        on_finished: Callable[[list[int]], None] = lambda ids: None,
        find_hedges: Callable[[int], list[ClaimedItem]] | None = None,
        unmark_hedges: Callable[[list[int]], None] = lambda ids: None,
        group_of: Callable[[int, str], Hashable | None] = lambda run_id, key: None,
        check_result: Callable[[ClaimedItem, GenerateResult], str | None] = lambda i, r: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.owner = owner
        self.stats = WindowStats()
        self._db = db
        self._client_factory = client_factory
        self._sampling_for_run = sampling_for_run
        self._on_released = on_released
        # told the ids of results just committed (multi-turn chains start their next turn)
        self._on_finished = on_finished
        self._is_paused = is_paused
        # a result made with other weights than its run's is given back, not written
        self._check_result = check_result
        self._clock = clock
        # the conversation of an item (run id, item key), or None: sent on its own
        self.group_of = group_of
        # set once this window takes `--turns each` conversations (see _backlog_limit)
        self.serves_conversations = False
        self._groups: Conversations[Job] = Conversations(
            order=lambda j: (len(j.item.prompt_ids), j.item.turn_index, j.item.sample_index)
        )
        self._backlog: queue.Queue[Job | object] = queue.Queue()
        self._writer = ResultWriter(db, owner=owner, config=config, on_written=self._written)
        self._sending: dict[int, Job] = {}
        self._hedges = Hedges(self, find_hedges=find_hedges, unmark_hedges=unmark_hedges)
        self._delayed: list[Delayed] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._outstanding = 0  # claimed items this window holds and has not settled
        self._completions: deque[tuple[float, int]] = deque()  # (commit time, items finished)
        self._completed = 0  # sum of the counts in _completions
        self._unwritten = 0  # outcomes handed to the writer and not yet committed
        self._unavailable_until = 0.0
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        name = self.config.server_name
        for i in range(self.config.inflight):
            self._spawn(self._slot_loop, f"tm-slot-{name}-{i}")
        self._spawn(self._writer.loop, f"tm-writer-{name}")
        self._spawn(self._timer_loop, f"tm-timer-{name}")
        self._spawn(
            lambda: renew_leases(self._db, self.owner, self.config, self._stopping),
            f"tm-heartbeat-{name}",
        )
        if self.config.hedge_interval_s > 0:
            self._spawn(self._hedges.abort_loop, f"tm-abort-{name}")
        log.info(
            "window started server=%s inflight=%d owner=%s", name, self.config.inflight, self.owner
        )

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking work, give back what was not sent, let in-flight requests finish for
        up to drain_timeout_s, write every outcome, then release whatever is still leased."""
        if not self._started:
            return
        with self._cond:
            self._stopping.set()
            # hedges are spare copies: abort them instead of waiting for them to finish
            self._hedges.make_room(len(self._hedges.jobs))
            self._give_back(self._groups.drop_all(), "worker shutting down")
            self._cond.notify_all()
        for _ in range(self.config.inflight):
            self._backlog.put(_STOP)
        deadline = self._clock() + drain_timeout_s
        with self._cond:
            while self._outstanding > 0 and self._clock() < deadline:
                self._cond.wait(timeout=0.1)
        self._writer.stop()
        for thread in self._threads:
            if thread.name.startswith("tm-writer"):
                thread.join(timeout=max(5.0, deadline - self._clock()))
        try:
            with self._db.begin() as conn:
                leftover = ledger.release_owner(conn, self.owner)
            if leftover:
                log.info("window stop released %d unfinished items", len(leftover))
                self._on_released(leftover, 0.0)
        except Exception:
            log.exception("could not release leases at shutdown; they expire on their own")
        self._hedges.stop_aborts()
        for thread in self._threads:
            if thread.name.startswith("tm-abort"):
                thread.join(timeout=5.0)  # the hedges' aborts go out before the process ends
        log.info("window stopped server=%s", self.config.server_name)

    # --- intake ---------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        with self._cond:
            return self._outstanding

    def unavailable(self) -> bool:
        return self._clock() < self._unavailable_until

    def _backlog_limit(self) -> int:
        """Claimed items allowed to wait beyond the in-flight ones (call with _cond held)."""
        cfg = self.config
        if self.serves_conversations:
            # a waiting conversation is many items' work: hold one at most, so the others
            # (and their histories) go to servers with free slots
            return 1
        limit = max(cfg.backlog, 1)
        if cfg.backlog_s <= 0:
            return limit
        now = self._clock()
        while self._completions and self._completions[0][0] < now - RATE_WINDOW_S:
            self._completed -= self._completions.popleft()[1]
        seen = self._completed
        if seen < 8:  # too few completions to tell the rate yet
            return limit
        span = max(0.5, now - self._completions[0][0])
        return max(1, min(limit, math.ceil(seen / span * cfg.backlog_s)))

    def capacity(self) -> int:
        """Items this window takes: the in-flight slots plus the backlog."""
        with self._cond:
            return self.config.inflight + self._backlog_limit()

    def wait_for_room(self, n: int, timeout_s: float | None = None) -> bool:
        """Block until n more items fit in the window (backpressure on the message consumer)."""
        n = min(n, self.capacity())
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._cond:
            while self._outstanding + n > self.config.inflight + self._backlog_limit():
                if self._stopping.is_set():
                    return False
                self._hedges.make_room(
                    self._outstanding + n - self.config.inflight - self._backlog_limit()
                )
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(timeout=0.5 if remaining is None else min(0.5, remaining))
            return True

    def reserve(self, n: int, timeout_s: float) -> int:
        """Hold room for up to n items before claiming them: wait up to timeout_s until a
        worthwhile share fits (all n, or a full backlog's worth), then hold what fits; after
        the wait, whatever fits (maybe 0; 0 when stopping). The caller claims that many ids
        and hands the rest back unclaimed, so no claimed item waits here for a slot while
        another server could run it. Settle with submit(..., reserved=True) or unreserve()."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while not self._stopping.is_set():
                backlog = self._backlog_limit()
                room = self.config.inflight + backlog - self._outstanding
                if room >= min(n, backlog) or self._clock() >= deadline:
                    break
                self._hedges.make_room(min(n, backlog) - room)
                self._cond.wait(timeout=min(0.5, max(0.0, deadline - self._clock())))
            if self._stopping.is_set():
                return 0
            room = self.config.inflight + self._backlog_limit() - self._outstanding
            held = max(0, min(n, room))
            self._outstanding += held
            return held

    def unreserve(self, n: int) -> None:
        """Give back room reserved for items that were not submitted after all."""
        if n <= 0:
            return
        with self._cond:
            self._outstanding -= n
            self._cond.notify_all()

    def room(self) -> int:
        with self._cond:
            return max(0, self.config.inflight + self._backlog_limit() - self._outstanding)

    def units(self, claimed: list[ClaimedItem]) -> int:
        """The room these items take: one per conversation, one per other item."""
        groups = {self.group_of(c.run_id, c.item_key) for c in claimed}
        singles = sum(1 for c in claimed if self.group_of(c.run_id, c.item_key) is None)
        return singles + len(groups - {None})

    def submit(self, claimed: list[ClaimedItem], *, reserved: bool = False) -> None:
        """Queue claimed items for sending; each settles as done, failed or released.
        reserved=True: their room was taken by reserve() (exactly units(claimed) of it).

        The items of one conversation go out one at a time, shortest first: the next when
        the one before it settles (see Conversations), so each finds its history cached."""
        if not claimed:
            return
        jobs = [
            Job(
                item=c,
                sampling=self._sampling_for_run(c.run_id),
                group=self.group_of(c.run_id, c.item_key),
            )
            for c in claimed
        ]
        by_group: dict[Hashable, list[Job]] = {}
        for job in jobs:
            if job.group is not None:
                by_group.setdefault(job.group, []).append(job)
        with self._cond:
            self.serves_conversations = self.serves_conversations or bool(by_group)
            if not reserved:
                self._outstanding += self.units(claimed)
            ready = [j for j in jobs if j.group is None]
            for key, members in by_group.items():
                head = self._groups.admit(key, members)
                if head is None:
                    self._outstanding -= 1  # rides on the head its conversation has out
                else:
                    ready.append(head)
            # real work never waits behind a hedge: as many hedges as items would wait for a
            # slot give theirs up (hedges already cancelled are on their way out)
            waiting = self._outstanding - self.config.inflight
            leaving = sum(1 for j in self._hedges.jobs.values() if j.cancelled)
            self._hedges.make_room(min(len(ready), waiting - leaving))
        for job in ready:
            self._backlog.put(job)

    def _give_back(self, jobs: list[Job], reason: str) -> None:
        """Release held items that will not be sent (call with _cond held)."""
        for job in jobs:
            self._outstanding += 1
            self._unwritten += 1
            self._writer.put(Released(job.item.id, reason), True)

    def _release_early(self) -> None:
        """Slots about to idle take the next items of conversations whose head is past its
        prefill (group_stagger_s), instead of waiting for the head to finish."""
        with self._cond:
            free = self.config.inflight - self.stats.inflight
            if free <= 0 or not self._backlog.empty() or self._stopping.is_set():
                return
            early = self._groups.early(self._clock(), self.config.group_stagger_s, free)
            self._outstanding += len(early)
            for job in early:
                self._backlog.put(job)

    def idle(self) -> bool:
        with self._cond:
            return self._outstanding == 0 and self._unwritten == 0

    # --- slots ----------------------------------------------------------------------------

    def _slot_loop(self) -> None:
        client: GenerateClient | None = None
        try:
            while True:
                job = self._backlog.get()
                if job is _STOP:
                    return
                assert isinstance(job, Job)
                if client is None:
                    client = self._client_factory()
                if job.hedge:
                    self._hedges.run(client, job)
                else:
                    run_job(self, client, job)
                if job.abandoned:
                    return  # a replacement slot took this one's place when it was given up
        finally:
            if client is not None:
                client.close()

    def _settle(self, outcome: Outcome, job: Job | None = None) -> None:
        with self._cond:
            if job is not None and job.abandoned:
                # already given back; only a real result is still worth writing
                if isinstance(outcome, Done):
                    self._writer.put(outcome, False)
                return
            self._unwritten += 1
            if job is not None and job.group is not None:
                successor = self._groups.settled(job.group, job)
                if successor is not None:
                    # the conversation's unit of room passes to its next item (queued under
                    # the lock: ahead of any stop marks)
                    self._outstanding += 1
                    self._backlog.put(successor)
        self._writer.put(outcome, True)

    def abandon_inflight(self, reason: str) -> int:
        """Give back every item whose request is still out (a hung or dead server): other
        servers take them at once; a late answer is still written if it comes."""
        with self._cond:
            jobs = [j for j in self._sending.values() if not j.abandoned]
            for job in jobs:
                self._unwritten += 1
                self._writer.put(Released(job.item.id, reason), True)
                job.abandoned = True
                if job.group is not None:  # its conversation goes elsewhere with it
                    self._give_back(self._groups.drop(job.group), reason)
            # hedges on this server are dropped (the item stays with its holder)
            jobs += self._hedges.abandon()
        # the abandoned slots may stay blocked on a hung socket until the generate timeout:
        # fresh slots keep the window whole (they hold items back while the server is paused)
        for job in jobs:
            self._spawn(self._slot_loop, f"tm-slot-{self.config.server_name}-r{job.item.id}")
        if jobs:
            log.warning(
                "gave back %d in-flight items of %s: %s", len(jobs), self.config.server_name, reason
            )
        return len(jobs)

    # log fields and lines about this window's server, for slots.py and hedging.py too

    def _ids(self, item: ClaimedItem) -> dict[str, object]:
        """The ids an item's log lines carry as fields (JSON logs) besides the message."""
        return {"run_id": item.run_id, "item_id": item.id, "server": self.config.server_name}

    def _log_done(self, item: ClaimedItem, result: GenerateResult, how: str) -> None:
        log.info(
            "run %d item %d done on %s%s: %d tokens, %s",
            item.run_id,
            item.id,
            self.config.server_name,
            how,
            result.completion_tokens,
            result.finish_reason,
            extra=self._ids(item),
        )

    # --- timer: delayed retries and the hedge round ----------------------------------------

    def _timer_loop(self) -> None:
        next_hedge = self._clock()
        while not self._stopping.is_set():
            now = self._clock()
            due: list[Job] = []
            with self._cond:
                while self._delayed and self._delayed[0].due <= now:
                    due.append(heapq.heappop(self._delayed).job)
            for job in due:
                self._backlog.put(job)
            if self.config.group_stagger_s > 0:
                self._release_early()
            if self.config.hedge_interval_s > 0 and now >= next_hedge:
                next_hedge = now + self.config.hedge_interval_s
                try:
                    self._hedges.round()
                except Exception as exc:
                    log.warning("hedge round failed (%s); trying again", exc)
            self._stopping.wait(0.05)
        # shutting down: delayed retries are given back, not sent
        with self._cond:
            pending = [d.job for d in self._delayed]
            self._delayed.clear()
        for job in pending:
            self._settle(Released(job.item.id, "worker shutting down"), job)

    # --- writer: what a commit settles -----------------------------------------------------

    def _written(self, entries: list[tuple[Outcome, bool]], released: list[int]) -> None:
        """Called by the writer after each commit: start what follows the finished items,
        re-queue the released ones, and give back the room of every settled one."""
        batch = [outcome for outcome, _ in entries]
        settled = sum(1 for _, settles in entries if settles)
        ended = sum(1 for o in batch if isinstance(o, Done | Failed))
        finished = [o.item_id for o in batch if isinstance(o, Done | Failed)]
        if finished:
            self._on_finished(finished)
        if released:
            with self._cond:
                self.stats.released += len(released)
            wait_s = self.config.unavailable_wait_s if self.unavailable() else 0.0
            try:
                self._on_released(released, wait_s)
            except Exception:
                log.exception("could not re-queue %d released items; reconcile will", len(released))
        with self._cond:
            if ended:
                self._completions.append((self._clock(), ended))
                self._completed += ended
            self._outstanding -= settled
            self._unwritten -= settled
            self._cond.notify_all()

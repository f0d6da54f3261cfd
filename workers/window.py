"""The in-flight window: keeps a constant number of requests in flight to one SGLang server.

Claimed items wait in a small backlog; each of N slot threads (one single-connection client
each) takes the next item the moment its previous request finishes, so there are no batch
barriers and heavy-tailed output lengths never idle the server. Outcomes go to one writer
thread that commits them in small groups; a heartbeat thread with its own connection keeps
this worker's leases alive.

Hedging (the end of a run): when slots are free and the run has nothing left to claim, the
timer asks for items still running on other servers and sends a second copy of each to this
server. The first result written wins (the ledger never writes a finished item again); the
copy that lost is aborted on its server (`/abort_request`) once the ledger shows the item
finished, and hedges give their slots back at once when real work arrives.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import InterfaceError, OperationalError

from app import ledger
from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import GenerationError, PermanentError, RetryableError, ServerUnavailable
from app.ledger import ClaimedItem, Done, Failed, Outcome, Released, RetryLater
from app.ledger.database import limit_periodic
from app.sglang import ProbeResult
from workers.groups import Conversations

log = logging.getLogger(__name__)


class GenerateClient(Protocol):
    def generate(
        self, input_ids: list[int], sampling_params: dict[str, object], rid: str
    ) -> GenerateResult: ...

    def health(self, path: str = ...) -> ProbeResult: ...

    def abort(self, rid: str) -> bool: ...

    def close(self) -> None: ...


@dataclass
class WindowConfig:
    server_name: str
    inflight: int
    lease_s: float
    heartbeat_s: float
    max_attempts: int
    retry_backoff_s: float
    retry_backoff_max_s: float
    unavailable_wait_s: float
    backlog: int = 0  # extra claimed items waiting beyond the in-flight ones
    # > 0: the backlog holds at most this many seconds of the server's recent completions (at
    # least one item, at most `backlog`): enough to cover the claim round trip, and a slow
    # server does not sit on claimed items a faster one could run at the end of a run
    backlog_s: float = 0.0
    writer_batch: int = 256
    writer_linger_s: float = 0.005
    # > 0: every this many seconds, abort copies of items that finished elsewhere and (given a
    # hedge source) fill free slots with hedges
    hedge_interval_s: float = 0.0
    # > 0: a slot that would idle takes the next item of a conversation whose last item has
    # been out this long (past its prefill: its prompt is cached); 0: only once it finished
    group_stagger_s: float = 0.0

    def capacity(self) -> int:
        return self.inflight + max(self.backlog, 1)


@dataclass
class WindowStats:
    sent: int = 0
    done: int = 0
    failed: int = 0
    retried: int = 0
    released: int = 0
    output_tokens: int = 0
    inflight: int = 0
    last_completion: float | None = None
    last_error: str | None = None
    hedges: int = 0  # second copies sent of items leased to other servers
    hedge_results: int = 0  # of those, answered (written only if no other result was first)
    cancelled: int = 0  # copies aborted: finished on another server, or a hedge making room


@dataclass(order=True)
class _Delayed:
    due: float
    seq: int
    job: _Job = field(compare=False)


@dataclass
class _Job:
    item: ClaimedItem
    sampling: SamplingParams
    tries: int = 0  # attempts made under this lease
    abandoned: bool = False  # given back while its request was still out
    hedge: bool = False  # a second copy of an item leased to another server
    rid: str | None = None  # of the request in flight
    cancelled: bool = False  # not worth an answer any more (aborted on its server)
    sent_at: float = 0.0
    cancelled_at: float = 0.0
    group: Hashable | None = None  # its conversation (`--turns each`), sent one at a time


_STOP = object()
RATE_WINDOW_S = 30.0  # completions this far back set the server's rate (backlog_s)
ABORT_AGAIN_S = 1.0  # a cancelled copy still out after this long is aborted again


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
        # up to n items leased elsewhere, marked as hedged by this window (hedge_interval_s)
        self._find_hedges = find_hedges
        self._unmark_hedges = unmark_hedges
        self._clock = clock
        # the conversation of an item (run id, item key), or None: sent on its own
        self.group_of = group_of
        # set once this window takes `--turns each` conversations (see _backlog_limit)
        self.serves_conversations = False
        self._groups: Conversations[_Job] = Conversations(
            order=lambda j: (len(j.item.prompt_ids), j.item.turn_index, j.item.sample_index)
        )
        self._backlog: queue.Queue[_Job | object] = queue.Queue()
        # (outcome, settles): settles=False for a late answer to an abandoned request
        self._outcomes: queue.Queue[tuple[Outcome, bool] | object] = queue.Queue()
        self._sending: dict[int, _Job] = {}
        self._hedging: dict[int, _Job] = {}  # hedge jobs queued or in flight, by id(job)
        # rids of copies not worth an answer, for the abort thread to send (a hung server
        # can keep an abort waiting for its timeout: never on the timer's heartbeat path)
        self._aborts: queue.Queue[str | object] = queue.Queue()
        self._delayed: list[_Delayed] = []
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
        self._spawn(self._writer_loop, f"tm-writer-{name}")
        self._spawn(self._timer_loop, f"tm-timer-{name}")
        self._spawn(self._heartbeat_loop, f"tm-heartbeat-{name}")
        if self.config.hedge_interval_s > 0:
            self._spawn(self._abort_loop, f"tm-abort-{name}")
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
            self._yield_hedges(len(self._hedging))
            self._give_back(self._groups.drop_all(), "worker shutting down")
            self._cond.notify_all()
        for _ in range(self.config.inflight):
            self._backlog.put(_STOP)
        deadline = self._clock() + drain_timeout_s
        with self._cond:
            while self._outstanding > 0 and self._clock() < deadline:
                self._cond.wait(timeout=0.1)
        self._outcomes.put(_STOP)
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
        self._aborts.put(_STOP)
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
                self._yield_hedges(
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
                self._yield_hedges(min(n, backlog) - room)
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
            _Job(
                item=c,
                sampling=self._sampling_for_run(c.run_id),
                group=self.group_of(c.run_id, c.item_key),
            )
            for c in claimed
        ]
        by_group: dict[Hashable, list[_Job]] = {}
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
            leaving = sum(1 for j in self._hedging.values() if j.cancelled)
            self._yield_hedges(min(len(ready), waiting - leaving))
        for job in ready:
            self._backlog.put(job)

    def _give_back(self, jobs: list[_Job], reason: str) -> None:
        """Release held items that will not be sent (call with _cond held)."""
        for job in jobs:
            self._outstanding += 1
            self._unwritten += 1
            self._outcomes.put((Released(job.item.id, reason), True))

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
                assert isinstance(job, _Job)
                if client is None:
                    client = self._client_factory()
                self._run_job(client, job)
                if job.abandoned:
                    return  # a replacement slot took this one's place when it was given up
        finally:
            if client is not None:
                client.close()

    def _settle(self, outcome: Outcome, job: _Job | None = None) -> None:
        with self._cond:
            if job is not None and job.abandoned:
                # already given back; only a real result is still worth writing
                if isinstance(outcome, Done):
                    self._outcomes.put((outcome, False))
                return
            self._unwritten += 1
            if job is not None and job.group is not None:
                successor = self._groups.settled(job.group, job)
                if successor is not None:
                    # the conversation's unit of room passes to its next item (queued under
                    # the lock: ahead of any stop marks)
                    self._outstanding += 1
                    self._backlog.put(successor)
        self._outcomes.put((outcome, True))

    def abandon_inflight(self, reason: str) -> int:
        """Give back every item whose request is still out (a hung or dead server): other
        servers take them at once; a late answer is still written if it comes."""
        with self._cond:
            jobs = [j for j in self._sending.values() if not j.abandoned]
            for job in jobs:
                self._unwritten += 1
                self._outcomes.put((Released(job.item.id, reason), True))
                job.abandoned = True
                if job.group is not None:  # its conversation goes elsewhere with it
                    self._give_back(self._groups.drop(job.group), reason)
            # hedges on this server are dropped (the item stays with its holder)
            hedges = [j for j in self._hedging.values() if j.rid is not None and not j.abandoned]
            for job in hedges:
                job.abandoned = job.cancelled = True
                self._hedging.pop(id(job), None)
                self._outstanding -= 1
            self._yield_hedges(len(self._hedging))  # the queued ones
            if hedges:
                self._cond.notify_all()
            jobs += hedges
        # the abandoned slots may stay blocked on a hung socket until the generate timeout:
        # fresh slots keep the window whole (they hold items back while the server is paused)
        for job in jobs:
            self._spawn(self._slot_loop, f"tm-slot-{self.config.server_name}-r{job.item.id}")
        if jobs:
            log.warning(
                "gave back %d in-flight items of %s: %s", len(jobs), self.config.server_name, reason
            )
        return len(jobs)

    def _ids(self, item: ClaimedItem) -> dict[str, object]:
        """The ids an item's log lines carry as fields (JSON logs) besides the message."""
        return {"run_id": item.run_id, "item_id": item.id, "server": self.config.server_name}

    def _run_job(self, client: GenerateClient, job: _Job) -> None:
        if job.hedge:
            self._run_hedge(client, job)
            return
        item = job.item
        name = self.config.server_name
        if self._stopping.is_set():
            self._settle(Released(item.id, "worker shutting down"), job)
            return
        if self.unavailable() or self._is_paused():
            log.info(
                "run %d item %d released by %s: server paused or unavailable",
                item.run_id,
                item.id,
                name,
                extra=self._ids(item),
            )
            self._settle(Released(item.id, "server paused or unavailable"), job)
            return
        rid = f"tm-{item.id}-{uuid.uuid4().hex[:12]}"
        job.tries += 1
        with self._cond:
            self.stats.sent += 1
            self.stats.inflight += 1
            job.rid = rid
            self._sending[item.id] = job
            if job.group is not None:
                self._groups.sent(job.group, job, self._clock())
        try:
            try:
                result: GenerateResult | None = client.generate(
                    item.prompt_ids, job.sampling.for_sample(item.sample_index), rid
                )
            except GenerationError:
                if not job.cancelled:
                    raise
                result = None  # aborted because a hedge on another server finished it first
        except PermanentError as exc:
            log.info(
                "run %d item %d failed permanently on %s: %s",
                item.run_id,
                item.id,
                name,
                exc,
                extra=self._ids(item),
            )
            self._settle(Failed(item.id, f"permanent: {exc}", attempts_used=1), job)
            self._note(failed=1, error=str(exc))
        except ServerUnavailable as exc:
            # the server, not the item, is at fault: no attempt is spent
            self._unavailable_until = self._clock() + self.config.unavailable_wait_s
            job.tries -= 1
            log.info(
                "server %s unavailable (%s); run %d item %d goes back",
                name,
                exc,
                item.run_id,
                item.id,
                extra=self._ids(item),
            )
            self._settle(Released(item.id, f"server unavailable: {exc}"), job)
            self._note(error=str(exc))
        except RetryableError as exc:
            if job.abandoned:
                return
            if self._is_paused() or (exc.status_code is None and self._server_gone(client)):
                # the server died or was paused under the request: not the item's fault
                self._unavailable_until = self._clock() + self.config.unavailable_wait_s
                job.tries -= 1
                log.info(
                    "server %s went away (%s); run %d item %d goes back",
                    name,
                    exc,
                    item.run_id,
                    item.id,
                    extra=self._ids(item),
                )
                self._settle(Released(item.id, f"server went away: {exc}"), job)
            elif item.attempts + job.tries >= self.config.max_attempts:
                log.info(
                    "run %d item %d failed on %s after %d attempts: %s",
                    item.run_id,
                    item.id,
                    name,
                    item.attempts + job.tries,
                    exc,
                    extra=self._ids(item),
                )
                self._settle(
                    Failed(
                        item.id,
                        f"gave up after {item.attempts + job.tries} attempts: {exc}",
                        attempts_used=1,
                    ),
                    job,
                )
                self._note(failed=1, error=str(exc))
            else:
                self._outcomes.put((RetryLater(item.id, str(exc)), False))
                delay = min(
                    self.config.retry_backoff_max_s,
                    self.config.retry_backoff_s * 2 ** (item.attempts + job.tries - 1),
                )
                log.info(
                    "run %d item %d attempt %d on %s failed (%s); retry in %.1fs",
                    item.run_id,
                    item.id,
                    item.attempts + job.tries,
                    name,
                    exc,
                    delay,
                    extra=self._ids(item),
                )
                with self._cond:
                    heapq.heappush(
                        self._delayed, _Delayed(self._clock() + delay, next(self._seq), job)
                    )
                    self.stats.retried += 1
                self._note(error=str(exc))
        except Exception as exc:  # a bug must not kill the slot or strand the lease
            log.exception(
                "unexpected error sending run %d item %d",
                item.run_id,
                item.id,
                extra=self._ids(item),
            )
            self._settle(Released(item.id, f"internal error: {exc!r}"), job)
        else:
            if result is None:
                log.info(
                    "run %d item %d: the copy on %s was aborted, another server finished it",
                    item.run_id,
                    item.id,
                    name,
                    extra=self._ids(item),
                )
                self._settle(Released(item.id, "finished on another server"), job)
                return
            self._log_done(item, result, "")
            self._settle(Done(item.id, result, attempts_used=1, server=name), job)
            with self._cond:
                self.stats.done += 1
                self.stats.output_tokens += result.completion_tokens
                self.stats.last_completion = self._clock()
        finally:
            with self._cond:
                self.stats.inflight -= 1
                self._sending.pop(item.id, None)

    # --- hedges ---------------------------------------------------------------------------

    def _run_hedge(self, client: GenerateClient, job: _Job) -> None:
        """Send a second copy of an item leased to another server; write its result if it
        comes (first wins), drop it silently otherwise: a hedge never spends an attempt and
        never changes the item's lease."""
        item = job.item
        name = self.config.server_name
        if self.unavailable() or self._is_paused():
            self._drop_hedge(job)
            return
        rid = f"tm-{item.id}-hedge-{uuid.uuid4().hex[:8]}"
        with self._cond:
            # under the lock: a hedge cancelled from now on has a rid, so its abort is sent
            go = not (job.cancelled or self._stopping.is_set())
            if go:
                job.rid = rid
                job.sent_at = self._clock()
                self.stats.hedges += 1
                self.stats.inflight += 1
        if not go:
            self._drop_hedge(job)
            return
        try:
            result = client.generate(
                item.prompt_ids, job.sampling.for_sample(item.sample_index), rid
            )
        except Exception as exc:
            if isinstance(exc, ServerUnavailable):
                self._unavailable_until = self._clock() + self.config.unavailable_wait_s
            log.info(
                "run %d item %d: hedge on %s ended without a result (%s)",
                item.run_id,
                item.id,
                name,
                "aborted" if job.cancelled else exc,
                extra=self._ids(item),
            )
            if not job.abandoned:
                self._drop_hedge(job)
        else:
            self._log_done(item, result, " (hedge)")
            with self._cond:
                self.stats.hedge_results += 1
                self._hedging.pop(id(job), None)
            self._settle(Done(item.id, result, attempts_used=1, server=name), job)
        finally:
            with self._cond:
                self.stats.inflight -= 1

    def _drop_hedge(self, job: _Job) -> None:
        """A hedge ends without a result: give its room back, write nothing."""
        with self._cond:
            self._hedging.pop(id(job), None)
            self._outstanding -= 1
            self._cond.notify_all()

    def _yield_hedges(self, n: int) -> None:
        """Cancel up to n hedges to make room for real work (call with _cond held): queued
        ones first, then the latest sent (the least progress lost). Their room comes back
        when each settles."""
        if n <= 0:
            return
        live = [j for j in self._hedging.values() if not j.cancelled]
        live.sort(key=lambda j: (j.rid is not None, -j.sent_at))
        for job in live[:n]:
            self._cancel(job)

    def _cancel(self, job: _Job) -> None:
        """Mark a copy not worth an answer and ask its server to abort it if it was sent
        (call with _cond held)."""
        job.cancelled = True
        job.cancelled_at = self._clock()
        self.stats.cancelled += 1
        if job.rid is not None:
            self._aborts.put(job.rid)

    def _abort_loop(self) -> None:
        client: GenerateClient | None = None
        try:
            while True:
                rid = self._aborts.get()
                if rid is _STOP:
                    return
                assert isinstance(rid, str)
                if client is None:
                    client = self._client_factory()
                client.abort(rid)  # best effort; logs its own failures
        finally:
            if client is not None:
                client.close()

    def _hedge_round(self) -> None:
        """Abort copies of items that finished elsewhere, then fill free slots with hedges."""
        with self._cond:
            jobs = [
                j
                for j in (*self._sending.values(), *self._hedging.values())
                if j.rid is not None and not j.cancelled and not j.abandoned
            ]
        if jobs:
            with self._db.connect() as conn:
                limit_periodic(conn)
                final = ledger.finished_among(conn, [j.item.id for j in jobs])
            with self._cond:
                for job in jobs:
                    if job.item.id in final and not job.cancelled:
                        self._cancel(job)
        with self._cond:
            # an abort that reached the server before its request did is lost: ask again
            # for copies still out a while after they were cancelled
            due = self._clock() - ABORT_AGAIN_S
            for job in (*self._sending.values(), *self._hedging.values()):
                if job.cancelled and job.rid is not None and job.cancelled_at < due:
                    job.cancelled_at = self._clock()
                    self._aborts.put(job.rid)
        if self._find_hedges is None or self._stopping.is_set():
            return
        if self.unavailable() or self._is_paused() or not self._backlog.empty():
            return
        with self._cond:  # hold the free slots while asking, so a claim cannot take them too
            free = self.config.inflight - self._outstanding
            if free <= 0:
                return
            self._outstanding += free
        try:
            found = self._find_hedges(free)[:free]
            copies = [
                _Job(item=c, sampling=self._sampling_for_run(c.run_id), hedge=True) for c in found
            ]
        except BaseException:
            self.unreserve(free)
            raise
        with self._cond:
            # stop() cancels the hedges it sees and then queues the slots' stop marks: under
            # the lock, these jobs are either seen by it or queued ahead of the marks
            stopping = self._stopping.is_set()
            self._outstanding -= free if stopping else free - len(copies)
            if not stopping:
                for job in copies:
                    self._hedging[id(job)] = job
                    self._backlog.put(job)
            self._cond.notify_all()
        if stopping:  # never sent: let others hedge them
            self._unmark_hedges([c.id for c in found])
            return
        if copies:
            log.info(
                "%s has free slots and nothing to claim: hedging %d items running elsewhere",
                self.config.server_name,
                len(found),
            )

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

    def _server_gone(self, client: GenerateClient) -> bool:
        """After a reset or disconnect: is the server itself gone (refused, loading)?"""
        try:
            probe = client.health("/health")
        except Exception:
            return True
        return not probe.ok and (probe.status_code is None or probe.status_code == 503)

    def _note(self, *, failed: int = 0, error: str | None = None) -> None:
        with self._cond:
            self.stats.failed += failed
            if error:
                self.stats.last_error = error[:300]

    # --- heartbeat: lease renewals on their own thread and connection ---------------------

    def _heartbeat_loop(self) -> None:
        """Renew this worker's leases every heartbeat_s. Nothing else runs on this thread or
        its connection (kept open between beats), so no slow query, pool wait or hung abort
        can make a beat late; a failed beat drops the connection and tries again next beat."""
        conn: Connection | None = None
        try:
            while not self._stopping.wait(self.config.heartbeat_s):
                try:
                    if conn is None:
                        conn = self._db.connect()
                    with conn.begin():
                        limit_periodic(conn, timeout_s=max(1.0, self.config.heartbeat_s))
                        ledger.extend_leases(conn, owner=self.owner, lease_s=self.config.lease_s)
                except Exception as exc:
                    log.warning("lease heartbeat failed (%s); retrying next beat", exc)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            conn.close()
                    conn = None
        finally:
            if conn is not None:
                conn.close()

    # --- timer: delayed retries and the hedge round ----------------------------------------

    def _timer_loop(self) -> None:
        next_hedge = self._clock()
        while not self._stopping.is_set():
            now = self._clock()
            due: list[_Job] = []
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
                    self._hedge_round()
                except Exception as exc:
                    log.warning("hedge round failed (%s); trying again", exc)
            self._stopping.wait(0.05)
        # shutting down: delayed retries are given back, not sent
        with self._cond:
            pending = [d.job for d in self._delayed]
            self._delayed.clear()
        for job in pending:
            self._settle(Released(job.item.id, "worker shutting down"), job)

    # --- writer ---------------------------------------------------------------------------

    def _writer_loop(self) -> None:
        stop = False
        while not stop:
            first = self._outcomes.get()
            if self._outcomes.qsize() < self.config.writer_batch // 4:
                # linger a moment so fast answers share one commit (a one-row commit costs
                # ~10x the CPU per item of a 64-row one); results wait milliseconds at most
                time.sleep(self.config.writer_linger_s)
            batch: list[tuple[Outcome, bool]] = []
            if first is _STOP:
                stop = True
            else:
                batch.append(first)  # type: ignore[arg-type]
            while len(batch) < self.config.writer_batch:
                try:
                    more = self._outcomes.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                batch.append(more)  # type: ignore[arg-type]
            if batch:
                self._write(batch)

    def _write(self, entries: list[tuple[Outcome, bool]]) -> None:
        batch = [outcome for outcome, _ in entries]
        delay_s = 0.2
        while True:
            try:
                with self._db.begin() as conn:
                    released = ledger.record_outcomes(
                        conn, batch, owner=self.owner, lease_s=self.config.lease_s
                    )
                break
            except (OperationalError, InterfaceError) as exc:
                # the database is down or restarting: hold the results and keep trying
                log.warning(
                    "writing %d outcomes failed (%s); retrying in %.1fs", len(batch), exc, delay_s
                )
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 10.0)
            except Exception:
                # never drop a result; a bug here must be loud
                log.exception("writing %d outcomes failed; retrying in %.1fs", len(batch), delay_s)
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 10.0)
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

"""Hedging, the end of a run: a window with free slots and nothing left to claim sends second
copies of items running on other servers; the first result wins, the copy that lost is aborted."""

from __future__ import annotations

import logging
import queue
import uuid
from collections.abc import Callable

from app import ledger
from app.core.errors import ServerUnavailable
from app.ledger import ClaimedItem, Done
from app.ledger.database import limit_periodic
from workers.engine.window_types import GenerateClient, Job, WindowHost

log = logging.getLogger(__name__)

_STOP = object()
ABORT_AGAIN_S = 1.0  # a cancelled copy still out after this long is aborted again


class Hedges:
    """A window's hedge jobs and the aborts of copies not worth an answer. The window calls
    these from its slots, its timer and its intake; they share its state under its _cond."""

    def __init__(
        self,
        window: WindowHost,
        *,
        find_hedges: Callable[[int], list[ClaimedItem]] | None,
        unmark_hedges: Callable[[list[int]], None],
    ) -> None:
        self._window = window
        # up to n items leased elsewhere, marked as hedged by this window (hedge_interval_s)
        self._find_hedges = find_hedges
        self._unmark_hedges = unmark_hedges
        self.jobs: dict[int, Job] = {}  # hedge jobs queued or in flight, by id(job)
        # rids of copies not worth an answer, for the abort thread to send (a hung server
        # can keep an abort waiting for its timeout: never on the timer's heartbeat path)
        self._aborts: queue.Queue[str | object] = queue.Queue()

    def run(self, client: GenerateClient, job: Job) -> None:
        """Send a second copy of an item leased to another server; write its result if it
        comes (first wins), drop it silently otherwise: a hedge never spends an attempt and
        never changes the item's lease."""
        w = self._window
        item = job.item
        name = w.config.server_name
        if w.unavailable() or w._is_paused():
            self.drop(job)
            return
        rid = f"tm-{item.id}-hedge-{uuid.uuid4().hex[:8]}"
        with w._cond:
            # under the lock: a hedge cancelled from now on has a rid, so its abort is sent
            go = not (job.cancelled or w._stopping.is_set())
            if go:
                job.rid = rid
                job.sent_at = w._clock()
                w.stats.hedges += 1
                w.stats.inflight += 1
        if not go:
            self.drop(job)
            return
        try:
            result = client.generate(
                item.prompt_ids,
                job.sampling.for_sample(item.sample_index, item.row_sampling_params),
                rid,
            )
        except Exception as exc:
            if isinstance(exc, ServerUnavailable):
                w._unavailable_until = w._clock() + w.config.unavailable_wait_s
            log.info(
                "run %d item %d: hedge on %s ended without a result (%s)",
                item.run_id,
                item.id,
                name,
                "aborted" if job.cancelled else exc,
                extra=w._ids(item),
            )
            if not job.abandoned:
                self.drop(job)
        else:
            if w._check_result(item, result) is not None:
                self.drop(job)  # other weights than the run's: the item stays with its holder
                return
            w._log_done(item, result, " (hedge)")
            with w._cond:
                w.stats.hedge_results += 1
                self.jobs.pop(id(job), None)
            w._settle(Done(item.id, result, attempts_used=1, server=name), job)
        finally:
            with w._cond:
                w.stats.inflight -= 1

    def drop(self, job: Job) -> None:
        """A hedge ends without a result: give its room back, write nothing."""
        w = self._window
        with w._cond:
            self.jobs.pop(id(job), None)
            w._outstanding -= 1
            w._cond.notify_all()

    def make_room(self, n: int) -> None:
        """Cancel up to n hedges to make room for real work (call with the window's _cond
        held): queued ones first, then the latest sent (the least progress lost). Their room
        comes back when each settles."""
        if n <= 0:
            return
        live = [j for j in self.jobs.values() if not j.cancelled]
        live.sort(key=lambda j: (j.rid is not None, -j.sent_at))
        for job in live[:n]:
            self.cancel(job)

    def cancel(self, job: Job) -> None:
        """Mark a copy not worth an answer and ask its server to abort it if it was sent
        (call with the window's _cond held)."""
        w = self._window
        job.cancelled = True
        job.cancelled_at = w._clock()
        w.stats.cancelled += 1
        if job.rid is not None:
            self._aborts.put(job.rid)

    def abandon(self) -> list[Job]:
        """The server hung or died: drop the hedges sent to it (the item stays with its
        holder) and cancel the queued ones (call with the window's _cond held). Returns the
        dropped ones: their slots are blocked until the request times out."""
        w = self._window
        hedges = [j for j in self.jobs.values() if j.rid is not None and not j.abandoned]
        for job in hedges:
            job.abandoned = job.cancelled = True
            self.jobs.pop(id(job), None)
            w._outstanding -= 1
        self.make_room(len(self.jobs))  # the queued ones
        if hedges:
            w._cond.notify_all()
        return hedges

    def abort_loop(self) -> None:
        w = self._window
        client: GenerateClient | None = None
        try:
            while True:
                rid = self._aborts.get()
                if rid is _STOP:
                    return
                assert isinstance(rid, str)
                if client is None:
                    client = w._client_factory()
                client.abort(rid)  # best effort; logs its own failures
        finally:
            if client is not None:
                client.close()

    def stop_aborts(self) -> None:
        """End abort_loop once the aborts queued before this are sent."""
        self._aborts.put(_STOP)

    def round(self) -> None:
        """Abort copies of items that finished elsewhere, then fill free slots with hedges."""
        w = self._window
        with w._cond:
            jobs = [
                j
                for j in (*w._sending.values(), *self.jobs.values())
                if j.rid is not None and not j.cancelled and not j.abandoned
            ]
        if jobs:
            with w._db.connect() as conn:
                limit_periodic(conn)
                final = ledger.finished_among(conn, [j.item.id for j in jobs])
            with w._cond:
                for job in jobs:
                    if job.item.id in final and not job.cancelled:
                        self.cancel(job)
        with w._cond:
            # an abort that reached the server before its request did is lost: ask again
            # for copies still out a while after they were cancelled
            due = w._clock() - ABORT_AGAIN_S
            for job in (*w._sending.values(), *self.jobs.values()):
                if job.cancelled and job.rid is not None and job.cancelled_at < due:
                    job.cancelled_at = w._clock()
                    self._aborts.put(job.rid)
        if self._find_hedges is None or w._stopping.is_set():
            return
        if w.unavailable() or w._is_paused() or not w._backlog.empty():
            return
        with w._cond:  # hold the free slots while asking, so a claim cannot take them too
            free = w.config.inflight - w._outstanding
            if free <= 0:
                return
            w._outstanding += free
        try:
            found = self._find_hedges(free)[:free]
            copies = [
                Job(item=c, sampling=w._sampling_for_run(c.run_id), hedge=True) for c in found
            ]
        except BaseException:
            w.unreserve(free)
            raise
        with w._cond:
            # stop() cancels the hedges it sees and then queues the slots' stop marks: under
            # the lock, these jobs are either seen by it or queued ahead of the marks
            stopping = w._stopping.is_set()
            w._outstanding -= free if stopping else free - len(copies)
            if not stopping:
                for job in copies:
                    self.jobs[id(job)] = job
                    w._backlog.put(job)
            w._cond.notify_all()
        if stopping:  # never sent: let others hedge them
            self._unmark_hedges([c.id for c in found])
            return
        if copies:
            log.info(
                "%s has free slots and nothing to claim: hedging %d items running elsewhere",
                w.config.server_name,
                len(found),
            )

"""Hedging, the end of a run: a window with free slots and nothing left to claim sends second
copies of items running on other servers; the first result wins, the copy that lost is aborted.

Hedges holds the hedge jobs and the aborts (the window calls it under its own lock, and an abort
thread sends the aborts); HedgeRound is the timer's periodic step, asking the window only through
the public methods HedgeHost names.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Protocol

from sqlalchemy import Engine

from app.ledger import claims, database
from workers.engine.window_types import GenerateClient, Job, RunPolicy, WindowStats

log = logging.getLogger(__name__)

_STOP = object()
ABORT_AGAIN_S = 1.0  # a cancelled copy still out after this long is aborted again


class Hedges:
    """A window's hedge jobs (queued or in flight) and the aborts of copies not worth an
    answer, hedges or not. Its methods but abort_loop and stop_aborts are called under the
    window's lock."""

    def __init__(
        self,
        *,
        stats: WindowStats,
        clock: Callable[[], float],
        client_factory: Callable[[], GenerateClient],
    ) -> None:
        self._stats = stats  # counts the cancelled copies
        self._clock = clock
        self._client_factory = client_factory  # the abort thread's client
        self._jobs: dict[int, Job] = {}  # by id(job)
        # rids of copies not worth an answer, for the abort thread to send (a hung server
        # can keep an abort waiting for its timeout: never on the timer's heartbeat path)
        self._aborts: queue.Queue[str | object] = queue.Queue()

    def add(self, job: Job) -> None:
        self._jobs[id(job)] = job

    def forget(self, job: Job) -> None:
        """The hedge ended (answered, or dropped)."""
        self._jobs.pop(id(job), None)

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    def leaving(self) -> int:
        """Hedges cancelled and not yet ended: their room is on its way back."""
        return sum(1 for j in self._jobs.values() if j.cancelled)

    def make_room(self, n: int) -> None:
        """Cancel up to n hedges to make room for real work: queued ones first, then the
        latest sent (the least progress lost). Their room comes back when each settles."""
        if n <= 0:
            return
        live = [j for j in self._jobs.values() if not j.cancelled]
        live.sort(key=lambda j: (j.rid is not None, -j.sent_at))
        for job in live[:n]:
            self.cancel(job)

    def cancel(self, job: Job) -> None:
        """Mark a copy not worth an answer and ask its server to abort it if it was sent."""
        job.cancelled = True
        job.cancelled_at = self._clock()
        self._stats.cancelled += 1
        if job.rid is not None:
            self._aborts.put(job.rid)

    def worth_an_answer(self, inflight: list[Job]) -> list[Job]:
        """The copies sent, of these in-flight jobs and the hedges, still worth their answer."""
        return [
            j
            for j in (*inflight, *self._jobs.values())
            if j.rid is not None and not j.cancelled and not j.abandoned
        ]

    def abort_again(self, inflight: list[Job]) -> None:
        """An abort that reached the server before its request did is lost: ask again for
        the copies (these in-flight jobs and the hedges) still out a while after they were
        cancelled."""
        due = self._clock() - ABORT_AGAIN_S
        for job in (*inflight, *self._jobs.values()):
            if job.cancelled and job.rid is not None and job.cancelled_at < due:
                job.cancelled_at = self._clock()
                self._aborts.put(job.rid)

    def abandon(self) -> list[Job]:
        """The server hung or died: drop the hedges sent to it (the item stays with its
        holder) and cancel the queued ones. Returns the dropped ones: their room is free now,
        and their slots are blocked until the request times out."""
        hedges = [j for j in self._jobs.values() if j.rid is not None and not j.abandoned]
        for job in hedges:
            job.abandoned = job.cancelled = True
            self._jobs.pop(id(job), None)
        self.make_room(len(self._jobs))  # the queued ones
        return hedges

    def abort_loop(self) -> None:
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

    def stop_aborts(self) -> None:
        """End abort_loop once the aborts queued before this are sent."""
        self._aborts.put(_STOP)


class HedgeHost(Protocol):
    """What a hedge round asks of its window."""

    @property
    def server_name(self) -> str: ...

    def copies_out(self) -> list[Job]: ...

    def cancel_finished(self, jobs: list[Job], item_ids: set[int]) -> None: ...

    def abort_stale(self) -> None: ...

    def can_hedge(self) -> bool: ...

    def admit_hedges(self, copies: Callable[[int], list[Job]]) -> list[Job] | None: ...


class HedgeRound:
    """Every hedge_interval_s: abort copies of items that finished elsewhere, then fill free
    slots with hedges of items leased to other servers."""

    def __init__(
        self,
        window: HedgeHost,
        *,
        db: Engine,
        policy: RunPolicy,
    ) -> None:
        self._window = window
        self._db = db
        # its find_hedges: up to n items leased elsewhere, marked as hedged by this window
        self._policy = policy

    def run(self) -> None:
        w = self._window
        jobs = w.copies_out()
        if jobs:
            with self._db.connect() as conn:
                database.limit_periodic(conn)
                final = claims.finished_among(conn, [j.item.id for j in jobs])
            w.cancel_finished(jobs, final)
        w.abort_stale()
        if not w.can_hedge():
            return
        policy = self._policy
        found: list[claims.ClaimedItem] = []

        def copies(free: int) -> list[Job]:
            # asked while the window holds its free slots, so that a claim cannot take them
            found[:] = policy.find_hedges(free)[:free]
            return [
                Job(
                    item=c,
                    policy=policy.kind_policy(c.run_id),
                    hedge=True,
                    priority=policy.request_priority(c.run_id),
                )
                for c in found
            ]

        queued = w.admit_hedges(copies)
        if queued is None:  # stopping: never sent, let others hedge
            policy.unmark_hedges([c.id for c in found])
            return
        if queued:
            log.info(
                "%s has free slots and nothing to claim: hedging %d items running elsewhere",
                w.server_name,
                len(found),
                extra={"action": "hedging"},
            )

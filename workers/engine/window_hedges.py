"""The window's gate for hedges: what its hedge round asks (hedging.HedgeHost) and what a
slot reports of the hedge it runs, under the window's one lock (window_parts.py).
"""

from __future__ import annotations

from collections.abc import Callable

from workers.engine.window_parts import WindowGate
from workers.engine.window_types import Job


class HedgeGate(WindowGate):
    """Hedges into the window's free slots, and their room back once they end."""

    @property
    def server_name(self) -> str:
        return self.config.server_name

    def copies_out(self) -> list[Job]:
        """Requests out (in flight or hedges sent) still worth their answer."""
        with self._cond:
            return self._hedges.worth_an_answer(self._sending.jobs())

    def cancel_finished(self, jobs: list[Job], item_ids: set[int]) -> None:
        """Abort those of jobs (from copies_out) whose items the ledger shows finished."""
        with self._cond:
            for job in jobs:
                if job.item.id in item_ids and not job.cancelled:
                    self._hedges.cancel(job)

    def abort_stale(self) -> None:
        with self._cond:
            self._hedges.abort_again(self._sending.jobs())

    def can_hedge(self) -> bool:
        """Hedging on, not stopping, the server up and nothing waiting for a slot."""
        if not self.config.hedge or self._stopping.is_set() or self._server.unavailable():
            return False
        if self._server.paused():
            return False
        return self._backlog.empty()

    def admit_hedges(self, copies: Callable[[int], list[Job]]) -> list[Job] | None:
        """The gate for hedges: hold every slot no item is meant for, ask `copies(free)` for
        the hedge jobs to run in them, queue those and give back the rest. Returns the jobs
        queued ([] when no slot is free: copies is not called), or None when the window began
        stopping meanwhile (nothing queued: the caller unmarks what it found). If copies
        raises, the slots are given back."""
        free = self._hold_free_slots()
        if free <= 0:
            return []
        try:
            jobs = copies(free)[:free]
        except BaseException:
            self._unreserve(free)
            raise
        return jobs if self._queue_hedges(jobs, held=free) else None

    def _hold_free_slots(self) -> int:
        """Hold every slot no item is meant for; how many (maybe 0: then none is held)."""
        with self._cond:
            free = self._room.free_slots()
            if free <= 0:
                return 0
            self._room.take(free)
            return free

    def _queue_hedges(self, jobs: list[Job], held: int) -> bool:
        """Queue hedge jobs in the held slots, giving back the room of the rest; False (and
        nothing queued) when the window is stopping."""
        with self._cond:
            # stop() cancels the hedges it sees and then queues the slots' stop marks: under
            # the lock, these jobs are either seen by it or queued ahead of the marks
            stopping = self._stopping.is_set()
            self._room.give(held if stopping else held - len(jobs))
            if not stopping:
                for job in jobs:
                    self._hedges.add(job)
                    self._backlog.put(job)
            self._cond.notify_all()
        return not stopping

    def hedge_sent(self, job: Job, rid: str) -> bool:
        """Whether the hedge goes out as rid (not if cancelled meanwhile, or stopping)."""
        with self._cond:
            # under the lock: a hedge cancelled from now on has a rid, so its abort is sent
            if job.cancelled or self._stopping.is_set():
                return False
            job.rid = rid
            job.sent_at = self._clock()
            self.stats.hedges += 1
            self.stats.inflight += 1
            return True

    def hedge_answered(self, job: Job) -> None:
        with self._cond:
            self.stats.hedge_results += 1
            self._hedges.forget(job)

    def hedge_dropped(self, job: Job) -> None:
        """A hedge ends without a result: give its room back, write nothing."""
        with self._cond:
            self._hedges.forget(job)
            self._room.give(1)
            self._cond.notify_all()

    def hedge_ended(self) -> None:
        with self._cond:
            self.stats.inflight -= 1

"""What the window does when its server refuses work, under the window's one lock
(window_parts.py): a drain gives back the claimed items waiting here, a hung server the
requests out, a full server pushes a job back to wait (back-pressure, no attempt spent).
"""

from __future__ import annotations

import logging

from app.ledger import outcomes
from workers.engine.window_parts import WindowGate
from workers.engine.window_types import Job

log = logging.getLogger(__name__)


class Refusals(WindowGate):
    """Items given back and jobs pushed back, as the server refuses them."""

    def give_back(self, jobs: list[Job], reason: str) -> None:
        """Release held items that will not be sent (call with _cond held)."""
        for job in jobs:
            self._room.take(1)
            self._room.handed_to_writer()
            self._writer.put(outcomes.Released(job.item.id, reason), True)

    def abandon(self, reason: str) -> list[Job]:
        """Release every item whose request is still out, and drop the hedges out: the jobs
        whose slots the window replaces."""
        with self._cond:
            jobs = [j for j in self._sending.jobs() if not j.abandoned]
            for job in jobs:
                self._room.handed_to_writer()
                self._writer.put(outcomes.Released(job.item.id, reason), True)
                job.abandoned = True
                if job.group is not None:  # its conversation goes elsewhere with it
                    self.give_back(self._groups.drop(job.group), reason)
            # hedges on this server are dropped (the item stays with its holder)
            dropped = self._hedges.abandon()
            if dropped:
                self._room.give(len(dropped))
                self._cond.notify_all()
            jobs += dropped
        return jobs

    def drain(self, reason: str) -> int:
        """The server drains: send it nothing new, let the requests out finish, and give back
        every claimed item still waiting here (others take them at once); how many."""
        self._server.drain(reason)
        with self._cond:
            waiting = []
            for job in self._backlog.take_waiting():
                if job.hedge:  # a spare copy: dropped, its item stays with its holder
                    self._hedges.forget(job)
                    self._room.give(1)
                    continue
                waiting.append(job)
                self._room.handed_to_writer()
                self._writer.put(outcomes.Released(job.item.id, f"server draining: {reason}"), True)
                if job.group is not None:
                    self.give_back(self._groups.drop(job.group), reason)
            self._cond.notify_all()
        if waiting:
            log.warning(
                "server %s drains (%s): gave back %d claimed items, %d requests still out",
                self.config.server_name,
                reason,
                len(waiting),
                self.stats.inflight,
                extra={"action": "draining"},
            )
        return len(waiting)

    def may_send(self) -> bool:
        """Whether a slot may send now, under the server's back-pressure limit."""
        with self._cond:
            return self._server.may_send(self.stats.inflight)

    def hold_back(self, job: Job) -> None:
        """job waits a moment before it is sent: the server pushed back, fewer go out."""
        with self._cond:
            delay_s = self._server.push_back_delay_s(max(1, job.pushed_back))
            self._backlog.later(job, self._clock() + delay_s)

    def pushed_back(self, job: Job, reason: str) -> None:
        """The server refused job as full: no attempt spent; the window shrinks for this
        server and job goes out again after a backoff that grows while it is refused."""
        with self._cond:
            job.pushed_back += 1
            self._server.push_back(self.stats.inflight)
            self.stats.pushed_back += 1
            delay_s = self._server.push_back_delay_s(job.pushed_back)
            self._backlog.later(job, self._clock() + delay_s)
        if job.pushed_back == 1:
            log.info(
                "server %s is full (%s): run %d item %d waits, up to %d requests out",
                self.config.server_name,
                reason,
                job.item.run_id,
                job.item.id,
                max(1, self._server.send_limit()),
                extra={"action": "back_pressure", "server": self.config.server_name},
            )

"""The window's intake: the room it holds for items before they are claimed, and the claimed
items it queues for its slots (a conversation's one at a time), under the window's one lock
(window_parts.py). The Celery push and the embedded pull both enter through admit().
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from app.ledger import claims
from workers.engine.window_parts import WindowGate
from workers.engine.window_types import Admitted, Job


class Admission(WindowGate):
    """Room held, items claimed into it, and jobs queued for the slots."""

    def capacity(self) -> int:
        """Items this window takes: the in-flight slots plus the backlog."""
        with self._cond:
            return self._room.capacity()

    def wait_for_room(self, n: int, timeout_s: float | None = None) -> bool:
        """Block until n more items fit in the window (backpressure on the message consumer)."""
        n = min(n, self.capacity())
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._cond:
            while self._room.free() < n:
                if self._stopping.is_set():
                    return False
                self._hedges.make_room(n - self._room.free())
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(timeout=0.5 if remaining is None else min(0.5, remaining))
            return True

    def admit(
        self,
        units: int,
        claim: Callable[[int], list[claims.ClaimedItem]],
        *,
        timeout_s: float = 0.0,
        conversations: bool = False,
    ) -> Admitted:
        """The one way work enters this window, for the Celery push and the embedded pull
        alike: hold room for up to `units` units (a conversation is one unit; wait up to
        timeout_s for a worthwhile share, as much as fits after it), ask `claim(held)` for the
        items to send in that room, submit them and give back the room they do not take.

        Returns the units held and the items sent. Held is 0 when there is no room, the
        server is paused or unavailable, or the window is stopping: then claim is not called.
        If claim raises, the room is given back and the error propagates (the leases it may
        have taken come back by expiry or reconcile). `conversations`: the units are
        `--turns each` conversations, so the window keeps one waiting in its backlog."""
        if conversations:
            with self._cond:
                self._room.serves_conversations = True
        held = self._reserve(units, timeout_s)
        if not held:
            return Admitted(0, [])
        if self._server.unavailable() or self._server.paused():
            self._unreserve(held)
            return Admitted(0, [])
        try:
            claimed = claim(held)
            taken = self.units(claimed)
            if taken > held:
                raise ValueError(f"claimed {taken} units of room, {held} were held")
        except BaseException:
            self._unreserve(held)
            raise
        self._unreserve(held - taken)
        self._submit(claimed, reserved=True)
        return Admitted(held, claimed)

    def _reserve(self, n: int, timeout_s: float) -> int:
        """Hold room for up to n items before claiming them: wait up to timeout_s until a
        worthwhile share fits (all n, or a full backlog's worth), then hold what fits; after
        the wait, whatever fits (maybe 0; 0 when stopping). The caller claims that many ids
        and hands the rest back unclaimed, so no claimed item waits here for a slot while
        another server could run it. admit() settles it."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while not self._stopping.is_set():
                backlog = self._room.backlog_limit()
                room = self._room.free()
                if room >= min(n, backlog) or self._clock() >= deadline:
                    break
                self._hedges.make_room(min(n, backlog) - room)
                self._cond.wait(timeout=min(0.5, max(0.0, deadline - self._clock())))
            if self._stopping.is_set():
                return 0
            held = max(0, min(n, self._room.free()))
            self._room.take(held)
            return held

    def room(self) -> int:
        with self._cond:
            return max(0, self._room.free())

    def units(self, claimed: list[claims.ClaimedItem]) -> int:
        """The room these items take: one per conversation, one per other item."""
        groups = {self.policy.group_of(c.run_id, c.item_key) for c in claimed}
        singles = sum(1 for c in claimed if self.policy.group_of(c.run_id, c.item_key) is None)
        return singles + len(groups - {None})

    def submit(self, claimed: list[claims.ClaimedItem]) -> None:
        """Queue items claimed without admit() (after wait_for_room) for sending; each settles
        as done, failed or released."""
        self._submit(claimed, reserved=False)

    def _submit(self, claimed: list[claims.ClaimedItem], *, reserved: bool) -> None:
        """Queue claimed items for sending. reserved=True: their room was taken by _reserve()
        (exactly units(claimed) of it).

        The items of one conversation go out one at a time, shortest first: the next when
        the one before it settles (see Conversations), so each finds its history cached."""
        if not claimed:
            return
        jobs = [
            Job(
                item=c,
                policy=self.policy.kind_policy(c.run_id),
                group=self.policy.group_of(c.run_id, c.item_key),
                priority=self.policy.request_priority(c.run_id),
            )
            for c in claimed
        ]
        by_group: dict[Hashable, list[Job]] = {}
        for job in jobs:
            if job.group is not None:
                by_group.setdefault(job.group, []).append(job)
        with self._cond:
            room = self._room
            room.serves_conversations = room.serves_conversations or bool(by_group)
            if not reserved:
                room.take(self.units(claimed))
            ready = [j for j in jobs if j.group is None]
            for key, members in by_group.items():
                head = self._groups.admit(key, members)
                if head is None:
                    room.give(1)  # rides on the head its conversation has out
                else:
                    ready.append(head)
            # real work never waits behind a hedge: as many hedges as items would wait for a
            # slot give theirs up (hedges already cancelled are on their way out)
            self._hedges.make_room(min(len(ready), room.waiting() - self._hedges.leaving()))
        for job in ready:
            self._backlog.put(job)

    def release_early(self) -> None:
        """Slots about to idle take the next items of conversations whose head is past its
        prefill (group_stagger_s), instead of waiting for the head to finish."""
        with self._cond:
            free = self.config.inflight - self.stats.inflight
            if free <= 0 or not self._backlog.empty() or self._stopping.is_set():
                return
            early = self._groups.early(self._clock(), self.config.group_stagger_s, free)
            self._room.take(len(early))
            for job in early:
                self._backlog.put(job)

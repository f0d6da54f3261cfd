"""Conversations in the in-flight window: the items of one `--turns each` conversation go to
the server one after another, shortest history first, so each finds the last one's prompt cached.

A plain data structure with no locking and no I/O; the window calls it under its own lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

Job = TypeVar("Job")


@dataclass
class _Group(Generic[Job]):
    head: Job  # the item out last (queued for a slot or in flight)
    head_since: float | None  # when the head was sent; None while it waits for a slot
    held: deque[Job]


class Conversations(Generic[Job]):
    """Held successors by group key. A group takes one unit of the window's room: its head;
    the rest ride along until the head settles (or, when a slot would idle, until the head has
    been out long enough to be past its prefill)."""

    def __init__(self, order: Callable[[Job], tuple[int, ...]]) -> None:
        self._order = order  # shortest history first
        self._groups: dict[Hashable, _Group[Job]] = {}

    @property
    def held(self) -> int:
        """Successors waiting for their turn."""
        return sum(len(g.held) for g in self._groups.values())

    def admit(self, key: Hashable, jobs: Iterable[Job]) -> Job | None:
        """Take a group's newly claimed jobs; return the one to send now (the new head), or
        None when the group already has a head out (the jobs join its successors)."""
        ordered = sorted(jobs, key=self._order)
        group = self._groups.get(key)
        if group is not None:
            group.held = deque(sorted([*group.held, *ordered], key=self._order))
            return None
        self._groups[key] = _Group(ordered[0], None, deque(ordered[1:]))
        return ordered[0]

    def sent(self, key: Hashable, job: Job, at: float) -> None:
        """The head went to the server at `at`."""
        group = self._groups.get(key)
        if group is not None and group.head is job:
            group.head_since = at

    def settled(self, key: Hashable, job: Job) -> Job | None:
        """job is finished (or given back): the group's next job, which becomes its head, or
        None (the group is done, or job was not its head: a successor already went early)."""
        group = self._groups.get(key)
        if group is None or group.head is not job:
            return None
        if not group.held:
            del self._groups[key]
            return None
        group.head, group.head_since = group.held.popleft(), None
        return group.head

    def early(self, now: float, after_s: float, limit: int) -> list[Job]:
        """Up to limit successors whose head has been out at least after_s (its prompt is
        cached by now): they become their group's head. For slots that would otherwise idle."""
        ready = [
            (since, key)
            for key, g in self._groups.items()
            if g.held and g.head_since is not None and (since := g.head_since) <= now - after_s
        ]
        ready.sort(key=lambda pair: pair[0])
        out: list[Job] = []
        for _, key in ready[:limit]:
            group = self._groups[key]
            group.head, group.head_since = group.held.popleft(), None
            out.append(group.head)
        return out

    def drop(self, key: Hashable) -> list[Job]:
        """Forget a group; return its held successors (to give back)."""
        group = self._groups.pop(key, None)
        return list(group.held) if group is not None else []

    def drop_all(self) -> list[Job]:
        """Forget every group; return all held successors (to give back)."""
        held = [job for g in self._groups.values() for job in g.held]
        self._groups.clear()
        return held

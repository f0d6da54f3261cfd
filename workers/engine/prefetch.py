"""The Celery prefetch of a worker follows its window: it reserves as many task messages as the
window's room takes (its slots and backlog over the batch size), between two and its threads.

A worker whose window shrank (a smaller server, more workers sharing it) then holds no messages
it cannot claim while other workers could; one whose window grows keeps every thread fed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

MIN_MESSAGES = 2  # one being claimed while the next is ready (and room for a control task)


def messages_for(capacity: int, batch_size: int, threads: int) -> int:
    """Task messages a worker reserves for a window taking capacity items."""
    wanted = math.ceil(max(1, capacity) / batch_size)
    return max(min(MIN_MESSAGES, threads), min(threads, wanted))


class Qos(Protocol):
    """kombu.common.QoS as Celery's consumer holds it (thread-safe; its loop applies it)."""

    value: int

    def increment_eventually(self, n: int = 1) -> int: ...

    def decrement_eventually(self, n: int = 1) -> int: ...


class PrefetchFollower:
    """Moves the consumer's prefetch count by the window's changes. It moves the count by
    differences, never sets it, so Celery's own steps (one more for each ETA message it holds,
    one less as it runs) stay as they are. A new QoS (the consumer started again after a broker
    reconnect) starts from Celery's count (threads x multiplier) and is moved from there."""

    def __init__(self, qos_of: Callable[[], Qos | None], *, celery_count: int) -> None:
        self._qos_of = qos_of
        self._celery_count = celery_count
        self._qos: Qos | None = None
        self._applied = celery_count
        self.count: int | None = None  # the count this follower last asked for

    def follow(self, messages: int) -> None:
        qos = self._qos_of()
        if qos is None:
            return
        if qos is not self._qos:
            self._qos, self._applied = qos, self._celery_count
        delta = messages - self._applied
        if delta > 0:
            qos.increment_eventually(delta)
        elif delta < 0:
            qos.decrement_eventually(-delta)
        self._applied = self.count = messages

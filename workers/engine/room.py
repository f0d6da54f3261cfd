"""The window's room and its in-flight map: how many claimed items the window holds against its
capacity (sized by the server's recent rate), and the requests out on the server, by item id.

Plain structures with no locking and no I/O: the window calls them under its own lock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from workers.engine.window_types import Job, WindowConfig

RATE_WINDOW_S = 30.0  # completions this far back set the server's rate (backlog_s)


class Room:
    """Claimed items held and not settled (outstanding), outcomes handed to the writer and not
    committed (unwritten), and the completions that size the backlog."""

    def __init__(self, config: WindowConfig, clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self._outstanding = 0
        self._unwritten = 0
        self._completions: deque[tuple[float, int]] = deque()  # (commit time, items finished)
        self._completed = 0  # sum of the counts in _completions
        # set once the window takes `--turns each` conversations (see backlog_limit)
        self.serves_conversations = False

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def take(self, n: int) -> None:
        """n more items (or conversations) held."""
        self._outstanding += n

    def give(self, n: int) -> None:
        """n held items settled or never sent after all."""
        self._outstanding -= n

    def handed_to_writer(self) -> None:
        """An outcome that settles a held item is on its way to the ledger."""
        self._unwritten += 1

    def committed(self, settled: int, ended: int) -> None:
        """A commit settled this many held items, ended (done or failed) of them."""
        if ended:
            self._completions.append((self._clock(), ended))
            self._completed += ended
        self._outstanding -= settled
        self._unwritten -= settled

    def idle(self) -> bool:
        return self._outstanding == 0 and self._unwritten == 0

    def backlog_limit(self) -> int:
        """Claimed items allowed to wait beyond the in-flight ones."""
        cfg = self._config
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
        """Items the window takes: the in-flight slots plus the backlog."""
        return self._config.inflight + self.backlog_limit()

    def free(self) -> int:
        """Room left (negative while more is held than fits now)."""
        return self.capacity() - self._outstanding

    def free_slots(self) -> int:
        """Slots no held item is meant for."""
        return self._config.inflight - self._outstanding

    def waiting(self) -> int:
        """Held items beyond the slots: those that wait for one."""
        return self._outstanding - self._config.inflight


class InFlight:
    """The requests this window has out on its server, by item id (hedges are kept apart)."""

    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}

    def add(self, job: Job) -> None:
        self._jobs[job.item.id] = job

    def remove(self, job: Job) -> None:
        self._jobs.pop(job.item.id, None)

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

"""Whether this worker's server refuses what it should serve: its refusals that can depend on
the server (app.core.errors.ServerRefusal of items within the run's pinned limits) counted
over a sliding window, distinct items only. Many of them (FAILING_ITEMS within FAILING_WINDOW_S)
and the server is failing: its worker pauses it, and gives back what it refuses meanwhile."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Final

# distinct items refused within the window that make a server failing: at most this many fail
# on a server that is alone (each is final at once: no other server can confirm it)
FAILING_ITEMS: Final = 10
FAILING_WINDOW_S: Final = 300.0


class Streak(Enum):
    """What one more refusal makes of the server."""

    COUNTED = "counted"  # fewer than FAILING_ITEMS distinct items in the window
    FAILING = "failing"  # this refusal made it failing: the server is to be paused
    PAUSED = "paused"  # it was failing already: the item goes back, it never fails here


class FailingWatch:
    """The refusals of one server within the window; failing until reset() (a resume)."""

    def __init__(
        self,
        *,
        items: int = FAILING_ITEMS,
        window_s: float = FAILING_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._items = items
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._refused: deque[tuple[float, int]] = deque()  # (when, item id), oldest first
        self._failing = False

    def refused(self, item_id: int) -> Streak:
        """Count a refusal of item_id; what the server is now."""
        with self._lock:
            if self._failing:
                return Streak.PAUSED
            now = self._clock()
            while self._refused and self._refused[0][0] < now - self._window_s:
                self._refused.popleft()
            self._refused.append((now, item_id))
            if len({i for _, i in self._refused}) < self._items:
                return Streak.COUNTED
            self._failing = True
            return Streak.FAILING

    @property
    def failing(self) -> bool:
        return self._failing

    def reset(self) -> None:
        """The server was resumed (fixed): count afresh."""
        with self._lock:
            self._refused.clear()
            self._failing = False

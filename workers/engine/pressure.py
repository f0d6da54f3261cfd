"""Back-pressure of one server: how many requests the window may have out to it after the
server said it is full ("The request queue is full.", a gateway's 429), and how long a pushed
back request waits before it goes out again.

Halved on each push-back (never below one), grown by one per answered request back to the
window's size: the window shrinks for that server only, and the items spend no attempt.
Plain state, guarded by the window's lock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pressure:
    size: int  # the window's own size (autowin may set it); the limit never exceeds it
    backoff_s: float
    backoff_max_s: float
    limit: float = 0.0  # 0: no push-back seen, the window's size holds
    pushed_back: int = 0

    def allows(self, inflight: int) -> bool:
        """Whether one more request may go out with inflight already out."""
        return self.limit <= 0 or inflight < int(self.limit)

    def push_back(self, inflight: int) -> None:
        """The server refused a request as full while inflight were out (that one included)."""
        self.pushed_back += 1
        current = self.limit if self.limit > 0 else float(self.size)
        self.limit = max(1.0, min(current, float(inflight)) / 2)

    def answered(self) -> None:
        """A request was served: the limit grows back towards the window's size."""
        if self.limit <= 0:
            return
        self.limit += 1.0
        if self.limit >= self.size:
            self.limit = 0.0

    def delay_s(self, times: int) -> float:
        """The wait before a request pushed back `times` times in a row goes out again."""
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** max(0, times - 1))

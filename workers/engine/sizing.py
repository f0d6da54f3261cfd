"""The auto-sized window's arithmetic: the server's target in flight (its running batch plus a
queue margin), each worker's share of it, and how the server's load moves the target.

Plain logic with no I/O and no clock: workers/engine/autosize.py feeds it what it reads.

The target is the whole server's (every worker on it computes the same one from the same
readings); a worker keeps its share. It starts at capacity + margin, the most it ever is: a
finished request's slot is refilled from the server's own queue before its next step. From
`/v1/loads`:

- requests queue on the server while its batch has free slots: the KV pool binds before
  max_running (long prompts or outputs). The window stops growing; past twice the margin
  queued it shrinks to what runs plus the margin (never below half at once).
- running below capacity and nothing queued: the window grows by the margin, up to its top.
- anything else (the batch full, a queue within the margin): it holds.

A change needs the same reading twice in a row (hysteresis), so one noisy probe never moves it.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.sglang.capacity import Capacity, Load

MARGIN_FRACTION = 16  # the queue margin: 1/16 of the running batch ...
MIN_MARGIN = 4  # ... and at least this many requests
CONFIRMATIONS = 2  # readings in a row that a grow or shrink needs

REASON_CAPACITY = "capacity"  # sized from /server_info (start, a restart, a new worker)
REASON_KV_BOUND = "kv-bound"  # requests queue while slots are free: the KV pool binds
REASON_ROOM = "room"  # slots idle and nothing queued: grown back
REASON_WORKERS = "workers"  # a worker joined or left the server: the shares moved
REASON_FIXED = "fixed"  # TOKENMILL_INFLIGHT is a number


def margin_for(max_running: int) -> int:
    """Requests kept queued beyond the running batch."""
    return max(MIN_MARGIN, max_running // MARGIN_FRACTION)


def top_for(capacity: Capacity) -> int:
    """The most the server's window holds: its batch plus the margin."""
    return capacity.max_running + margin_for(capacity.max_running)


def share(target: int, peers: list[str], me: str) -> int:
    """This worker's part of the server's target: the target split evenly among the workers
    serving it (peers, with or without me), the remainder to the first names, so the
    shares add up to the target exactly. At least 1."""
    names = sorted({*peers, me})
    base, extra = divmod(target, len(names))
    return max(1, base + (1 if names.index(me) < extra else 0))


@dataclass(frozen=True)
class Decision:
    """A new target for the server's window and why."""

    target: int
    reason: str


class Controller:
    """The server's target in flight, moved by its load readings with hysteresis."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.top = top_for(capacity)
        self.margin = margin_for(capacity.max_running)
        self.target = self.top
        self._pending: str | None = None  # the direction last seen, not yet confirmed
        self._seen = 0

    def observe(self, load: Load) -> Decision | None:
        """The new target when this reading (confirmed) moves it; None when it holds."""
        cap = self.capacity.max_running
        if load.waiting > 0 and load.running < cap:
            direction = "shrink" if load.waiting > 2 * self.margin else "hold"
        elif load.waiting == 0 and load.running < cap and self.target < self.top:
            direction = "grow"
        else:
            direction = "hold"
        if direction == "hold":
            self._pending, self._seen = None, 0
            return None
        if direction != self._pending:
            self._pending, self._seen = direction, 0
        self._seen += 1
        if self._seen < CONFIRMATIONS:
            return None
        self._pending, self._seen = None, 0
        if direction == "grow":
            new, reason = min(self.top, self.target + self.margin), REASON_ROOM
        else:
            floor = max(1, self.target // 2)
            new, reason = max(floor, load.running + self.margin), REASON_KV_BOUND
            new = min(new, self.target)
        if new == self.target:
            return None
        self.target = new
        return Decision(new, reason)

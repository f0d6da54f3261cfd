"""The structures an in-flight window shares with its gates (window_intake.Admission,
window_hedges.HedgeGate, window_refusals.Refusals): its one lock and what it guards. The
window makes them; each gate works on them under that lock, so they keep one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from workers.engine.backlog import Backlog
from workers.engine.groups import Conversations
from workers.engine.hedging import Hedges
from workers.engine.room import InFlight, Room
from workers.engine.server_state import ServerState
from workers.engine.window_types import Job, RunPolicy, WindowConfig, WindowStats
from workers.engine.writer import ResultWriter


@dataclass(frozen=True)
class WindowParts:
    """The window's lock (cond) and the structures it guards, for its gates."""

    config: WindowConfig
    policy: RunPolicy
    server: ServerState
    clock: Callable[[], float]
    cond: threading.Condition
    room: Room
    sending: InFlight
    groups: Conversations[Job]
    backlog: Backlog
    hedges: Hedges
    stats: WindowStats
    stopping: threading.Event
    writer: ResultWriter


class WindowGate:
    """A gate of the window: its methods take the window's lock themselves."""

    def __init__(self, parts: WindowParts) -> None:
        self.config = parts.config
        self.policy = parts.policy
        self._server = parts.server
        self._clock = parts.clock
        self._cond = parts.cond
        self._room = parts.room
        self._sending = parts.sending
        self._groups = parts.groups
        self._backlog = parts.backlog
        self._hedges = parts.hedges
        self.stats = parts.stats
        self._stopping = parts.stopping
        self._writer = parts.writer

    def _unreserve(self, n: int) -> None:
        """Give back room reserved for items that were not submitted after all."""
        if n <= 0:
            return
        with self._cond:
            self._room.give(n)
            self._cond.notify_all()

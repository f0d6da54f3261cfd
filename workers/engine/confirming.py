"""What a refusal by this worker's server means when it can depend on the server (a 400 about
its limits, its tokenizer or vocabulary: app.core.errors.ServerRefusal): the item's own failure
(over the limits its run pinned), final (another server refused it too, or no other server of
the run can take it), or given back for another server's verdict with no attempt spent. And
the server that refuses many items is paused as failing (failing.FailingWatch)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from sqlalchemy import Engine

from app.core.errors import ServerRefusal
from app.ledger import claims, event_log, registry
from app.sglang import limits
from app.sglang.limits import RequestNeed
from workers.control.health import Health
from workers.engine.failing import FailingWatch, Streak
from workers.engine.run_pins import RunPins
from workers.engine.window_types import Verdict

log = logging.getLogger(__name__)

# how long the list of the other servers that may take a run's items is kept
OTHERS_TTL_S: Final = 5.0
# the states of a server that takes work
_SERVING = frozenset({Health.HEALTHY.value, Health.SUSPECT.value, Health.UNKNOWN.value})


class OtherServers:
    """The other servers of the fleet that may take a run's items now: registered with a
    worker, not paused, not found down, bound to the run (if it is bound), and not refusing
    it (its fingerprint or limits); read at most every OTHERS_TTL_S."""

    def __init__(
        self,
        db: Engine,
        server_name: str,
        pins: RunPins,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self._server_name = server_name
        self._pins = pins
        self._clock = clock
        self._lock = threading.Lock()
        self._read: dict[int, tuple[float, list[str]]] = {}

    def of_run(self, run_id: int) -> list[str]:
        with self._lock:
            at, names = self._read.get(run_id, (-1e9, []))
        if self._clock() - at < OTHERS_TTL_S:
            return names
        run = self._pins.run_info(run_id)
        with self._db.connect() as conn:
            servers = registry.list_servers(conn)
            refusing = event_log.runs_refused(conn, [run_id])
        names = sorted(
            s.name
            for s in servers
            if s.name != self._server_name
            and s.workers
            and not s.paused
            and s.state in _SERVING
            and run.served_by(s.name)
            and run_id not in refusing.get(s.name, {})
        )
        with self._lock:
            self._read[run_id] = (self._clock(), names)
        return names


class Confirmation:
    """The verdict on each refusal of this server that can depend on the server; on_failing
    is called once, with the error, when the server turns failing (the caller pauses it)."""

    def __init__(
        self,
        server_name: str,
        pins: RunPins,
        others: OtherServers,
        *,
        on_failing: Callable[[str], None],
        watch: FailingWatch | None = None,
    ) -> None:
        self._server_name = server_name
        self._pins = pins
        self._others = others
        self._on_failing = on_failing
        self.watch = watch or FailingWatch()

    def verdict(self, item: claims.ClaimedItem, error: ServerRefusal, need: RequestNeed) -> Verdict:
        own = limits.refusal(self._pins.pinned_limits(item.run_id), need)
        if own is not None:  # over the limits the run pinned: every server of it refuses it
            return Verdict(True, f" (the item's own: past the run's pinned limits, {own})")
        confirms = item.refused_by is not None and item.refused_by != self._server_name
        streak = Streak.COUNTED if confirms else self.watch.refused(item.id)
        if streak is Streak.PAUSED:
            return Verdict(False, f"{self._server_name} is paused as failing", refused=False)
        if streak is Streak.FAILING:
            self._on_failing(str(error))
        if confirms:
            return Verdict(True, f" (refused by {item.refused_by} too)")
        if self._others.of_run(item.run_id):
            return Verdict(False, f"refused by {self._server_name}: {error}")
        return Verdict(True, " (no other server of the run to confirm it)")

"""The sizer of one worker's window: a fixed TOKENMILL_INFLIGHT, or `auto`, sized by the
server's capacity (`/server_info`) and kept full from its load (`/v1/loads`).

Its own thread, its own client and its own ledger connections: every `probe_s` it reads the
server's load (one small GET), moves the server's target (workers/engine/sizing.py), and
resizes the window to this worker's share of it. It reads the capacity at start, when the
runtime re-reads the fingerprint (a restart, a weight update), and when the load reports
another max_running than it knew. Every few seconds it writes its row of `server_windows`:
the workers of one server count each other there, and `tokenmill servers` shows the rows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Protocol

from sqlalchemy import Connection, Engine

from app.core.constants import EVENT_WINDOW_RESIZED
from app.core.errors import GenerationError
from app.core.settings import Settings
from app.ledger import common, event_log, registry, windows
from app.sglang.capacity import Capacity, Load
from workers.engine import sizing
from workers.engine.server_state import ServerState

log = logging.getLogger(__name__)

START_WINDOW = 64  # auto, before the server's capacity is known (the server may be loading)
RECORD_S = 5.0  # how often a worker writes its row of server_windows
EVENT_EVERY_S = 60.0  # load-driven resizes reach the timeline at most this often per worker


class CapacityClient(Protocol):
    def capacity(self) -> Capacity | None: ...

    def loads(self) -> Load | None: ...

    def close(self) -> None: ...


class Resizable(Protocol):
    @property
    def server_state(self) -> ServerState:
        """The server's state: while it refuses our key the probe alone asks it (once a
        second)."""

    def resize(self, inflight: int, backlog: int) -> int: ...


def backlog_for(settings: Settings, inflight: int) -> int:
    """Claimed items allowed to wait beyond the in-flight ones, for a window of inflight."""
    return max(settings.batch_size, inflight // 4)


def start_size(settings: Settings) -> int:
    """The window a worker starts with: the fixed number, or START_WINDOW for auto."""
    return START_WINDOW if settings.inflight == "auto" else settings.inflight


class WindowSizer:
    """Keeps one window at its size: fixed, or this worker's share of the server's target."""

    def __init__(
        self,
        settings: Settings,
        window: Resizable,
        *,
        db: Engine,
        server_name: str,
        owner: str,
        client_factory: Callable[[], CapacityClient],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._window = window
        self._db = db
        self.server_name = server_name
        self.owner = owner
        self._client_factory = client_factory
        self._clock = clock
        self.auto = settings.inflight == "auto"
        self.size = start_size(settings)
        self.capacity: Capacity | None = None
        self.controller: sizing.Controller | None = None
        self.load: Load | None = None
        self.loads_at: datetime | None = None  # when self.load was read
        self.has_loads: bool | None = None  # None: not asked yet
        self.reason = "start" if self.auto else sizing.REASON_FIXED
        self.changed_at = common.utcnow()
        self.peers: list[str] = [owner]
        self._started_at = clock()
        self._recorded_at = -1e9
        self._evented_at = -1e9
        self._unreported = 0  # load-driven resizes kept out of the timeline since the last
        self._reread = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: CapacityClient | None = None
        # told the items the window takes (slots + backlog) every round: the Celery prefetch
        self._followers: list[Callable[[int], None]] = []

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._loop, name=f"tm-sizer-{self.server_name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        if self._client is not None:
            self._client.close()
        try:
            with self._db.begin() as conn:
                windows.drop_window(conn, self.server_name, self.owner)
        except Exception as exc:
            log.warning(
                "could not drop the window row of %s (%s)",
                self.server_name,
                exc,
                extra={"action": "window_row_failed"},
            )

    def follow(self, follower: Callable[[int], None]) -> None:
        """Tell follower the items the window takes (its slots and backlog) now, after every
        resize and every round (so a follower that lost its state catches up)."""
        self._followers.append(follower)
        follower(self.taken())

    def taken(self) -> int:
        """The items the window takes at its size: its slots and its backlog."""
        return self.size + backlog_for(self._settings, self.size)

    def _tell_followers(self) -> None:
        for follower in self._followers:
            try:
                follower(self.taken())
            except Exception:
                log.exception(
                    "a follower of the window of %s failed",
                    self.server_name,
                    extra={"action": "window_follower_failed"},
                )

    def reread(self) -> None:
        """Read the server's capacity again before the next load reading (the runtime read
        its fingerprint again: it restarted, or took new weights)."""
        self._reread.set()

    def _loop(self) -> None:
        interval = self._settings.autosize_probe_s if self.auto else RECORD_S
        while not self._stopping.is_set():
            try:
                self.tick()
            except Exception:
                log.exception(
                    "window sizer of %s failed a round",
                    self.server_name,
                    extra={"action": "sizer_failed"},
                )
            self._stopping.wait(interval)

    # --- one round ------------------------------------------------------------------------

    def tick(self) -> None:
        """Read what is due (the capacity, the load), resize, and write this worker's row."""
        if self.auto:
            self._size_auto()
        now = self._clock()
        if now - self._recorded_at >= RECORD_S:
            self._recorded_at = now
            if self.auto and self.controller is not None:
                # a worker joined or left the server: the shares move (this writes the row)
                self._apply(self.controller.target, sizing.REASON_WORKERS)
            else:
                self._record()
        self._tell_followers()

    def _client_now(self) -> CapacityClient:
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    def _size_auto(self) -> None:
        if self._window.server_state.key_refused is not None:
            return  # a server that wants a key is asked by its probe only, at its rate
        if self.capacity is None or self._reread.is_set():
            self._reread.clear()
            try:
                capacity = self._client_now().capacity()
            except GenerationError as exc:
                log.debug("capacity of %s unreadable now (%s)", self.server_name, exc)
                self._reread.set()  # try again next round
                return
            if capacity is not None:
                self._take_capacity(capacity)
        if self.controller is None:
            return
        load = self._read_load()
        if load is None:
            return
        if (
            load.max_running is not None
            and load.max_running != self.controller.capacity.max_running
        ):
            self._reread.set()  # a restart with other limits: size by /server_info next round
            return
        decision = self.controller.observe(load)
        if decision is not None:
            self._apply(decision.target, decision.reason)

    def _read_load(self) -> Load | None:
        if self.has_loads is False:
            return None
        try:
            load = self._client_now().loads()
        except GenerationError as exc:
            log.debug("load of %s unreadable now (%s)", self.server_name, exc)
            self._reread.set()  # it may be restarting: its limits may change
            return None
        if load is None:
            if self.has_loads is None:
                log.info(
                    "%s has no /v1/loads: its window is sized by /server_info",
                    self.server_name,
                    extra={"action": "sized_by_server_info"},
                )
            self.has_loads = False
            return None
        self.has_loads = True
        self.load = load
        self.loads_at = common.utcnow()
        return load

    def _take_capacity(self, capacity: Capacity) -> None:
        if self.capacity == capacity and self.controller is not None:
            self._apply(self.controller.target, self.reason)  # the peers may have changed
            return
        self.capacity = capacity
        self.controller = sizing.Controller(capacity)
        self.has_loads = None  # a restarted server may have another version
        self._apply(self.controller.target, sizing.REASON_CAPACITY)

    def _apply(self, target: int, reason: str) -> None:
        """Resize the window to this worker's share of target."""
        self._refresh_peers()
        size = sizing.share(target, self.peers, self.owner)
        before = self._window.resize(size, backlog_for(self._settings, size))
        if before == size:
            return
        self.size = size
        self.reason = reason
        self.changed_at = common.utcnow()
        log.info(
            "window of %s auto-sized %d -> %d (%s; server target %d, %d workers)",
            self.server_name,
            before,
            size,
            reason,
            target,
            len(self.peers),
            extra={"action": "window_resized", "server": self.server_name},
        )
        self._record()  # the row shows the new size at once
        self._event(before, size, target, reason)
        self._tell_followers()

    def _refresh_peers(self) -> None:
        """The workers sharing the server: fresh rows of server_windows, and while this worker
        is new (the others may not have written theirs yet) at least the registry's count."""
        try:
            with self._db.begin() as conn:
                self._write_row(conn)
                self._recorded_at = self._clock()
                owners = windows.sharing_owners(conn, self.server_name, fresh_s=windows.FRESH_S)
                registered = 0
                if self._clock() - self._started_at < windows.FRESH_S:
                    server = registry.find_server(conn, self.server_name)
                    registered = len(server.workers) if server is not None else 0
        except Exception as exc:  # a busy ledger: the shares stay as they were until next round
            log.debug("could not read the workers of %s (%s)", self.server_name, exc)
            return
        peers = sorted({*owners, self.owner})
        # unknown workers of the registry stand in as placeholders until their rows appear
        missing = max(0, registered - len(peers))
        self.peers = peers + [f"~{i}" for i in range(missing)]

    def _event(self, before: int, size: int, target: int, reason: str) -> None:
        """The resize on the timeline: every capacity change, load-driven ones at most once
        every EVENT_EVERY_S (the message counts those left out)."""
        now = self._clock()
        if reason != sizing.REASON_CAPACITY and now - self._evented_at < EVENT_EVERY_S:
            self._unreported += 1
            return
        self._evented_at = now
        skipped = f" ({self._unreported} earlier resizes not listed)" if self._unreported else ""
        self._unreported = 0
        cap = self.capacity
        message = (
            f"{self.server_name}: window {before} -> {size} ({reason}; server target {target}"
            f", max_running {cap.max_running if cap else '?'}, {len(self.peers)} workers){skipped}"
        )
        details = {
            "owner": self.owner,
            "before": before,
            "size": size,
            "target": target,
            "reason": reason,
            "workers": len(self.peers),
            "capacity": cap.to_json() if cap else None,
            "running": self.load.running if self.load else None,
            "queued": self.load.waiting if self.load else None,
        }
        try:
            with self._db.begin() as conn:
                event_log.record_event(
                    conn, EVENT_WINDOW_RESIZED, message, server=self.server_name, details=details
                )
        except Exception as exc:
            log.warning(
                "could not record the resize of %s (%s)",
                self.server_name,
                exc,
                extra={"action": "resize_record_failed"},
            )

    def describe(self) -> str:
        """This worker's window as each generate task's result carries it (Flower shows it):
        `auto: 272 (max_running 256) · running 256 · queued 16 · kv-bound`, `fixed: 64`."""
        cap = self.capacity
        text = f"{'auto' if self.auto else 'fixed'}: {self.size}"
        if cap is not None and cap.max_running:
            text += f" (max_running {cap.max_running})"
        facts = []
        if self.load is not None:
            facts += [f"running {self.load.running}", f"queued {self.load.waiting}"]
        if self.auto and self.reason:
            facts.append(self.reason)
        return " · ".join([text, *facts])

    def _record(self) -> None:
        try:
            with self._db.begin() as conn:
                self._write_row(conn)
        except Exception as exc:  # written again next round
            log.debug("could not write the window row of %s (%s)", self.server_name, exc)

    def _write_row(self, conn: Connection) -> None:
        cap = self.capacity
        windows.record_window(
            conn,
            windows.WindowRow(
                server=self.server_name,
                owner=self.owner,
                mode="auto" if self.auto else "fixed",
                size=self.size,
                max_running=cap.max_running if cap else None,
                max_total_tokens=cap.max_total_tokens if cap else None,
                running=self.load.running if self.load else None,
                queued=self.load.waiting if self.load else None,
                reason=self.reason,
                changed_at=self.changed_at,
                loads_at=self.loads_at if self.load else None,
            ),
        )

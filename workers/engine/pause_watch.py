"""The pause of one worker's server: its durable pause flag in the registry, read at most once
a second, and the worker's own pause (a reason on its ServerState) when it found token drift
on an image item, or its server failing, and the registry does not know it (`tokenmill run`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import Connection, Engine

from app.core.constants import (
    EVENT_IMAGE_DRIFT,
    PAUSED_BY_FAILING,
    PAUSED_BY_IMAGES,
    PauseReason,
)
from app.ledger import event_log, registry
from workers.control.pausing import CeleryControl, pause_server
from workers.engine.server_state import ServerState

log = logging.getLogger(__name__)


class PauseWatch:
    """The pause state of one server as its worker sees it; on_resume is called when a pause
    is found lifted (the server's configuration may have changed meanwhile)."""

    def __init__(
        self,
        db: Engine,
        server_name: str,
        server: ServerState,
        *,
        on_resume: Callable[[], None],
    ) -> None:
        self.db = db
        self.server_name = server_name
        self._server = server
        self._on_resume = on_resume
        self._lock = threading.Lock()
        self._cache: tuple[float, bool, str | None] = (-1e9, False, None)
        # token drift on an image item was reported (the server paused) since the last resume
        self._drift_reported = False

    @property
    def local(self) -> str | None:
        """Why this worker stopped sending on its own (token drift, unregistered server)."""
        return self._server.pause_reason

    def state(self, *, max_age_s: float = 1.0) -> tuple[bool, str | None]:
        """(paused, who paused it) from the ledger; on a read error the last known value."""
        now = time.monotonic()
        at, paused, by = self._cache
        if now - at < max_age_s:
            return paused, by
        was_paused = paused
        try:
            with self.db.connect() as conn:
                paused, by = registry.pause_flag(conn, self.server_name)
        except Exception as exc:
            log.warning(
                "could not read the pause flag of %s (%s)",
                self.server_name,
                exc,
                extra={"action": "pause_flag_unreadable"},
            )
        self._cache = (now, paused, by)
        if was_paused and not paused:
            self._on_resume()
            self._drift_reported = False
        return paused, by

    def reread(self) -> None:
        """Read the flag again on next use (this worker may just have paused the server)."""
        self._cache = (-1e9, False, None)

    def failing(self, error: str) -> None:
        """The server refuses what it should serve (workers.engine.failing): pause it, in the
        registry (or on its own when the registry has no such server), with the reason
        `failing: <error>`, and say the command that resumes it once it is fixed."""
        reason = f"failing: {error}"
        log.warning(
            "server %s refuses what the other servers serve: paused (%s); once it is fixed: %s",
            self.server_name,
            reason,
            f"tokenmill resume --server {self.server_name}",
            extra={"action": "server_failing", "server": self.server_name},
        )
        self._pause(PAUSED_BY_FAILING, reason, lambda conn: None)

    def image_drift(self, run_id: int, run_name: str, item_id: int, difference: str) -> str:
        """Once until the server is resumed: record the drift and pause the server (in the
        registry, or on its own when the registry has no such server); the refusal."""
        refusal = f"token drift: {difference}"
        with self._lock:
            first = not self._drift_reported
            self._drift_reported = True
        if not first:
            return refusal
        reason = f"token drift on run {run_name} item {item_id}: {difference}"
        log.warning("server %s: %s", self.server_name, reason, extra={"action": "token_drift"})

        def record(conn: Connection) -> None:
            event_log.record_event(
                conn,
                EVENT_IMAGE_DRIFT,
                f"{self.server_name}: {reason}",
                run_id=run_id,
                server=self.server_name,
                details={"item_id": item_id, "difference": difference},
            )

        self._pause(PAUSED_BY_IMAGES, reason, record)
        return refusal

    def _pause(self, by: PauseReason, reason: str, record: Callable[[Connection], None]) -> None:
        """Record what happened (record, in the transaction that looks the server up) and
        pause the server: in the registry, or on its own when the registry has no such server
        or cannot be written (this worker stops sending at least)."""
        try:
            with self.db.begin() as conn:
                record(conn)
                registered = registry.find_server(conn, self.server_name) is not None
            if registered:
                pause_server(self.db, CeleryControl(), self.server_name, by=by, reason=reason)
            else:
                self._server.pause(reason)
        except Exception:
            log.exception(
                "could not pause %s (%s)",
                self.server_name,
                reason,
                extra={"action": "pause_failed"},
            )
            self._server.pause(reason)
        self.reread()

"""Permanent failures made visible without a line per item: a WARNING and an `item_failed`
event for the first failure of a reason in a run, then one of each per interval with the count.

At 100K items a cause that fails them all (a wrong storage URL, a context length) gives a
line and an event a minute per worker and reason, not 100K of each. A sum counts only the
items still failed when it is reported: those `tokenmill retry` put back since are left out
(a sum with none left is not reported). Runs are named by name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine

from app.core.constants import EVENT_ITEM_FAILED
from app.core.failures import failure_reason
from app.ledger import event_log, retries, run_queries

log = logging.getLogger(__name__)

# how long the failures of one reason are summed before they are reported again
DIGEST_INTERVAL_S = 60.0
# item ids an event names, of the failures it sums
EXAMPLE_IDS = 5


@dataclass
class _Tally:
    since: float
    item_ids: list[int] = field(default_factory=list)  # every failure summed, not yet reported


@dataclass(frozen=True)
class _Report:
    run_id: int
    reason: str
    count: int
    item_ids: list[int]
    error: str | None  # the first failure's own error (the reason drops its details)
    interval_s: float | None


class FailureDigest:
    """Counts one worker's permanent failures per (run, reason) and reports them: the first at
    once, the rest summed once per interval (a thread of its own; stop() reports the rest)."""

    def __init__(
        self,
        db: Engine,
        server: str,
        *,
        interval_s: float = DIGEST_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self._server = server
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tallies: dict[tuple[int, str], _Tally] = {}
        self._names: dict[int, str] = {}  # run id → name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="tm-failures", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self.flush(everything=True)

    def add(self, run_id: int, item_id: int, error: str) -> None:
        """An item of run_id failed for good with error (called as the failure is settled)."""
        reason = failure_reason(error)
        key = (run_id, reason)
        with self._lock:
            tally = self._tallies.get(key)
            if tally is not None:
                tally.item_ids.append(item_id)
                return
            self._tallies[key] = _Tally(since=self._clock())
        self._report(_Report(run_id, reason, 1, [item_id], error, None))

    def flush(self, *, everything: bool = False) -> None:
        """Report the sums whose interval is over (all of them with everything); a reason
        quiet for an interval is forgotten, so its next failure is reported at once."""
        now = self._clock()
        due: list[_Report] = []
        with self._lock:
            for key, tally in list(self._tallies.items()):
                if not everything and now - tally.since < self._interval_s:
                    continue
                if tally.item_ids:
                    run_id, reason = key
                    window = now - tally.since
                    ids = tally.item_ids
                    due.append(_Report(run_id, reason, len(ids), ids, None, window))
                    self._tallies[key] = _Tally(since=now)
                else:
                    del self._tallies[key]
        for report in due:
            kept = self._still_failed(report)
            if kept is not None:
                self._report(kept)

    def _still_failed(self, r: _Report) -> _Report | None:
        """The sum over the items still failed (None: a retry put them all back)."""
        try:
            with self._db.connect() as conn:
                ids = retries.still_failed(conn, r.item_ids)
        except Exception as exc:  # reported as summed: the ledger has the truth
            log.warning(
                "could not re-read summed failures (%s)", exc, extra={"action": "event_failed"}
            )
            ids = r.item_ids
        if not ids:
            return None
        return _Report(r.run_id, r.reason, len(ids), ids, None, r.interval_s)

    def _run_name(self, run_id: int) -> str:
        """The run's name for a message (its id only when it is gone)."""
        name = self._names.get(run_id)
        if name is None:
            try:
                with self._db.connect() as conn:
                    name = run_queries.run_name(conn, run_id)
            except Exception:  # named by id this once: the event still carries run_id
                return f"#{run_id}"
            if name is None:
                return f"#{run_id}"
            self._names[run_id] = name
        return name

    def _loop(self) -> None:
        while not self._stop.wait(min(self._interval_s, 5.0)):
            try:
                self.flush()
            except Exception:
                log.exception(
                    "reporting failures failed; the next interval tries again",
                    extra={"action": "failure_report_failed"},
                )

    def _report(self, r: _Report) -> None:
        fields = {"action": "item_failed", "run_id": r.run_id, "server": self._server}
        run = self._run_name(r.run_id)
        if r.interval_s is None:
            what = f"item {r.item_ids[0]} of run {run} failed on {self._server}"
            message = f"{what}: {r.error}"
        else:
            what = (
                f"{r.count} more items of run {run} failed on {self._server} in the "
                f"last {r.interval_s:.0f}s"
            )
            message = f"{what}: {r.reason}"
        log.warning(
            "%s",
            message,
            extra={**fields, "action": "item_failed", "reason": r.reason, "count": r.count},
        )
        details = {
            "reason": r.reason,
            "count": r.count,
            "items": r.item_ids[:EXAMPLE_IDS],
            "interval_s": None if r.interval_s is None else round(r.interval_s, 1),
        }
        try:
            with self._db.begin() as conn:
                event_log.record_event(
                    conn,
                    EVENT_ITEM_FAILED,
                    message,
                    run_id=r.run_id,
                    server=self._server,
                    details=details,
                )
        except Exception as exc:  # the failures themselves are in the ledger
            log.warning(
                "could not record an item_failed event (%s)", exc, extra={"action": "event_failed"}
            )

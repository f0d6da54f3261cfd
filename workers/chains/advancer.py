"""A worker's background turn advancer: the writer hands it the ids it just committed, and a
thread advances their chains off the hot path and publishes the turns it started.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from sqlalchemy import Engine

from workers.chains.advance import ADVANCE_PAGE, advance, publish_started
from workers.chains.tokenizers import TokenizerCache, shared_cache

log = logging.getLogger(__name__)


class TurnAdvancer:
    """A worker's background advancer: the writer hands it the ids it just committed, and it
    starts their next turns off the hot path, a batch at a time. A lost notification (killed
    worker) is caught up by reconcile."""

    def __init__(
        self,
        db: Engine,
        publish: Callable[[list[int]], None],
        cache: TokenizerCache | None = None,
    ) -> None:
        self._db = db
        self._publish = publish
        self._cache = cache or shared_cache()
        self._queue: queue.Queue[list[int] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._unprocessed = 0  # notifications not yet fully advanced
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tm-turns", daemon=True)
            self._thread.start()

    def notify(self, finished_ids: list[int]) -> None:
        """Items just committed as done or failed (cheap: a queue put)."""
        if finished_ids:
            with self._lock:
                self._unprocessed += 1
            self._queue.put(list(finished_ids))

    def idle(self) -> bool:
        with self._lock:
            return self._unprocessed == 0

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, stop, taken = list(first), False, 1
            while len(batch) < ADVANCE_PAGE:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.extend(more)
                taken += 1
            try:
                report = advance(self._db, self._cache, prev_ids=batch)
                publish_started(self._db, report.started, self._publish)
            except Exception:
                log.exception(
                    "advancing the turns after %d results failed; reconcile will",
                    len(batch),
                    extra={"action": "turns_advance_failed"},
                )
            finally:
                with self._lock:
                    self._unprocessed -= taken
            if stop:
                return

"""The window's group-commit result writer: one thread takes outcomes from a queue and commits
them to the ledger in small groups, retrying while the database is away and never dropping one."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from sqlalchemy import Engine
from sqlalchemy.exc import InterfaceError, OperationalError

from app.core.backoff import Backoff
from app.ledger import outcomes
from workers.engine.window_types import WindowConfig

log = logging.getLogger(__name__)

_STOP = object()
# the database is down or restarting: the waits between attempts to write a batch
WRITE_BACKOFF = Backoff(first_s=0.2, max_s=10.0)

# (outcome, settles) pairs just committed, and the ids the commit released
Written = Callable[[list[tuple[outcomes.Outcome, bool]], list[int]], None]


class ResultWriter:
    """Outcomes in, group commits out; the window settles its accounting in on_written."""

    def __init__(
        self, db: Engine, *, owner: str, config: WindowConfig, on_written: Written
    ) -> None:
        self._db = db
        self._owner = owner
        self._config = config  # lease_s, writer_batch, writer_linger_s
        self._on_written = on_written
        # (outcome, settles): settles=False for a late answer to an abandoned request
        self._outcomes: queue.Queue[tuple[outcomes.Outcome, bool] | object] = queue.Queue()

    def put(self, outcome: outcomes.Outcome, settles: bool) -> None:
        self._outcomes.put((outcome, settles))

    def stop(self) -> None:
        """End the loop once everything put before this is written."""
        self._outcomes.put(_STOP)

    def loop(self) -> None:
        stop = False
        while not stop:
            first = self._outcomes.get()
            if self._outcomes.qsize() < self._config.writer_batch // 4:
                # linger a moment so fast answers share one commit (a one-row commit costs
                # ~10x the CPU per item of a 64-row one); results wait milliseconds at most
                time.sleep(self._config.writer_linger_s)
            batch: list[tuple[outcomes.Outcome, bool]] = []
            if first is _STOP:
                stop = True
            else:
                batch.append(first)  # type: ignore[arg-type]
            while len(batch) < self._config.writer_batch:
                try:
                    more = self._outcomes.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                batch.append(more)  # type: ignore[arg-type]
            if batch:
                self._write(batch)

    def _write(self, entries: list[tuple[outcomes.Outcome, bool]]) -> None:
        batch = [outcome for outcome, _ in entries]
        delays = WRITE_BACKOFF.delays()
        while True:
            delay_s = next(delays)
            try:
                with self._db.begin() as conn:
                    released = outcomes.record_outcomes(
                        conn, batch, owner=self._owner, lease_s=self._config.lease_s
                    )
                break
            except (OperationalError, InterfaceError) as exc:
                # the database is down or restarting: hold the results and keep trying
                log.warning(
                    "writing %d outcomes failed (%s); retrying in %.1fs",
                    len(batch),
                    exc,
                    delay_s,
                    extra={"action": "write_failed"},
                )
            except Exception:
                # never drop a result; a bug here must be loud
                log.exception(
                    "writing %d outcomes failed; retrying in %.1fs",
                    len(batch),
                    delay_s,
                    extra={"action": "write_failed"},
                )
            time.sleep(delay_s)
        self._on_written(entries, released)

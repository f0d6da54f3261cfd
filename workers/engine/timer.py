"""The window's timer thread: every 50 ms it puts retries that are due back in the backlog,
lets idle slots take conversations' next items early, and runs the hedge round when it is time."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from app.ledger import outcomes
from workers.engine.backlog import Backlog
from workers.engine.window_types import Job, WindowConfig

log = logging.getLogger(__name__)

TICK_S = 0.05


class Timer:
    """The loop and when the next hedge round is due; the window hands it the steps."""

    def __init__(
        self,
        config: WindowConfig,
        backlog: Backlog,
        *,
        clock: Callable[[], float],
        stopping: threading.Event,
        release_early: Callable[[], None],
        hedge_round: Callable[[], None],
        settle: Callable[[outcomes.Outcome, Job], None],
    ) -> None:
        self._config = config
        self._backlog = backlog
        self._clock = clock
        self._stopping = stopping
        self._release_early = release_early
        self._hedge_round = hedge_round
        self._settle = settle

    def loop(self) -> None:
        next_hedge = self._clock()
        while not self._stopping.is_set():
            now = self._clock()
            for job in self._backlog.due(now):
                self._backlog.put(job)
            if self._config.group_stagger_s > 0:
                self._release_early()
            if self._config.hedge_interval_s > 0 and now >= next_hedge:
                next_hedge = now + self._config.hedge_interval_s
                try:
                    self._hedge_round()
                except Exception as exc:
                    log.warning(
                        "hedge round failed (%s); trying again",
                        exc,
                        extra={"action": "hedge_round_failed"},
                    )
            self._stopping.wait(TICK_S)
        # shutting down: delayed retries are given back, not sent
        for job in self._backlog.drop_delayed():
            self._settle(outcomes.Released(job.item.id, "worker shutting down"), job)

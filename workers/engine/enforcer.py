"""Worker-side enforcement of a server's pause flag, on a short timer: cancel or re-add this
worker's own consumer of the work queue, and give back requests stuck on a dead server. The
worker's own probes hold its consumer too: while the server drains, wants a key we lack, or
does not answer.

Covers a worker started after the pause, one that missed the broadcast, or a broker with no
remote control; the task checks the flag again right before it sends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from app.core.constants import PAUSED_BY_WATCHDOG
from workers.control.pausing import WorkerControl
from workers.engine.runtime import WorkerRuntime

log = logging.getLogger(__name__)


class PauseEnforcer:
    def __init__(
        self,
        rt: WorkerRuntime,
        worker: str,
        control: WorkerControl,
        interval_s: float,
        consuming_now: Callable[[], bool | None] = lambda: None,
    ) -> None:
        self.rt = rt
        self.consuming_now = consuming_now
        self.worker = worker
        self.control = control
        self.interval_s = interval_s
        self.consuming: bool | None = None  # unknown until the first check
        # whether the log last said the consumer stopped: one line per pause, however often
        # the cancel is sent again (a broadcast not yet applied) or the pause's reason changes
        # (the worker's own probe first, then the watchdog)
        self._said_paused = False
        self._abandoned = False
        self._lock = threading.Lock()  # its timer and the probe thread both check
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tm-pause-enforcer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def check(self) -> None:
        with self._lock:
            self._check()

    def _check(self) -> None:
        paused, by = self.rt.pauses.state(max_age_s=0.0)
        held = self.rt.server_state.held()
        if held is not None and not paused:
            # the worker's own probes hold its server (a drain, a refused key): it takes no
            # messages meanwhile, so they go to the other servers' workers
            paused, by = True, held
        actual = self.consuming_now()
        if actual is not None and actual != self.consuming:
            # someone else's cancel_consumer/add_consumer reached us: look at what is true
            self.consuming = actual
        if paused and self.consuming is not False:
            if not self._said_paused:
                log.warning(
                    "server %s is paused (%s): %s stops consuming",
                    self.rt.server_name,
                    by,
                    self.worker,
                    extra={"action": "consumer_paused"},
                )
                self._said_paused = True
            self.control.cancel_consumer([self.worker])
            self.consuming = False
        elif not paused and self.consuming is not True:
            if self.consuming is False:
                if self._said_paused:
                    log.warning(
                        "server %s resumed: %s consumes again",
                        self.rt.server_name,
                        self.worker,
                        extra={"action": "consumer_resumed"},
                    )
                    self._said_paused = False
                self.control.add_consumer([self.worker])
            self.consuming = True
        # a drained or key-refusing server keeps its requests out; a down or stalled one not
        finishing = self.rt.server_state.finishing()
        if paused and by == PAUSED_BY_WATCHDOG and not finishing and not self._abandoned:
            self.rt.window.abandon_inflight("server down or stalled (watchdog)")
            self._abandoned = True
        if not paused:
            self._abandoned = False

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:
                log.exception(
                    "pause check failed; trying again", extra={"action": "pause_check_failed"}
                )
            self._stop.wait(self.interval_s)

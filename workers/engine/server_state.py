"""The state of one server as its worker sees it: down, draining, gone a moment ago, a key
refused, back-pressure, paused. The one owner of those facts, under a lock of its own.

The probe (probes.py), the slots (through the window) and the pause watch change it only
through its methods; the feeders, the enforcer, the sizer and the embedded runner ask it.
A pause decided in this worker is a reason (a value, one per cause: token drift today), not
a flag per cause; the registry's durable pause flag is read through `registry_paused`.
Lock order: the window's lock may be held when this one is taken, never the reverse.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from workers.engine.pressure import Pressure


class ServerState:
    """What this worker believes about its server; every method takes the lock itself."""

    def __init__(
        self,
        *,
        size: int,
        retry_backoff_s: float,
        retry_backoff_max_s: float,
        unavailable_wait_s: float,
        registry_paused: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._unavailable_wait_s = unavailable_wait_s
        self._registry_paused = registry_paused
        self._pressure = Pressure(size, retry_backoff_s, retry_backoff_max_s)
        self._unavailable_until = 0.0
        # set while the server drains (its /health 503 while /generate answers): nothing new
        # is sent to it
        self._draining: str | None = None
        # the server answered 401/403: refused until the process restarts with a key, or a
        # probe of /model_info passes
        self._key_refused: str | None = None
        # why the server's own probe last found it down (None: it answered): a worker takes
        # no messages meanwhile, so they go to the workers of servers that answer
        self._down: str | None = None
        # why this worker stopped sending on its own (None: it did not)
        self._pause: str | None = None

    # --- what the probe, the slots and the pause watch tell it ------------------------------

    def mark_unavailable(self) -> None:
        """The server refused or dropped a request as down: nothing is sent for a while."""
        with self._lock:
            self._unavailable_until = self._clock() + self._unavailable_wait_s

    def drain(self, reason: str) -> None:
        """The server drains: nothing new is sent to it until drained()."""
        with self._lock:
            self._draining = reason

    def drained(self) -> None:
        """The server serves again (or is gone and will be found down): the drain is over."""
        with self._lock:
            self._draining = None

    def needs_key(self, error: str) -> None:
        """The server answered 401/403: it stays refused until its key is accepted."""
        with self._lock:
            self._key_refused = error

    def key_accepted(self) -> None:
        """A probe that needs the key passed: the server takes our requests again."""
        with self._lock:
            self._key_refused = None

    def probed(self, down: str | None) -> None:
        """The server's own probe: why it is down, or None when it answered."""
        with self._lock:
            self._down = down

    def pause(self, reason: str) -> None:
        """This worker stops sending to its server on its own, for reason."""
        with self._lock:
            self._pause = reason

    def resize(self, size: int) -> None:
        """The window's new size: back-pressure's limit never exceeds it."""
        with self._lock:
            self._pressure.size = size

    def push_back(self, inflight: int) -> None:
        """The server refused a request as full while inflight were out (that one included)."""
        with self._lock:
            self._pressure.push_back(inflight)

    def answered(self) -> None:
        """A request was served: back-pressure's limit grows back towards the window's size."""
        with self._lock:
            self._pressure.answered()

    # --- what the feeders, the enforcer, the sizer and the runner ask -----------------------

    @property
    def draining(self) -> str | None:
        """Why the server drains (None: it does not)."""
        return self._draining

    @property
    def key_refused(self) -> str | None:
        """The server's refusal of our (missing or other) API key (None: no refusal)."""
        return self._key_refused

    @property
    def down(self) -> str | None:
        """Why the server's own probe last found it down (None: it answered)."""
        return self._down

    @property
    def pause_reason(self) -> str | None:
        """Why this worker stopped sending on its own (None: it did not)."""
        return self._pause

    def paused(self) -> bool:
        """Paused in the registry (read at most once a second) or by this worker."""
        return self._pause is not None or self._registry_paused()

    def gone_recently(self) -> bool:
        """The server refused or dropped a request as down a moment ago."""
        with self._lock:
            return self._clock() < self._unavailable_until

    def unavailable(self) -> bool:
        """Nothing is sent now: the server went away a moment ago, drains, or wants a key."""
        if self._draining is not None or self._key_refused is not None:
            return True
        return self.gone_recently()

    def finishing(self) -> bool:
        """The requests out still finish there: the server drains or refuses the key."""
        return self._draining is not None or self._key_refused is not None

    def held(self) -> str | None:
        """Why the server's own probes keep new work from it (None: they do not): it wants a
        key we lack, it drains, or it did not answer. A worker takes no messages meanwhile."""
        if self._key_refused is not None:
            return "it needs an API key"
        if self._draining is not None:
            return "it drains"
        if self._down is not None:
            # after a drain the server exits: without this its worker would take messages
            # again and give each back, until the watchdog (if beat runs) paused the server
            return f"it is down: {self._down}"
        return None

    def takes_work(self) -> bool:
        """Whether its worker takes messages for it: held() names no reason."""
        return self.held() is None

    def may_send(self, inflight: int) -> bool:
        """Whether one more request may go out with inflight out, under back-pressure."""
        with self._lock:
            return self._pressure.allows(inflight)

    def push_back_delay_s(self, times: int) -> float:
        """The wait before a request pushed back `times` times in a row goes out again."""
        return self._pressure.delay_s(times)

    def send_limit(self) -> int:
        """The requests back-pressure lets out now (0: no push-back seen)."""
        with self._lock:
            return int(self._pressure.limit)

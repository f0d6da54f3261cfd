"""Whether the embedded runner reaches each `--server`: since when one is down and why, with
one notice when it is first found down and one when it answers again.

A server is up only once it answered; until then, and whenever its window finds it gone,
it is down, with the true time since it was first found so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ContactState:
    """What the progress view shows of one server's reachability."""

    up: bool
    down_for_s: float | None  # since it was first found down; None while up or unknown
    error: str | None


class ServerContact:
    """The reachability of one server URL, safe to update from its feed thread and to read
    from the display."""

    def __init__(
        self,
        url: str,
        notify: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self._notify = notify
        self._clock = clock
        self._lock = threading.Lock()
        self._up = False
        self._down_since: float | None = None
        self._error: str | None = None
        self._answered_once = False

    def found_down(self, error: str) -> None:
        """The server did not answer (or its window found it gone)."""
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = self._clock()
            self._up = False
            self._error = error
            never = not self._answered_once
        if first:
            if never:
                self._notify(
                    f"cannot connect to --server {self.url}: {error}; waiting for it "
                    "(Ctrl-C to stop)"
                )
            else:
                self._notify(f"lost --server {self.url}: {error}; waiting for it")

    def found_up(self) -> None:
        """The server answered."""
        with self._lock:
            was_down = self._down_since
            self._up = True
            self._down_since = None
            self._error = None
            self._answered_once = True
        if was_down is not None:
            self._notify(f"--server {self.url} answers after {self._clock() - was_down:.0f}s down")

    @property
    def up(self) -> bool:
        with self._lock:
            return self._up

    def state(self) -> ContactState:
        with self._lock:
            since = self._down_since
            return ContactState(
                up=self._up,
                down_for_s=None if since is None else self._clock() - since,
                error=self._error,
            )

"""The server health state machine: healthy → suspect → down → recovering → healthy.

Pure logic with no I/O, so it is tested with a fake clock; the watchdog applies its verdicts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from app.sglang.draining import is_drain


class Health(enum.StrEnum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DOWN = "down"
    RECOVERING = "recovering"
    # /health answers 503 while /generate still does (SIGTERM): no new work, in flight finishes
    DRAINING = "draining"
    # /model_info or /generate answers 401/403: it wants an API key tokenmill does not send
    AUTH = "auth"


@dataclass(frozen=True)
class Thresholds:
    """Defaults close to SGLang's router: 3 failures to go down, 2 successes to come back."""

    failures_to_down: int = 3
    successes_to_up: int = 2

    def __post_init__(self) -> None:
        if self.failures_to_down < 1 or self.successes_to_up < 1:
            raise ValueError("health thresholds must be at least 1")


@dataclass(frozen=True)
class Verdict:
    state: Health
    failures: int
    successes: int

    @property
    def serving(self) -> bool:
        """May work be sent to the server in this state?"""
        return self.state in (Health.HEALTHY, Health.SUSPECT, Health.UNKNOWN)


def step(
    previous: Verdict,
    ok: bool,
    thresholds: Thresholds,
    *,
    stalled: bool = False,
    refused_at_once: bool = False,
    auth: bool = False,
) -> Verdict:
    """The verdict after one probe (ok or not); a stalled server is down at once.

    refused_at_once: the health route answered 503 without trying generation (SGLang while
    starting or after SIGTERM): a server that was serving drains; auth: it refused our key.
    A draining server that stops answering is down at once."""
    if stalled:
        return Verdict(Health.DOWN, max(previous.failures, thresholds.failures_to_down), 0)
    if auth:
        return Verdict(Health.AUTH, previous.failures + 1, 0)
    state = previous.state
    serving = (Health.HEALTHY, Health.SUSPECT, Health.DRAINING)
    if not ok and is_drain(refused_at_once, was_serving=state in serving):
        return Verdict(Health.DRAINING, previous.failures + 1, 0)
    if not ok and state is Health.DRAINING:
        return Verdict(Health.DOWN, max(previous.failures + 1, thresholds.failures_to_down), 0)
    if ok:
        if state in (Health.DOWN, Health.RECOVERING):
            successes = previous.successes + 1 if state == Health.RECOVERING else 1
            if successes >= thresholds.successes_to_up:
                return Verdict(Health.HEALTHY, 0, successes)
            return Verdict(Health.RECOVERING, 0, successes)
        return Verdict(Health.HEALTHY, 0, previous.successes + 1)
    failures = previous.failures + 1
    if state in (Health.DOWN, Health.RECOVERING):
        return Verdict(Health.DOWN, failures, 0)
    if failures >= thresholds.failures_to_down:
        return Verdict(Health.DOWN, failures, 0)
    return Verdict(Health.SUSPECT, failures, 0)

"""The drain rule of SGLang's health answers: a quick 503 from a server that was serving is a
drain. One place for the worker's own probe (workers/engine/probes.py) and the watchdog's.

SGLang 0.5.23 (`http_server.health_generate`, `sigterm_watchdog`): after SIGTERM its health
routes answer 503 at once, without looking at the scheduler, while /generate still serves what
it is sent; a 503 after its own generation check (HEALTH_CHECK_TIMEOUT, 20 s) is a hung server.
A server that was not serving and answers 503 at once is starting, not draining.
"""

from __future__ import annotations

from typing import Final

# A drain answers 503 without looking at the scheduler; SGLang's failed generation check takes
# its HEALTH_CHECK_TIMEOUT (20 s). A 503 slower than this is a hung server.
DRAIN_ANSWER_MAX_S: Final = 10.0


def refused_at_once(status_code: int | None, latency_s: float) -> bool:
    """The health route answered 503 without trying generation (starting, or draining)."""
    return status_code == 503 and latency_s < DRAIN_ANSWER_MAX_S


def is_drain(at_once: bool, *, was_serving: bool) -> bool:
    """A 503 at once (refused_at_once) from a server that was serving is a drain."""
    return at_once and was_serving

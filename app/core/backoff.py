"""Exponential backoff, the one schedule every retry loop waits by: the first wait, doubled after
each failure in a row, never more than a ceiling."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

# 2.0 ** 1024 overflows a float; far past any ceiling, so the exponent stops there
_MAX_DOUBLINGS = 1023


@dataclass(frozen=True)
class Backoff:
    """Waits of first_s, 2 × first_s, 4 × first_s, … up to max_s."""

    first_s: float
    max_s: float

    def delay_s(self, times: int) -> float:
        """The wait after `times` failures in a row (1 and below: first_s)."""
        doublings = min(max(0, times - 1), _MAX_DOUBLINGS)
        return min(self.max_s, self.first_s * 2.0**doublings)

    def delays(self) -> Iterator[float]:
        """The waits after the first, second, … failure in a row, without end."""
        return (self.delay_s(times) for times in itertools.count(1))

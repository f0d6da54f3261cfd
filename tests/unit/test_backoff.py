"""The one backoff schedule: doubling from the first wait, held at the ceiling, no overflow."""

from __future__ import annotations

import itertools

from app.core.backoff import Backoff


def test_waits_double_from_the_first_up_to_the_ceiling() -> None:
    backoff = Backoff(first_s=0.2, max_s=10.0)
    waits = list(itertools.islice(backoff.delays(), 9))
    assert waits == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0, 10.0]
    assert [backoff.delay_s(n) for n in (0, 1, 2)] == [0.2, 0.2, 0.4]


def test_a_long_outage_stays_at_the_ceiling() -> None:
    backoff = Backoff(first_s=2.0, max_s=120.0)
    assert backoff.delay_s(5_000) == 120.0
    assert backoff.delay_s(1_025) == 120.0

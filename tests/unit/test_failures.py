"""Failure reasons: items failed by one cause share one, whatever differs between them (counts,
hashes, attempts), and different causes stay apart; `retry --since` times and durations."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import click
import pytest

from app.core.failures import REASON_MAX_CHARS, failure_reason
from ops.retry_cmd import parse_since


def test_one_cause_one_reason() -> None:
    a = failure_reason(
        "permanent: HTTP 400: Requested token count exceeds the model's maximum context length "
        "of 200 tokens. You requested a total of 243 tokens: 143 tokens from the input"
    )
    b = failure_reason(
        "permanent: HTTP 400: Requested token count exceeds the model's maximum context length "
        "of 200 tokens. You requested a total of 251 tokens: 151 tokens from the input"
    )
    assert a == b
    assert a.startswith("HTTP 400: Requested token count exceeds")
    image = "permanent: image images/{}.png is missing from file:///srv/w1/.tokenmill/storage"
    assert failure_reason(image.format("a6" * 32)) == failure_reason(image.format("0f" * 32))
    assert failure_reason(image.format("a6" * 32)) == (
        "image images/….png is missing from file:///srv/w1/.tokenmill/storage"
    )
    assert failure_reason("gave up after 5 attempts: HTTP 502: bad gateway") == (
        failure_reason("gave up after 3 attempts: HTTP 502: bad gateway")
    )


def test_causes_stay_apart() -> None:
    assert failure_reason("permanent: HTTP 400: x") != failure_reason("permanent: HTTP 413: x")
    assert failure_reason("turn 0 failed: permanent: HTTP 400: x") == "turn N failed: HTTP 400: x"
    assert failure_reason(None) == "(no error recorded)"
    assert len(failure_reason("permanent: " + "word " * 200)) == REASON_MAX_CHARS


def test_since_takes_a_time_or_a_duration() -> None:
    now = datetime(2026, 12, 2, 15, 0, tzinfo=UTC)
    assert parse_since("90m", now=now) == now - timedelta(minutes=90)
    assert parse_since("1d", now=now) == now - timedelta(days=1)
    assert parse_since("2026-12-02T14:00", now=now) == datetime(2026, 12, 2, 14, tzinfo=UTC)
    with pytest.raises(click.BadParameter, match="neither a time"):
        parse_since("yesterday", now=now)

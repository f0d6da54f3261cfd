"""The drain rule of SGLang's health answers, as the worker's probe and the watchdog apply it."""

from __future__ import annotations

from app.sglang.draining import DRAIN_ANSWER_MAX_S, is_drain, refused_at_once


def test_a_quick_503_is_refused_at_once_a_slow_one_or_another_status_not() -> None:
    assert refused_at_once(503, 0.01)
    assert not refused_at_once(503, DRAIN_ANSWER_MAX_S)  # SGLang's generation check ran
    assert not refused_at_once(503, 20.5)
    assert not refused_at_once(500, 0.01)
    assert not refused_at_once(None, 0.01)  # no answer at all: down


def test_a_quick_503_is_a_drain_only_from_a_server_that_was_serving() -> None:
    assert is_drain(refused_at_once(503, 0.01), was_serving=True)
    assert not is_drain(refused_at_once(503, 0.01), was_serving=False)  # starting
    assert not is_drain(refused_at_once(503, 25.0), was_serving=True)  # hung

"""The health state machine, step by step, with the thresholds near SGLang's router."""

from __future__ import annotations

import pytest

from workers.control.health import Health, Thresholds, Verdict, step

T = Thresholds(failures_to_down=3, successes_to_up=2)


def run(probes: str, start: Health = Health.HEALTHY, thresholds: Thresholds = T) -> list[str]:
    """Apply probes ('+' ok, '-' failed, 's' stalled) and list the states passed through."""
    verdict = Verdict(start, 0, 0)
    states = []
    for p in probes:
        verdict = step(verdict, p == "+", thresholds, stalled=p == "s")
        states.append(verdict.state.value)
    return states


def test_three_failures_to_go_down_two_successes_to_come_back() -> None:
    assert run("---++") == ["suspect", "suspect", "down", "recovering", "healthy"]


def test_a_success_while_suspect_clears_the_failures() -> None:
    assert run("--+--") == ["suspect", "suspect", "healthy", "suspect", "suspect"]


def test_a_failure_while_recovering_goes_back_down() -> None:
    assert run("---+-++") == [
        "suspect",
        "suspect",
        "down",
        "recovering",
        "down",
        "recovering",
        "healthy",
    ]


def test_stalled_is_down_at_once_even_if_the_route_says_ok() -> None:
    assert run("+s") == ["healthy", "down"]


def test_unknown_server_becomes_healthy_on_first_success() -> None:
    assert run("+", start=Health.UNKNOWN) == ["healthy"]
    assert run("-", start=Health.UNKNOWN) == ["suspect"]


def test_thresholds_of_one() -> None:
    assert run("-+", thresholds=Thresholds(1, 1)) == ["down", "healthy"]


def test_invalid_thresholds_are_refused() -> None:
    with pytest.raises(ValueError):
        Thresholds(0, 2)


def test_serving_states() -> None:
    assert [Verdict(h, 0, 0).serving for h in Health] == [True, True, True, False, False]

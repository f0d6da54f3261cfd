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
    assert [Verdict(h, 0, 0).serving for h in Health] == [
        True,  # unknown
        True,  # healthy
        True,  # suspect
        False,  # down
        False,  # recovering
        False,  # draining
        False,  # auth
    ]


def test_a_503_at_once_from_a_serving_server_is_a_drain_then_down_when_it_exits() -> None:
    verdict = Verdict(Health.HEALTHY, 0, 3)
    states = []
    for ok, at_once in [(False, True), (False, True), (False, False), (True, False), (True, False)]:
        verdict = step(verdict, ok, T, refused_at_once=at_once)
        states.append(verdict.state.value)
    assert states == ["draining", "draining", "down", "recovering", "healthy"]


def test_a_503_at_once_while_down_is_a_server_starting_not_a_drain() -> None:
    verdict = step(Verdict(Health.DOWN, 3, 0), False, T, refused_at_once=True)
    assert verdict.state is Health.DOWN


def test_a_refused_key_is_auth_until_a_probe_passes() -> None:
    verdict = step(Verdict(Health.HEALTHY, 0, 1), False, T, auth=True)
    assert verdict.state is Health.AUTH and not verdict.serving
    assert step(verdict, False, T, auth=True).state is Health.AUTH
    assert step(verdict, True, T).state is Health.HEALTHY

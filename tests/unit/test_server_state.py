"""ServerState: each change the probe, the slots and the pause watch make, and what the
feeders, the enforcer and the sizer then read."""

from __future__ import annotations

from workers.engine.server_state import ServerState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def state(clock: Clock, *, registry: list[bool] | None = None) -> ServerState:
    flag = registry if registry is not None else [False]
    return ServerState(
        size=8,
        retry_backoff_s=0.5,
        retry_backoff_max_s=4.0,
        unavailable_wait_s=5.0,
        registry_paused=lambda: flag[0],
        clock=clock,
    )


def test_a_fresh_server_takes_work() -> None:
    s = state(Clock())
    assert s.takes_work() and s.held() is None
    assert not s.unavailable() and not s.paused() and not s.finishing()
    assert (s.draining, s.key_refused, s.down, s.pause_reason) == (None, None, None, None)


def test_a_drain_holds_the_server_until_it_is_drained() -> None:
    s = state(Clock())
    s.drain("draining: /health HTTP 503")
    assert s.held() == "it drains" and s.unavailable() and s.finishing()
    assert s.draining == "draining: /health HTTP 503"
    s.drained()
    assert s.takes_work() and not s.unavailable() and s.draining is None


def test_a_refused_key_holds_the_server_until_it_is_accepted_and_wins_over_a_drain() -> None:
    s = state(Clock())
    s.drain("draining")
    s.needs_key("HTTP 401: Unauthorized")
    assert s.held() == "it needs an API key" and s.finishing()
    s.key_accepted()
    assert s.held() == "it drains" and s.key_refused is None


def test_a_probe_finding_the_server_down_holds_it_without_making_it_unavailable() -> None:
    s = state(Clock())
    s.probed("cannot connect")
    assert s.held() == "it is down: cannot connect" and s.down == "cannot connect"
    assert not s.unavailable() and not s.finishing()
    s.probed(None)
    assert s.takes_work()


def test_a_server_gone_a_moment_ago_is_unavailable_for_the_wait_but_not_held() -> None:
    clock = Clock()
    s = state(clock)
    s.mark_unavailable()
    assert s.gone_recently() and s.unavailable() and s.takes_work()
    clock.now += 4.9
    assert s.unavailable()
    clock.now += 0.2
    assert not s.gone_recently() and not s.unavailable()


def test_paused_by_the_registry_or_by_this_worker_with_a_reason() -> None:
    flag = [False]
    s = state(Clock(), registry=flag)
    flag[0] = True
    assert s.paused() and s.pause_reason is None and s.takes_work()
    flag[0] = False
    assert not s.paused()
    s.pause("token drift on run r item 3: 2 != 25")
    assert s.paused() and s.pause_reason == "token drift on run r item 3: 2 != 25"


def test_back_pressure_halves_the_limit_and_grows_back_to_the_size() -> None:
    s = state(Clock())
    assert s.may_send(100) and s.send_limit() == 0
    s.push_back(6)
    assert s.send_limit() == 3 and s.may_send(2) and not s.may_send(3)
    assert (s.push_back_delay_s(1), s.push_back_delay_s(2), s.push_back_delay_s(9)) == (
        0.5,
        1.0,
        4.0,
    )
    s.resize(5)
    s.answered()
    assert s.send_limit() == 4
    s.answered()
    assert s.send_limit() == 0 and s.may_send(100)

"""The embedded runner's view of a --server's reachability: one notice when it is first found
down and one when it answers, and a down time that is the true time since it was found so."""

from __future__ import annotations

from workers.engine.contact import ServerContact


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_server_never_reached_is_named_once_and_its_down_time_grows() -> None:
    notices: list[str] = []
    clock = Clock()
    contact = ServerContact("http://gpu-a:30001", notices.append, clock)
    assert not contact.up and contact.state().down_for_s is None  # not probed yet
    contact.found_down("cannot connect: ConnectError: refused")
    clock.now_s += 7
    contact.found_down("cannot connect: ConnectError: refused")  # probed again: no new notice
    assert notices == [
        "cannot connect to --server http://gpu-a:30001: cannot connect: ConnectError: refused; "
        "waiting for it (Ctrl-C to stop)"
    ]
    state = contact.state()
    assert not state.up and state.down_for_s == 7.0 and "refused" in (state.error or "")
    clock.now_s += 5
    assert contact.state().down_for_s == 12.0

    contact.found_up()
    assert contact.up and contact.state().down_for_s is None
    assert notices[-1] == "--server http://gpu-a:30001 answers after 12s down"
    contact.found_down("the server went away")
    assert notices[-1] == "lost --server http://gpu-a:30001: the server went away; waiting for it"


def test_a_server_that_answers_at_once_says_nothing() -> None:
    notices: list[str] = []
    contact = ServerContact("http://gpu-b:30000", notices.append, Clock())
    contact.found_up()
    assert contact.up and notices == []

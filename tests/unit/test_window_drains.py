"""Drains, back-pressure and auth in the window, with a fake client and a SQLite ledger: a
draining server gets nothing new and gives back its backlog while its requests finish; a full
queue spends no attempt and shrinks the window; a probe's verdict tells a drain from a hung
server; the ledger keeps the last probe of a registered server only."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from sqlalchemy import Engine

from app.core.errors import BackPressure
from app.ledger import registry, run_queries
from app.sglang.client import ProbeResult
from app.sglang.draining import DRAIN_ANSWER_MAX_S
from tests.unit.test_window import feed, make_window, statuses, wait_idle
from workers.control.health import Health
from workers.engine.pressure import Pressure
from workers.engine.probes import auth_line, verdict
from workers.engine.server_state import ServerState


def test_a_drain_sends_nothing_new_and_gives_back_the_backlog(
    sqlite_engine: Engine, run: run_queries.RunInfo
) -> None:
    gate = threading.Event()
    released: list[int] = []

    def slow(ids: list[int], call: int) -> float:
        gate.wait(10)
        return 0.0

    window, server = make_window(sqlite_engine, slow, inflight=2, released=released)
    window.start()
    try:
        ids = feed(sqlite_engine, window, run, 4)  # 2 out, 2 in the backlog
        deadline = time.monotonic() + 10
        while server.in_flight < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        given_back = window.drain("draining: /health HTTP 503")
        assert given_back == 2 and window.unavailable()
        gate.set()  # the requests out finish and are written
        wait_idle(window)
    finally:
        window.stop(drain_timeout_s=1)
    rows = statuses(sqlite_engine, run)
    assert server.calls == 2  # nothing new was sent after the drain began
    assert sorted(released) == sorted(i for i in ids if rows[i].status == "queued")
    assert sorted(r.status for r in rows.values()) == ["done", "done", "queued", "queued"]
    assert all(r.attempts == (1 if r.status == "done" else 0) for r in rows.values())


def test_a_full_queue_spends_no_attempt(sqlite_engine: Engine, run: run_queries.RunInfo) -> None:
    refusals: dict[int, int] = {}

    def full(ids: list[int], call: int) -> float | Exception:
        n = refusals.get(ids[-1], 0)
        if n < 4:  # more refusals than the attempt budget: none of them may count
            refusals[ids[-1]] = n + 1
            return BackPressure("HTTP 503: The request queue is full.", status_code=503)
        return 0.0

    window, _ = make_window(sqlite_engine, full, inflight=4, max_attempts=2)
    window.start()
    try:
        feed(sqlite_engine, window, run, 6)
        wait_idle(window)
    finally:
        window.stop(drain_timeout_s=1)
    rows = statuses(sqlite_engine, run)
    assert {(r.status, r.attempts) for r in rows.values()} == {("done", 1)}
    assert window.stats.pushed_back == 24


def test_pressure_halves_on_push_back_and_grows_back_to_the_window() -> None:
    pressure = Pressure(size=64, backoff_s=0.1, backoff_max_s=1.0)
    assert pressure.allows(1000)  # no push-back yet: the window's size holds
    pressure.push_back(inflight=64)
    assert pressure.limit == 32 and pressure.allows(31) and not pressure.allows(32)
    pressure.push_back(inflight=10)
    assert pressure.limit == 5
    for _ in range(60):
        pressure.answered()
    assert pressure.limit == 0 and pressure.allows(1000)  # back to the window's own size
    assert [pressure.delay_s(n) for n in (1, 2, 3, 9)] == [0.1, 0.2, 0.4, 1.0]


def test_a_quick_503_from_a_serving_server_is_a_drain_a_slow_one_is_down() -> None:
    quick = ProbeResult(False, 503, 0.01, "HTTP 503")
    assert verdict(quick, was_serving=True).state is Health.DRAINING
    assert verdict(quick, was_serving=False).state is Health.DOWN  # starting
    slow = ProbeResult(False, 503, DRAIN_ANSWER_MAX_S + 10, "HTTP 503")
    assert verdict(slow, was_serving=True).state is Health.DOWN  # its generation check failed
    refused = ProbeResult(False, None, 0.0, "cannot connect")
    assert verdict(refused, was_serving=True).state is Health.DOWN
    assert verdict(ProbeResult(True, 200, 0.0), was_serving=False).state is Health.HEALTHY


def test_the_auth_line_names_the_server_and_the_setting() -> None:
    assert auth_line("gpu-a:30000", key_set=False) == (
        "error: server gpu-a:30000 requires an API key: set TOKENMILL_SGLANG_API_KEY"
    )
    assert "refuses the API key in TOKENMILL_SGLANG_API_KEY" in auth_line("g:1", key_set=True)


def test_a_probe_is_noted_on_a_registered_server_only(sqlite_engine: Engine) -> None:
    with sqlite_engine.begin() as conn:
        assert (
            registry.note_probe(
                conn, "nobody:1", state="healthy", ok=True, latency_s=0.1, error=None, by="worker"
            )
            is None
        )
        registry.upsert_server(conn, "gpu-a:30000", "http://gpu-a:30000")
        was = registry.note_probe(
            conn,
            "gpu-a:30000",
            state="draining",
            ok=False,
            latency_s=0.01,
            error="HTTP 503",
            by="worker",
        )
        server = registry.get_server(conn, "gpu-a:30000")
    assert was == "unknown"
    assert (server.state, server.last_probe_ok, server.last_error) == (
        "draining",
        False,
        "HTTP 503",
    )
    assert server.last_probe_at is not None


class _Window:
    def __init__(self) -> None:
        self.abandoned = 0

    def abandon_inflight(self, reason: str) -> int:
        self.abandoned += 1
        return 0


class _Pauses:
    def __init__(self) -> None:
        self.by: str | None = None

    def state(self, *, max_age_s: float = 1.0) -> tuple[bool, str | None]:
        return self.by is not None, self.by


class _Runtime:
    server_name = "gpu-a:30000"

    def __init__(self) -> None:
        self.window = _Window()
        self.pauses = _Pauses()
        self.server_state = ServerState(
            size=4, retry_backoff_s=0.1, retry_backoff_max_s=1.0, unavailable_wait_s=5.0
        )


class _Control:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def cancel_consumer(self, workers: list[str]) -> None:
        self.calls.append("cancel")

    def add_consumer(self, workers: list[str]) -> None:
        self.calls.append("add")


def test_a_worker_takes_no_messages_while_its_server_drains_or_wants_a_key() -> None:
    from workers.engine.enforcer import PauseEnforcer

    rt, control = _Runtime(), _Control()
    enforcer = PauseEnforcer(rt, "w1@host", control, 1.0)  # type: ignore[arg-type]
    enforcer.check()
    rt.server_state.drain("draining: /health HTTP 503")
    enforcer.check()
    rt.server_state.drained()
    enforcer.check()
    rt.server_state.needs_key("HTTP 401: Unauthorized")
    enforcer.check()
    assert control.calls == ["cancel", "add", "cancel"]
    assert rt.window.abandoned == 0  # the requests out to a draining server finish there


def test_a_worker_whose_server_is_down_takes_no_messages_until_it_answers() -> None:
    from app.core.constants import PAUSED_BY_WATCHDOG
    from workers.engine.enforcer import PauseEnforcer

    rt, control = _Runtime(), _Control()
    enforcer = PauseEnforcer(rt, "w1@host", control, 1.0)  # type: ignore[arg-type]
    rt.server_state.drain("draining: /health HTTP 503")
    enforcer.check()
    # the drained server exits: its drain is over, and it does not answer
    rt.server_state.drained()
    rt.server_state.probed("cannot connect: Connection refused")
    enforcer.check()
    assert control.calls == ["cancel"]  # still held: no message is taken and given back
    rt.pauses.by = PAUSED_BY_WATCHDOG
    enforcer.check()
    assert rt.window.abandoned == 1  # a down server's requests out are given back
    rt.pauses.by = None
    rt.server_state.probed(None)
    enforcer.check()
    assert control.calls == ["cancel", "add"]


def test_a_pause_is_said_once_however_often_the_cancel_is_sent_or_its_reason_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker pointed at a wrong port: its own probe holds it (down), then the watchdog pauses
    the server, while the consumer still runs until the cancel broadcast reaches it. One line
    says it stopped, one that it consumes again."""
    from app.core.constants import PAUSED_BY_WATCHDOG
    from workers.engine.enforcer import PauseEnforcer

    rt, control = _Runtime(), _Control()
    consuming = [True]
    enforcer = PauseEnforcer(
        rt,  # type: ignore[arg-type]
        "w1@host",
        control,
        1.0,
        consuming_now=lambda: consuming[0],
    )
    rt.server_state.probed("cannot connect: Connection refused")
    with caplog.at_level(logging.WARNING, logger="workers.engine.enforcer"):
        enforcer.check()
        enforcer.check()  # the broadcast not applied yet: the consumer still runs
        rt.pauses.by = PAUSED_BY_WATCHDOG
        enforcer.check()
        consuming[0] = False
        enforcer.check()
        rt.server_state.probed(None)
        rt.pauses.by = None
        enforcer.check()
        enforcer.check()  # not re-added yet
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "server gpu-a:30000 is paused (it is down: cannot connect: Connection refused): w1@host "
        "stops consuming",
        "server gpu-a:30000 resumed: w1@host consumes again",
    ], said
    assert control.calls[:2] == ["cancel", "cancel"] and "add" in control.calls


def test_a_probe_records_a_down_server_on_its_window_until_it_answers() -> None:
    from workers.engine.probes import Seen, ServerProbe

    rt = _Runtime()
    probe = ServerProbe(rt)  # type: ignore[arg-type]
    probe._apply(Seen(Health.DOWN, False, None, "cannot connect"))
    assert rt.server_state.down == "cannot connect"
    probe._apply(Seen(Health.HEALTHY, True, 0.01, None))
    assert rt.server_state.down is None

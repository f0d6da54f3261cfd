"""The auto-sized window's logic: capacity and load as read from SGLang's bodies, the shares of
several workers, the controller's moves with hysteresis, and the sizer driving a window."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, create_engine

from app.core.models import metadata
from app.core.settings import Settings
from app.ledger import registry, windows
from app.sglang.capacity import Capacity, Load, capacity_of, load_of
from workers.engine import autosize, sizing
from workers.engine.server_state import ServerState


def _capacity(max_running: int = 256, tokens: int | None = None) -> Capacity:
    return Capacity(max_running, tokens, 8192, 1, "internal_states")


def _load(running: int, waiting: int, max_running: int | None = 256) -> Load:
    return Load(running, waiting, 0.5, max_running, None)


# --- /server_info and /v1/loads ---------------------------------------------------------------


def test_capacity_reads_the_effective_figure_of_each_dp_rank() -> None:
    info = {
        "max_running_requests": None,  # SGLang sized it itself
        "dp_size": 2,
        "chunked_prefill_size": 8192,
        "max_total_num_tokens": 500_000,
        "internal_states": [
            {
                "effective_max_running_requests_per_dp": 128,
                "memory_usage": {"token_capacity": 500_000},
            },
            {
                "effective_max_running_requests_per_dp": 128,
                "memory_usage": {"token_capacity": 500_000},
            },
        ],
    }
    cap = capacity_of(info)
    assert cap == Capacity(256, 1_000_000, 8192, 2, "internal_states")


def test_capacity_with_one_state_for_all_ranks_multiplies_it() -> None:
    info = {"dp_size": 4, "internal_states": [{"effective_max_running_requests_per_dp": 64}]}
    cap = capacity_of(info)
    assert cap is not None and cap.max_running == 256 and cap.max_total_tokens is None


def test_capacity_falls_back_to_the_server_arg_then_to_nothing() -> None:
    cap = capacity_of({"max_running_requests": 48, "max_total_num_tokens": 9000})
    assert cap == Capacity(48, 9000, None, 1, "server_args")
    assert capacity_of({"max_running_requests": None, "internal_states": []}) is None


def test_load_sums_the_ranks_and_keeps_the_fullest_pool() -> None:
    body = {
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 100, "num_waiting_reqs": 3, "token_usage": 0.9,
             "max_running_requests": 128, "max_total_num_tokens": 1000},
            {"dp_rank": 1, "num_running_reqs": 120, "num_waiting_reqs": 0, "token_usage": 0.4,
             "max_running_requests": 128, "max_total_num_tokens": 1000},
        ]
    }  # fmt: skip
    assert load_of(body) == Load(220, 3, 0.9, 256, 2000)
    with pytest.raises(ValueError, match="no loads"):
        load_of({"loads": []})


# --- shares --------------------------------------------------------------------------------


def test_top_is_the_batch_plus_a_sixteenth() -> None:
    assert sizing.top_for(_capacity(256)) == 272
    assert sizing.top_for(_capacity(512)) == 544
    assert sizing.top_for(_capacity(8)) == 8 + sizing.MIN_MARGIN


def test_shares_of_several_workers_add_up_to_the_target() -> None:
    peers = ["w-a", "w-b", "w-c"]
    shares = [sizing.share(272, peers, me) for me in peers]
    assert sum(shares) == 272 and max(shares) - min(shares) <= 1
    assert sizing.share(272, [], "alone") == 272
    assert sizing.share(1, peers, "w-c") == 1  # never below one


# --- the controller ------------------------------------------------------------------------


def test_queued_while_slots_are_free_stops_growth_and_then_shrinks() -> None:
    c = sizing.Controller(_capacity(256))
    assert c.target == 272
    # KV binds: 150 run, 60 queue (more than twice the margin of 16); once is not enough
    assert c.observe(_load(150, 60)) is None
    decision = c.observe(_load(150, 60))
    assert decision == sizing.Decision(166, sizing.REASON_KV_BOUND)
    # a small queue with free slots holds: no growth while the pool binds
    assert c.observe(_load(160, 10)) is None and c.observe(_load(160, 10)) is None
    assert c.target == 166


def test_a_shrink_is_at_most_half_at_once() -> None:
    c = sizing.Controller(_capacity(256))
    c.observe(_load(10, 200))
    assert c.observe(_load(10, 200)) == sizing.Decision(136, sizing.REASON_KV_BOUND)


def test_free_slots_and_no_queue_grow_it_back_to_the_top_only() -> None:
    c = sizing.Controller(_capacity(256))
    c.observe(_load(100, 80))
    c.observe(_load(100, 80))
    assert c.target == 136  # half at most at once
    grown = []
    for _ in range(20):
        d = c.observe(_load(200, 0))
        if d is not None:
            grown.append(d)
    assert grown[0] == sizing.Decision(152, sizing.REASON_ROOM)
    assert c.target == 272  # the top, never past it
    assert c.observe(_load(100, 0)) is None and c.observe(_load(100, 0)) is None


def test_alternating_readings_never_move_it() -> None:
    c = sizing.Controller(_capacity(256))
    c.observe(_load(100, 80))
    c.observe(_load(100, 80))
    target = c.target
    for i in range(20):
        assert c.observe(_load(100, 80) if i % 2 else _load(200, 0)) is None
    assert c.target == target


def test_a_full_batch_with_a_queue_holds() -> None:
    c = sizing.Controller(_capacity(256))
    for _ in range(5):
        assert c.observe(_load(256, 100)) is None
    assert c.target == 272


# --- the sizer over a fake server and a real (SQLite) ledger ---------------------------------


class FakeServer:
    """A server's /server_info and /v1/loads as the sizer's client sees them."""

    def __init__(self, capacity: Capacity | None, load: Load | None) -> None:
        self.cap = capacity
        self.load = load
        self.capacity_reads = 0

    def capacity(self) -> Capacity | None:
        self.capacity_reads += 1
        return self.cap

    def loads(self) -> Load | None:
        return self.load

    def close(self) -> None:
        pass


class FakeWindow:
    def __init__(self, inflight: int) -> None:
        self.inflight = inflight
        self.backlog = 0
        self.server_state = ServerState(
            size=inflight, retry_backoff_s=0.1, retry_backoff_max_s=1.0, unavailable_wait_s=5.0
        )

    def resize(self, inflight: int, backlog: int) -> int:
        before, self.inflight, self.backlog = self.inflight, inflight, backlog
        return before


@pytest.fixture
def db(tmp_path: Any) -> Engine:
    engine = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    metadata.create_all(engine)
    return engine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sizer(
    db: Engine, server: FakeServer, owner: str, clock: Clock, inflight: Any = "auto"
) -> tuple[autosize.WindowSizer, FakeWindow]:
    settings = Settings(inflight=inflight, batch_size=32)
    window = FakeWindow(autosize.start_size(settings))
    sizer = autosize.WindowSizer(
        settings,
        window,
        db=db,
        server_name="gpu-a",
        owner=owner,
        client_factory=lambda: server,
        clock=clock,
    )
    return sizer, window


def test_auto_sizes_from_the_server_and_two_workers_share_it(db: Engine) -> None:
    server = FakeServer(_capacity(256), _load(0, 0))
    clock = Clock()
    first, w1 = _sizer(db, server, "owner-1", clock)
    assert w1.inflight == autosize.START_WINDOW
    first.tick()
    assert w1.inflight == 272 and w1.backlog == 68 and first.reason == sizing.REASON_CAPACITY
    second, w2 = _sizer(db, server, "owner-2", clock)
    second.tick()
    clock.now += autosize.RECORD_S
    first.tick()
    assert w1.inflight + w2.inflight == 272
    with db.connect() as conn:
        rows = windows.windows_by_server(conn, ["gpu-a"], fresh_s=windows.FRESH_S)["gpu-a"]
    seen = windows.server_window(rows)
    assert (
        seen is not None and seen.size == 272 and seen.describe() == "auto: 272 (max_running 256)"
    )
    # the second worker stops: the first takes the whole server again
    second.stop()
    clock.now += autosize.RECORD_S
    first.tick()
    assert w1.inflight == 272 and first.reason == sizing.REASON_WORKERS


def test_a_restart_with_a_smaller_batch_resizes_without_a_new_worker(db: Engine) -> None:
    server = FakeServer(_capacity(256), _load(0, 0))
    sizer, window = _sizer(db, server, "owner-1", Clock())
    sizer.tick()
    assert window.inflight == 272
    # restarted with --max-running-requests 64: /v1/loads says so before anyone asks again
    server.cap, server.load = _capacity(64), _load(0, 0, max_running=64)
    sizer.tick()  # the load's max_running differs: the capacity is read next round
    sizer.tick()
    assert window.inflight == 68 and sizer.reason == sizing.REASON_CAPACITY
    with db.connect() as conn:
        kinds = [e.kind for e in registry.list_events(conn, server="gpu-a")]
    assert kinds.count("window_resized") == 2


def test_without_v1_loads_the_window_stays_at_the_server_info_size(db: Engine) -> None:
    server = FakeServer(_capacity(512), None)
    sizer, window = _sizer(db, server, "owner-1", Clock())
    for _ in range(5):
        sizer.tick()
    assert window.inflight == 544 and sizer.has_loads is False


def test_a_number_is_a_fixed_window(db: Engine) -> None:
    server = FakeServer(_capacity(256), _load(0, 0))
    sizer, window = _sizer(db, server, "owner-1", Clock(), inflight=64)
    sizer.tick()
    assert window.inflight == 64 and server.capacity_reads == 0
    with db.connect() as conn:
        rows = windows.windows_by_server(conn, ["gpu-a"], fresh_s=windows.FRESH_S)["gpu-a"]
    assert [(r.mode, r.size) for r in rows] == [("fixed", 64)]


def test_the_followers_hear_what_the_window_takes_as_it_resizes(db: Engine) -> None:
    server = FakeServer(_capacity(256), _load(0, 0))
    sizer, window = _sizer(db, server, "owner-1", Clock())
    heard: list[int] = []
    sizer.follow(heard.append)
    assert heard == [64 + 32]  # the start window and its backlog, at once
    sizer.tick()
    assert heard[-1] == 272 + 68
    server.cap, server.load = _capacity(16), _load(0, 0, max_running=16)
    sizer.tick()
    sizer.tick()
    assert window.inflight == 20 and heard[-1] == 20 + 32

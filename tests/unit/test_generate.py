"""handle_message with a real window (not started) and a SQLite ledger: it waits for room
before claiming, claims only what fits and sends the rest back unclaimed."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine

from app.core.contracts import SamplingParams
from app.ledger import claims, common, queue, run_queries
from workers.engine.fake_client import FakePolicy
from workers.engine.generate import handle_message
from workers.engine.scheduling import ClaimOrder, read_work
from workers.engine.server_state import ServerState
from workers.engine.window import InflightWindow, WindowConfig


@dataclass
class FakeSettings:
    unavailable_wait_s: float = 5.0
    room_wait_s: float = 0.01
    lease_s: float = 60.0


class FakePins:
    """What handle_message asks of a runtime's RunPins: every run served and matched."""

    def run_matches_server(self, run_id: int) -> bool:
        return True

    def serves_run(self, run_id: int) -> bool:
        return True

    def reads_images(self) -> bool:
        return True


@dataclass
class FakeRuntime:
    """What handle_message uses of a WorkerRuntime."""

    db: Engine
    window: InflightWindow
    settings: FakeSettings = field(default_factory=FakeSettings)
    owner: str = "owner-1"
    server_name: str = "fake"
    is_paused: bool = False
    pins: FakePins = field(default_factory=FakePins)
    claim_order: ClaimOrder = field(init=False)

    def __post_init__(self) -> None:
        self.claim_order = ClaimOrder(lambda: read_work(self.db))

    def paused(self) -> bool:
        return self.is_paused

    @property
    def server_state(self) -> ServerState:
        return self.window.server_state

    def run_priority(self, run_id: int) -> int:
        return 0

    def claims_ahead(self, run_id: int) -> bool:
        return True


def setup(db: Engine, n: int, policy: FakePolicy | None = None) -> tuple[FakeRuntime, list[int]]:
    spec = run_queries.RunSpec("r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2])
    with db.begin() as conn:
        info, _ = run_queries.get_or_create_run(conn, spec)
        queue.insert_items(
            conn, info.id, [queue.NewItem(f"k{i}", 0, i, None, [1, i]) for i in range(n)]
        )
        ids = queue.pending_ids(conn, info.id)
    window = InflightWindow(
        WindowConfig(
            "fake",
            inflight=4,
            lease_s=60,
            heartbeat_s=1,
            max_attempts=3,
            retry_backoff_s=0.01,
            retry_backoff_max_s=0.05,
            unavailable_wait_s=5,
            backlog=2,
        ),
        db=db,
        owner="owner-1",
        policy=policy or FakePolicy(),
    )
    return FakeRuntime(db, window), ids


def leased(db: Engine) -> set[int]:
    with db.connect() as conn:
        rows = conn.execute(common.items.select().where(common.items.c.status == "leased")).all()
    return {r.id for r in rows}


def test_claims_what_fits_and_sends_the_rest_back_unclaimed(sqlite_engine: Engine) -> None:
    rt, ids = setup(sqlite_engine, 10)  # the window holds 6 (4 in flight + 2 waiting)
    sent_back: list[tuple[list[int], float]] = []
    out = handle_message(rt, ids[:8], requeue=lambda b, s: sent_back.append((b, s)))  # type: ignore[arg-type]
    assert out["claimed"] == 6 and out["deferred"] == 2
    assert sent_back == [(ids[6:8], 0.0)]
    assert leased(sqlite_engine) == set(ids[:6])
    assert rt.window.outstanding == 6
    # no room at all: after the wait the whole message goes back, nothing is claimed
    out = handle_message(rt, ids[8:], requeue=lambda b, s: sent_back.append((b, s)))  # type: ignore[arg-type]
    assert out["claimed"] == 0 and sent_back[-1] == (ids[8:], 0.0)
    assert leased(sqlite_engine) == set(ids[:6])


def test_ids_already_taken_give_their_room_back(sqlite_engine: Engine) -> None:
    rt, ids = setup(sqlite_engine, 4)
    with sqlite_engine.begin() as conn:
        claims.claim_items(conn, ids[:3], owner="someone-else", server="other", lease_s=60)
    out = handle_message(rt, ids, requeue=lambda b, s: None)  # type: ignore[arg-type]
    assert out["claimed"] == 1 and out["skipped"] == 3
    assert rt.window.outstanding == 1


def test_a_paused_server_claims_nothing(sqlite_engine: Engine) -> None:
    rt, ids = setup(sqlite_engine, 3)
    rt.is_paused = True
    sent_back: list[tuple[list[int], float]] = []
    out = handle_message(rt, ids, requeue=lambda b, s: sent_back.append((b, s)))  # type: ignore[arg-type]
    assert out["claimed"] == 0 and sent_back == [(ids, 5.0)]
    assert leased(sqlite_engine) == set() and rt.window.outstanding == 0


def test_a_conversation_is_one_unit_of_room_and_never_split(sqlite_engine: Engine) -> None:
    rt, ids = setup(
        sqlite_engine,
        0,
        FakePolicy(
            conversation_of=lambda run_id, key: (run_id, key) if key.startswith("c") else None
        ),
    )
    spec = run_queries.RunSpec("r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2])
    with sqlite_engine.begin() as conn:
        info, _ = run_queries.get_or_create_run(conn, spec)
        # two conversations of 5 boundaries each, then 2 single items
        new = [queue.NewItem(f"c{c}", 0, c, None, [1, t], t) for c in range(2) for t in range(5)]
        new += [queue.NewItem(f"s{i}", 0, 9, None, [2, i]) for i in range(2)]
        queue.insert_items(conn, info.id, new)
        ids = queue.pending_ids(conn, info.id)
    sent_back: list[tuple[list[int], float]] = []
    out = handle_message(rt, ids, requeue=lambda b, s: sent_back.append((b, s)))  # type: ignore[arg-type]
    # 4 slots + a backlog of one conversation: both conversations and both singles fit
    assert out["claimed"] == 12 and sent_back == []
    assert rt.window.outstanding == 4  # a unit per conversation, one per single item
    assert rt.window.serves_conversations
    # a window with one unit of room left: a conversation is claimed whole, never in part
    with sqlite_engine.begin() as conn:
        more = [queue.NewItem("c9", 0, 1, None, [3, t], t) for t in range(3)]
        more += [queue.NewItem(f"t{i}", 0, 9, None, [4, i]) for i in range(2)]
        queue.insert_items(conn, info.id, more)
        extra = queue.pending_ids(conn, info.id)
    out = handle_message(rt, extra, requeue=lambda b, s: sent_back.append((b, s)))  # type: ignore[arg-type]
    # the one unit of room left takes the whole conversation; the singles go back unclaimed
    assert out["claimed"] == 3
    assert sent_back == [(extra[3:], 0.0)]
    assert set(extra[:3]) <= leased(sqlite_engine)
    assert rt.window.outstanding == 5  # one more unit: the new conversation


def other_run(db: Engine, name: str, n: int, priority: int) -> list[int]:
    """A second run of n pending items at this priority; its ids."""
    spec = run_queries.RunSpec(
        name, "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2], priority=priority
    )
    with db.begin() as conn:
        info, _ = run_queries.get_or_create_run(conn, spec)
        queue.insert_items(
            conn, info.id, [queue.NewItem(f"{name}{i}", 0, i, None, [5, i]) for i in range(n)]
        )
        return queue.pending_ids(conn, info.id)


def test_a_message_of_a_big_run_claims_an_urgent_runs_items_first(sqlite_engine: Engine) -> None:
    rt, ids = setup(sqlite_engine, 10)  # the big run; the window holds 6
    urgent = other_run(sqlite_engine, "u", 3, priority=10)
    sent_back: list[tuple[list[int], float]] = []
    out = handle_message(rt, ids[:8], requeue=lambda b, s: sent_back.append((b, s)))  # type: ignore[arg-type]
    # the urgent run's 3 items first (from the ledger), then the message's own: the rest of
    # the message goes back unclaimed, none of it leased
    assert out["claimed"] == 6 and out["ahead"] == 3 and out["priority"] == 0
    assert leased(sqlite_engine) == set(urgent) | set(ids[:3])
    assert sent_back == [(ids[3:8], 0.0)]


def test_runs_of_one_priority_share_the_room(sqlite_engine: Engine) -> None:
    rt, ids = setup(sqlite_engine, 10)
    third = other_run(sqlite_engine, "c", 4, priority=0)
    handle_message(rt, ids[:8], requeue=lambda b, s: None)  # type: ignore[arg-type]
    assert leased(sqlite_engine) == set(third[:3]) | set(ids[:3])


def test_a_priority_changed_in_the_ledger_reaches_the_order_at_its_refresh(
    sqlite_engine: Engine,
) -> None:
    rt, ids = setup(sqlite_engine, 10)
    later = other_run(sqlite_engine, "d", 4, priority=-1)
    now = [0.0]
    order = ClaimOrder(lambda: read_work(sqlite_engine), refresh_s=2.0, clock=lambda: now[0])
    with sqlite_engine.connect() as conn:
        run_id, d = (run_queries.get_run(conn, name).id for name in ("r", "d"))

    def plan() -> dict[int, int]:
        return dict(order.plan(4, {run_id: 8}, priority_of=lambda r: 0, from_ledger=lambda r: True))

    assert plan() == {run_id: 4}
    with sqlite_engine.begin() as conn:
        assert run_queries.set_priority(conn, "d", 10) == -1  # `tokenmill priority d 10`
    assert plan() == {run_id: 4}  # not yet read again
    now[0] += 2.0
    assert plan() == {d: 4} and len(later) == 4
    assert len(ids) == 10 and rt.window.outstanding == 0


def test_conversations_outranked_go_back_whole_and_their_room_to_the_run_ahead(
    sqlite_engine: Engine,
) -> None:
    rt, _ = setup(
        sqlite_engine,
        0,
        FakePolicy(
            conversation_of=lambda run_id, key: (run_id, key) if key.startswith("c") else None
        ),
    )
    spec = run_queries.RunSpec("r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2])
    with sqlite_engine.begin() as conn:
        info, _ = run_queries.get_or_create_run(conn, spec)
        new = [queue.NewItem(f"c{c}", 0, c, None, [1, t], t) for c in range(2) for t in range(3)]
        queue.insert_items(conn, info.id, new)
        ids = queue.pending_ids(conn, info.id)
    urgent = other_run(sqlite_engine, "u", 2, priority=10)
    sent_back: list[tuple[list[int], float]] = []
    out = handle_message(rt, ids, requeue=lambda b, s: sent_back.append((b, s)))  # type: ignore[arg-type]
    assert out["ahead"] == 2 and leased(sqlite_engine) == set(urgent)
    assert sent_back == [(ids, 0.0)]  # both conversations, whole, unclaimed

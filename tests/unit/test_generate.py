"""handle_message with a real window (not started) and a SQLite ledger: it waits for room
before claiming, claims only what fits and sends the rest back unclaimed."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine

from app import ledger
from app.contracts import SamplingParams
from workers.generate import handle_message
from workers.window import InflightWindow, WindowConfig


@dataclass
class FakeSettings:
    unavailable_wait_s: float = 5.0
    room_wait_s: float = 0.01
    lease_s: float = 60.0


@dataclass
class FakeRuntime:
    """What handle_message uses of a WorkerRuntime."""

    db: Engine
    window: InflightWindow
    settings: FakeSettings = field(default_factory=FakeSettings)
    owner: str = "owner-1"
    server_name: str = "fake"
    is_paused: bool = False

    def paused(self) -> bool:
        return self.is_paused

    def run_matches_server(self, run_id: int) -> bool:
        return True


def setup(db: Engine, n: int) -> tuple[FakeRuntime, list[int]]:
    spec = ledger.RunSpec("r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2])
    with db.begin() as conn:
        info, _ = ledger.get_or_create_run(conn, spec)
        ledger.insert_items(
            conn, info.id, [ledger.NewItem(f"k{i}", 0, i, None, [1, i]) for i in range(n)]
        )
        ids = ledger.pending_ids(conn, info.id)
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
        client_factory=lambda: None,  # type: ignore[arg-type,return-value]
        sampling_for_run=lambda run_id: SamplingParams(),
        on_released=lambda ids, wait_s: None,
    )
    return FakeRuntime(db, window), ids


def leased(db: Engine) -> set[int]:
    with db.connect() as conn:
        rows = conn.execute(ledger.items.select().where(ledger.items.c.status == "leased")).all()
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
        ledger.claim_items(conn, ids[:3], owner="someone-else", server="other", lease_s=60)
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

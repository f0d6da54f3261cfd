"""A refusal that can depend on the server is confirmed elsewhere before it is final: the item
goes back naming its refuser (no attempt spent), that server's claims pass it over, another
server's refusal makes it final, and so does having no other server; the item's own (past the
run's pinned limits) fails at once. A server refusing many distinct items is failing: paused
once, and what it refuses afterwards goes back without naming it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from app.core.errors import ServerRefusal
from app.ledger import claims, retries, run_queries
from app.sglang.limits import RequestNeed
from tests.unit.test_window import feed, make_window, statuses, wait_idle
from workers.engine.confirming import Confirmation
from workers.engine.failing import FailingWatch, Streak
from workers.engine.window import InflightWindow
from workers.engine.window_types import Verdict

REFUSAL = ServerRefusal(
    "HTTP 400: Requested token count exceeds the model's maximum context length of 1024 tokens.",
    status_code=400,
)


def test_ten_distinct_items_within_the_window_make_a_server_failing() -> None:
    now = [0.0]
    watch = FailingWatch(items=3, window_s=60.0, clock=lambda: now[0])
    assert watch.refused(1) is Streak.COUNTED
    assert watch.refused(1) is Streak.COUNTED  # the same item again is not another
    now[0] += 61.0  # item 1 left the window
    assert [watch.refused(i) for i in (2, 3)] == [Streak.COUNTED, Streak.COUNTED]
    assert watch.refused(4) is Streak.FAILING and watch.failing
    assert watch.refused(5) is Streak.PAUSED
    watch.reset()
    assert watch.refused(6) is Streak.COUNTED and not watch.failing


class _Pins:
    def __init__(self, pinned: dict[str, int] | None) -> None:
        self.pinned = pinned

    def pinned_limits(self, run_id: int) -> dict[str, int] | None:
        return self.pinned


class _Others:
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def of_run(self, run_id: int) -> list[str]:
        return self.names


def _confirmation(
    others: list[str], failing: list[str], *, pinned: dict[str, int] | None = None
) -> Confirmation:
    return Confirmation(
        "gpu-a",
        _Pins(pinned or {"context_length": 8192}),  # type: ignore[arg-type]
        _Others(others),  # type: ignore[arg-type]
        on_failing=failing.append,
        watch=FailingWatch(items=3),
    )


def _item(item_id: int, refused_by: str | None = None) -> claims.ClaimedItem:
    return claims.ClaimedItem(item_id, 1, 0, [1] * 2000, 0, refused_by=refused_by)


NEED = RequestNeed(2000, 100)


def test_the_verdicts_on_refusals_that_can_depend_on_the_server() -> None:
    failing: list[str] = []
    two = _confirmation(["gpu-b"], failing)
    assert two.verdict(_item(1), REFUSAL, NEED) == Verdict(False, f"refused by gpu-a: {REFUSAL}")
    assert two.verdict(_item(2, "gpu-b"), REFUSAL, NEED) == Verdict(
        True, " (refused by gpu-b too)"
    )  # a confirmation: not counted against this server
    alone = _confirmation([], failing)
    assert alone.verdict(_item(3), REFUSAL, NEED) == Verdict(
        True, " (no other server of the run to confirm it)"
    )
    own = _confirmation(["gpu-b"], failing, pinned={"context_length": 1024})
    verdict = own.verdict(_item(4), REFUSAL, NEED)
    assert verdict.final and "the item's own" in verdict.why
    assert failing == []


def test_a_server_refusing_many_items_is_paused_once_and_gives_back_the_rest() -> None:
    failing: list[str] = []
    two = _confirmation(["gpu-b"], failing)
    verdicts = [two.verdict(_item(i), REFUSAL, NEED) for i in range(1, 6)]
    assert failing == [str(REFUSAL)]  # once, at the third distinct item
    assert [v.refused for v in verdicts] == [True, True, True, False, False]
    assert not any(v.final for v in verdicts)
    alone = _confirmation([], failing)
    finals = [alone.verdict(_item(i), REFUSAL, NEED).final for i in range(1, 6)]
    assert finals == [True, True, True, False, False]  # at most 3 fail on a server alone


def test_a_refused_item_goes_back_for_another_server_with_no_attempt_spent(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    released: list[int] = []
    window, _ = make_window(
        sqlite_engine, lambda ids, call: REFUSAL if ids[-1] == 1 else 0.0, released=released
    )
    give_back: Any = lambda item, error: Verdict(False, f"refused by fake: {error}")  # noqa: E731
    window.policy.verdicts = give_back  # type: ignore[attr-defined]
    started.append(window)
    window.start()
    ids = feed(sqlite_engine, window, run, 3)
    wait_idle(window)
    rows = sorted(statuses(sqlite_engine, run).values(), key=lambda r: r.id)
    assert [(r.status, r.attempts) for r in rows] == [("done", 1), ("queued", 0), ("done", 1)]
    assert released == [ids[1]]
    with sqlite_engine.begin() as conn:
        assert claims.refused_here(conn, ids, "fake") == [ids[1]]
        assert claims.claim_items(conn, ids, owner="o", server="fake", lease_s=60) == []
        # a claim from the ledger (the claim order's, ahead of a message) passes it over too
        ahead = claims.claim_next(
            conn, owner="o", server="fake", lease_s=60, limit=9, run_id=run.id
        )
        assert ahead == []
        (taken,) = claims.claim_items(conn, ids, owner="o", server="gpu-b", lease_s=60)
    assert taken.id == ids[1] and taken.refused_by == "fake"


def test_a_confirmed_refusal_fails_with_why_and_retry_lets_every_server_take_it(
    sqlite_engine: Engine, run: run_queries.RunInfo, started: list[InflightWindow]
) -> None:
    window, _ = make_window(sqlite_engine, lambda ids, call: REFUSAL if ids[-1] == 1 else 0.0)
    window.policy.verdicts = lambda item, error: Verdict(True, " (refused by gpu-b too)")  # type: ignore[attr-defined]
    started.append(window)
    window.start()
    ids = feed(sqlite_engine, window, run, 2)
    wait_idle(window)
    failed = statuses(sqlite_engine, run)[ids[1]]
    assert failed.status == "failed" and failed.attempts == 1
    assert (failed.error or "").endswith("1024 tokens. (refused by gpu-b too)")
    with sqlite_engine.begin() as conn:
        plan = retries.plan_retry(conn, run.id, retries.RetrySelection())
        retries.apply_retry(conn, plan)
        (again,) = claims.claim_items(conn, [ids[1]], owner="o", server="fake", lease_s=60)
    assert again.refused_by is None

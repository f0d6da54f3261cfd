"""`tokenmill run`'s ETA and tok/s: the pace of this process's last minute, not the average
since it started over everything the run holds."""

from __future__ import annotations

from app.ledger import reads
from ops.views.run_progress import PACE_WINDOW_S, Pace


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _counts(done: int, total: int = 1000, failed: int = 0, tokens: int = 0) -> reads.RunCounts:
    left = total - done - failed
    return reads.RunCounts("r1", total, 0, left, 0, done, failed, 0, tokens, 0)


def test_nothing_finished_yet_has_no_eta() -> None:
    clock = _Clock()
    pace = Pace(clock)
    assert pace.rates(_counts(0)).eta == "—"
    clock.now += 5
    rates = pace.rates(_counts(0))
    assert (rates.eta, rates.tokens_per_s) == ("—", 0.0)


def test_a_run_taken_up_again_counts_only_what_finishes_now() -> None:
    """900 of 1000 were done before this process: at 10 a second now the 50 left take 5 s, not
    the 0.3 s an average of every done item over the time since start would say."""
    clock = _Clock()
    pace = Pace(clock)
    pace.rates(_counts(900, tokens=90_000))
    clock.now += 5
    rates = pace.rates(_counts(950, tokens=95_000))
    assert rates.eta == "5s"
    assert rates.tokens_per_s == 1000.0


def test_a_run_slowing_to_its_long_answers_lengthens_its_eta() -> None:
    """Short answers finish first: 20 a second for two minutes, then 2 a second. The ETA
    follows the last minute's pace, where an average since start stays near the fast one."""
    clock = _Clock()
    pace = Pace(clock)
    done = 0
    for _ in range(120):  # a tick a second
        clock.now += 1
        done += 20
        pace.rates(_counts(done, total=3000))
    assert pace.rates(_counts(done, total=3000)).eta == "30s"  # 600 left at 20/s
    for _ in range(int(PACE_WINDOW_S)):
        clock.now += 1
        done += 2
        rates = pace.rates(_counts(done, total=3000))
    assert done == 2520
    assert rates.eta == "240s"  # 480 left at the last minute's 2/s (the average: ~13 s)


def test_a_finished_run_says_zero() -> None:
    clock = _Clock()
    pace = Pace(clock)
    pace.rates(_counts(990, failed=10))
    clock.now += 1
    assert pace.rates(_counts(990, failed=10)).eta == "0s"


def test_failed_items_count_as_finished_for_the_pace() -> None:
    clock = _Clock()
    pace = Pace(clock)
    pace.rates(_counts(0))
    clock.now += 10
    assert pace.rates(_counts(50, failed=50)).eta == "90s"  # 900 left at 10/s

"""The report's streaming accumulators: bins, clipping, bounded samples, pause periods, and
the totals they add up to, with exact numbers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest

from app.ledger import dashboard_queries
from app.outputs.report_stats import (
    Histogram,
    ReportData,
    Reservoir,
    ServerTotals,
    Throughput,
    accumulate,
    log_edges,
    nice_bin_width_s,
    pause_periods,
    serving_pauses,
)
from ops.views.report_page import warnings_for
from tests.support.runs import make_counts

T0 = datetime(2031, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_log_edges_for_token_counts_are_distinct_integers() -> None:
    edges = log_edges(1, 2049, 60, integers=True)
    assert edges[0] == 1 and edges[-1] == 2049
    assert edges == sorted(set(edges)) and all(e == int(e) for e in edges)
    ratios = [b / a for a, b in pairwise(edges[len(edges) // 2 :])]
    assert max(ratios) < 1.2  # log-spaced where it matters
    assert log_edges(5, 5, 10)[-1] == 10  # a degenerate range still has a bin


def test_histogram_bins_and_clips() -> None:
    hist = Histogram([1, 10, 100, 1000])
    for value in (0, 1, 9, 10, 99.5, 100, 999, 1000, 5000):
        hist.add(value)
    assert hist.counts == [3, 2, 4] and hist.total == 9
    with pytest.raises(ValueError):
        Histogram([1])


def test_reservoir_is_bounded_uniform_and_reproducible() -> None:
    first, second = Reservoir(100, seed=3), Reservoir(100, seed=3)
    for i in range(10_000):
        first.add((i, i, False))
        second.add((i, i, False))
    assert len(first.items) == 100 and first.seen == 10_000 and first.sampled
    assert first.items == second.items
    assert sum(p for p, _, _ in first.items) / 100 == pytest.approx(5000, rel=0.25)
    small = Reservoir(100)
    small.add((1, 2, True))
    assert small.items == [(1, 2, True)] and not small.sampled


def test_time_bins_are_round_and_few() -> None:
    assert nice_bin_width_s(30) == 1
    assert nice_bin_width_s(20 * 60) == 15
    assert nice_bin_width_s(30 * 3600) == 1800
    assert nice_bin_width_s(40 * 86400) == 86400
    tp = Throughput.spanning(T0, at(95))
    assert (tp.width_s, tp.bins, tp.end) == (1.0, 95, at(95))
    tp.add("a", at(0.5), 10)
    tp.add("a", at(0.9), 5)
    tp.add("a", at(95), 7)
    tp.add("a", at(500), 1)  # clipped into the last bin
    assert tp.tokens["a"][0] == 15 and tp.tokens["a"][-1] == 8
    assert tp.tokens_per_s("b") == [0.0] * 95
    tail = Throughput.spanning(T0, at(20 * 60 + 5))  # 15 s bins; 5 s left over join the last
    assert (tail.width_s, tail.bins, tail.edges_s()[-2:]) == (15.0, 80, [1185.0, 1205.0])
    tail.add("a", at(1203), 50)
    tail.add("a", at(0), 30)
    rates = tail.tokens_per_s("a")
    assert (rates[0], rates[-1], sum(rates[1:-1])) == (2.0, 2.5, 0.0)
    assert Throughput.spanning(T0, at(20 * 60 + 10)).edges_s()[-2:] == [1200.0, 1210.0]


def test_pause_periods_pair_pauses_with_resumes() -> None:
    events = [
        dashboard_queries.ServerEvent(at(-50), "paused", "a"),  # began before the window
        dashboard_queries.ServerEvent(at(10), "resumed", "a"),
        dashboard_queries.ServerEvent(at(20), "paused", "b"),
        dashboard_queries.ServerEvent(
            at(25), "paused", "b"
        ),  # re-paused by someone else: same period
        dashboard_queries.ServerEvent(at(40), "resumed", "b"),
        dashboard_queries.ServerEvent(at(45), "resumed", "b"),  # nothing open: ignored
        dashboard_queries.ServerEvent(at(60), "state", "b"),
        dashboard_queries.ServerEvent(at(90), "paused", "a"),  # never resumed
        dashboard_queries.ServerEvent(at(150), "paused", "c"),  # after the window
    ]
    periods = pause_periods(
        events, paused_kind="paused", resumed_kind="resumed", since=at(0), until=at(100)
    )
    assert [(p.server, p.start, p.end, p.open, p.paused_at) for p in periods] == [
        ("a", at(0), at(10), False, at(-50)),
        ("b", at(20), at(40), False, at(20)),
        ("a", at(90), at(100), True, at(90)),
    ]


def test_only_servers_that_served_the_run_are_shaded_only_while_they_did() -> None:
    pauses = pause_periods(
        [
            dashboard_queries.ServerEvent(at(0), "paused", "idle"),  # never took an item of the run
            dashboard_queries.ServerEvent(
                at(5), "paused", "a"
            ),  # began before a joined (at 20): shaded from 20
            dashboard_queries.ServerEvent(at(25), "resumed", "a"),
            dashboard_queries.ServerEvent(at(40), "paused", "a"),  # while a served: shaded
            dashboard_queries.ServerEvent(at(50), "resumed", "a"),
            dashboard_queries.ServerEvent(
                at(80), "paused", "a"
            ),  # after a's last item (at 70): not shaded
        ],
        paused_kind="paused",
        resumed_kind="resumed",
        since=at(0),
        until=at(100),
    )
    served = ServerTotals()
    served.served(at(20), at(30))
    served.served(at(60), at(70))
    shaded = serving_pauses(pauses, {"a": served})
    assert [(p.server, p.start, p.end, p.open) for p in shaded] == [
        ("a", at(20), at(25), False),
        ("a", at(40), at(50), False),
    ]


def item(
    id: int,
    status: str = "done",
    *,
    server: str | None = "a",
    tokens: int | None = 100,
    reason: str | None = "stop",
    latency: float | None = 2.0,
    finished: float = 10,
) -> dashboard_queries.ItemStats:
    return dashboard_queries.ItemStats(
        id=id,
        status=status,
        server=server,
        finish_reason=reason if status == "done" else None,
        prompt_tokens=20,
        completion_tokens=tokens if status == "done" else None,
        latency_s=latency if status == "done" else None,
        started_at=at(finished - 2),
        finished_at=at(finished),
    )


def test_report_data_adds_up() -> None:
    ranges = dashboard_queries.ItemRanges(at(0), at(2), at(60), 0.5, 8.0, 256)
    stream = [
        item(1, tokens=100, latency=0.5, finished=2),
        item(2, tokens=256, reason="length", latency=8.0, finished=30),
        item(3, server="b", tokens=0, latency=1.0, finished=31),
        item(4, "failed", server="b", finished=40),
        item(5, server=None, tokens=10, latency=None, finished=60),
        item(6, "leased"),  # not finished: not counted anywhere
    ]
    data = accumulate(stream, ranges, max_new_tokens=256)
    assert (data.done, data.truncated, data.failed, data.empty_outputs) == (4, 1, 1, 1)
    assert (data.output_tokens, data.max_output_tokens) == (366, 256)
    assert dict(data.finish_reasons) == {"stop": 3, "length": 1, "failed": 1}
    assert data.stop_lengths.total == 3 and data.truncated_lengths.total == 1
    assert data.truncated_lengths.counts[-1] == 1  # at max_new_tokens: the last bin
    a, b, none = data.servers["a"], data.servers["b"], data.servers["(none)"]
    assert (a.done, a.truncated, a.failed, a.output_tokens, a.mean_latency_s) == (
        2,
        1,
        0,
        356,
        4.25,
    )
    assert (b.done, b.failed, b.output_tokens) == (1, 1, 0)
    assert (none.done, none.mean_latency_s) == (1, None)
    assert {s: h.total for s, h in data.latency.items()} == {"a": 2, "b": 1}
    assert data.throughput is not None and data.throughput.width_s == 1.0
    assert sum(data.throughput.tokens["a"]) == 356
    assert data.scatter.items == [
        (20, 100, False),
        (20, 256, True),
        (20, 0, False),
        (20, 10, False),
    ]
    assert data.output_percentile(50) == 10.0


def test_an_empty_run_has_no_throughput_and_no_flags_but_unfinished() -> None:
    empty = ReportData.for_ranges(
        dashboard_queries.ItemRanges(None, None, None, None, None, None), max_new_tokens=64
    )
    assert empty.throughput is None and empty.output_percentile(50) is None
    assert warnings_for(make_counts(total=3, pending=3), empty) == [
        "The run is not finished: 3 of 3 items remain."
    ]


def test_warnings_name_truncation_failure_and_empty_outputs() -> None:
    ranges = dashboard_queries.ItemRanges(at(0), at(1), at(2), 1.0, 1.0, 64)
    stream = [item(i, tokens=64, reason="length") for i in range(2)]
    stream += [item(10 + i, tokens=0 if i == 0 else 5) for i in range(8)]
    stream += [item(99, "failed")]
    data = accumulate(stream, ranges, max_new_tokens=64)
    assert warnings_for(make_counts(total=11, done=10, failed=1), data) == [
        "20.0% of samples were truncated at max_new_tokens = 64 (more than 5%).",
        "9.1% of finished items failed (more than 1%); see the failure reasons.",
        "1 samples have an empty output.",
    ]

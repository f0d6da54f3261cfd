"""Acceptance arithmetic of `tokenmill accept`: the estimates by their definitions, groups by
field, turn and output length, seeded intervals, and the paired comparison's verdicts and
output check."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.outputs.accept_pairs import Side, paired_report
from app.outputs.acceptance import (
    LENGTH_FIELD,
    TURN_FIELD,
    AcceptRow,
    accept_report,
    default_fields,
    length_bucket,
    output_digest,
)


def row(key: str, tokens: int, steps: int, correct: int, **meta: str) -> AcceptRow:
    return AcceptRow(
        key=key,
        sample=0,
        turn=int(meta.pop("turn", "0")),
        metadata=dict(meta),
        completion_tokens=tokens,
        verify_ct=steps,
        correct=correct,
        proposed=steps * 3,
        histogram=(steps - correct // 3, 0, 0, correct // 3),
        output_digest=output_digest([tokens]),
    )


ROWS = [
    row("a", 100, 50, 40, category="chat"),
    row("b", 300, 100, 150, category="code"),
    row("c", 10, 4, 3, category="code"),
    row("d", 1, 0, 0, category="chat"),  # a one-token output: no verify step
]


def test_estimates_follow_their_definitions() -> None:
    report = accept_report("r", None, ROWS, ["category"], resamples=200)
    assert report.without_stats == 1 and report.done == 4
    overall = report.overall
    assert overall is not None
    assert overall.requests == 3 and overall.tokens == 410 and overall.verify_steps == 154
    assert overall.accept_length == 410 / 154
    assert overall.mean_accept_length == pytest.approx((2 + 3 + 2.5) / 3)
    assert overall.accept_rate == 193 / (154 * 3)
    code = {g.value: g for g in report.by["category"]}["code"]
    assert code.accept_length == 310 / 104
    low, high = code.accept_length_ci
    assert low <= code.accept_length <= high


def test_intervals_are_seeded() -> None:
    rows = [row(f"k{i}", 50 + i, 20 + i % 7, i % 30, category="x") for i in range(60)]
    first = accept_report("r", None, rows, ["category"], seed=3, resamples=300)
    again = accept_report("r", None, rows, ["category"], seed=3, resamples=300)
    other = accept_report("r", None, rows, ["category"], seed=4, resamples=300)
    assert first.to_json() == again.to_json()
    assert first.overall and other.overall
    assert first.overall.accept_length_ci != other.overall.accept_length_ci


def test_turns_and_output_lengths_group() -> None:
    rows = [
        row("c1", 100, 40, 30, turn="0"),
        row("c1", 700, 200, 200, turn="1"),
        row("c2", 90, 45, 10, turn="0"),
    ]
    assert default_fields(rows, "each") == [TURN_FIELD, LENGTH_FIELD]
    assert default_fields(ROWS, "last") == ["category", LENGTH_FIELD]
    report = accept_report("r", None, rows, [TURN_FIELD, LENGTH_FIELD], resamples=200)
    assert [(g.value, g.requests) for g in report.by[TURN_FIELD]] == [("0", 2), ("1", 1)]
    assert [g.value for g in report.by[LENGTH_FIELD]] == ["1-127", "512-1023"]
    assert length_bucket(127) == "1-127" and length_bucket(40_000) == "32768+"


def test_pairs_name_the_better_draft_and_the_worse_groups() -> None:
    a = [row(f"k{i}", 200, 100, 60, category=("up" if i % 2 else "down")) for i in range(40)]
    b = [
        replace(r, verify_ct=70 if r.metadata["category"] == "up" else 120 + i % 3)
        for i, r in enumerate(a)
    ]
    report = paired_report(
        Side("A", None, a), Side("B", None, b), ["category"], greedy=True, resamples=300
    )
    verdicts = {g.value: g.verdict for g in report.by["category"]}
    assert verdicts == {"down": "worse", "up": "better"}
    assert [(g.field, g.value) for g in report.worse_groups()] == [("category", "down")]
    assert not report.outputs.red_flag and report.outputs.compared == 40


def test_differing_greedy_outputs_are_a_red_flag() -> None:
    a = [row(f"k{i}", 200, 100, 60) for i in range(10)]
    b = [replace(r, output_digest="other") if i < 2 else r for i, r in enumerate(a)]
    b.append(row("only-b", 5, 2, 1))
    greedy = paired_report(Side("A", None, a), Side("B", None, b), [], greedy=True)
    assert greedy.outputs.red_flag and greedy.outputs.differing == 2
    assert greedy.outputs.examples == [("k0", 0, 0), ("k1", 0, 0)]
    assert (greedy.only_a, greedy.only_b) == (0, 1)
    assert greedy.overall is not None and greedy.overall.verdict == "unclear"
    sampled = paired_report(Side("A", None, a), Side("B", None, b), [], greedy=False)
    assert not sampled.outputs.red_flag and sampled.outputs.differing == 2


def test_dotted_fields_read_inside_objects() -> None:
    nested = [replace(r, metadata={"metadata": dict(r.metadata)}) for r in ROWS]
    report = accept_report("r", None, nested, ["metadata.category"], resamples=200)
    assert [g.value for g in report.by["metadata.category"]] == ["chat", "code"]

"""Speculative counters in the ledger: written with the winning result only, read back per run,
gone with the run; `accept` and the report read them on SQLite and Postgres alike."""

from __future__ import annotations

from sqlalchemy import Engine, delete

from app.core.contracts import GenerateResult, SpecStats
from app.ledger import common, outcomes, queue, spec_stats
from app.outputs.accept_rows import load_rows
from app.outputs.acceptance import accept_report
from tests.support.done_runs import make_done_run
from tests.support.spec_runs import CATEGORIES, make_spec_run


def result(item_id: int, stats: SpecStats | None) -> GenerateResult:
    return GenerateResult(
        rid=f"r{item_id}",
        output_ids=[5] * 9,
        finish_reason="stop",
        matched_stop=5,
        prompt_tokens=3,
        completion_tokens=9,
        cached_tokens=0,
        e2e_latency_s=0.1,
        spec=stats,
    )


def test_the_first_result_keeps_its_counters(db: Engine) -> None:
    run = make_done_run(db, "plain", 2, extra=True)  # the pending "bad" sample is left
    with db.connect() as conn:
        assert not spec_stats.run_has_spec_stats(conn, run.id)
        pending = queue.pending_ids(conn, run.id, limit=10)
    item_id = pending[0]
    first = SpecStats(4, 4, 12, 2.25, 1 / 3, (1, 2, 1))
    later = SpecStats(2, 6, 6, 4.5, 1.0, (0, 0, 0, 2))
    with db.begin() as conn:  # a hedge's two results in one write: the first wins
        outcomes.record_outcomes(
            conn,
            [
                outcomes.Done(item_id, result(item_id, first)),
                outcomes.Done(item_id, result(item_id, later)),
            ],
            owner="t",
            lease_s=60,
        )
    with db.begin() as conn:  # and a copy finishing later changes nothing
        outcomes.record_outcomes(
            conn, [outcomes.Done(item_id, result(item_id, later))], owner="t", lease_s=60
        )
    with db.connect() as conn:
        assert spec_stats.run_spec_stats(conn, run.id) == {item_id: first}
        assert spec_stats.run_has_spec_stats(conn, run.id)
    with db.begin() as conn:
        conn.execute(delete(common.runs).where(common.runs.c.id == run.id))
    with db.connect() as conn:
        assert spec_stats.run_spec_stats(conn, run.id) == {}


def test_accept_reads_the_stored_counters(db: Engine) -> None:
    run = make_spec_run(db, "draft-a", prompts=60)
    rows = load_rows(db, run)
    with db.connect() as conn:
        stored = spec_stats.run_spec_stats(conn, run.id)
    assert len(rows) == len(stored) == 60
    report = accept_report(run.name, None, rows, ["category"], resamples=200)
    assert report.overall is not None and report.without_stats == 0
    assert report.overall.verify_steps == sum(s.verify_ct for s in stored.values())
    by = {g.value: g for g in report.by["category"]}
    assert set(by) == set(CATEGORIES)
    # the categories' acceptance chances order their lengths
    assert by["code"].accept_length > by["math"].accept_length > by["chat"].accept_length

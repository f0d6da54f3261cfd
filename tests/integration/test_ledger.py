"""The ledger on SQLite and real Postgres: conditional claims, idempotent writes, counts."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import Engine, update

from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import NotFound, RunMismatch
from app.ledger import claims, common, outcomes, queue, reads, run_queries


def spec(name: str = "r1", **sampling: object) -> run_queries.RunSpec:
    return run_queries.RunSpec(
        name=name,
        tokenizer_path="/tok",
        tokenizer_hash="a" * 64,
        chat_template_hash="b" * 64,
        chat_template_kwargs={},
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
        samples_per_prompt=2,
        think_end_id=163607,
        eos_token_ids=[163586],
    )


def result(ids: list[int], finish: str = "stop") -> GenerateResult:
    # prompt_tokens 3: what the server reports for new_items' 3-id prompts (the ledger keeps it)
    return GenerateResult("rid", ids, finish, ids[-1], 3, len(ids), 0, 0.5)  # type: ignore[arg-type]


def new_items(n: int, samples: int = 2) -> list[queue.NewItem]:
    return [
        queue.NewItem(f"k{i}", s, i + 1, [{"role": "user", "content": f"q{i}"}], [1, 2, i + 100])
        for i in range(n)
        for s in range(samples)
    ]


@pytest.fixture
def run(db: Engine) -> run_queries.RunInfo:
    with db.begin() as conn:
        info, created = run_queries.get_or_create_run(conn, spec(seed=7))
    assert created
    return info


def test_insert_is_idempotent_and_token_arrays_round_trip(
    db: Engine, run: run_queries.RunInfo
) -> None:
    big = list(range(0, 163_840, 7))
    with db.begin() as conn:
        assert queue.insert_items(conn, run.id, new_items(3)) == 6
        assert queue.insert_items(conn, run.id, new_items(4)) == 2
        assert queue.insert_items(conn, run.id, [queue.NewItem("big", 0, 9, None, big)]) == 1
    with db.connect() as conn:
        stored = {
            i.item_key: i
            for i in reads.iter_items(conn, run.id, statuses=("pending",))
            if i.sample_index == 0
        }
    assert stored["big"].prompt_ids == big
    assert stored["k1"].messages == [{"role": "user", "content": "q1"}]


def test_same_run_with_other_settings_is_refused(db: Engine, run: run_queries.RunInfo) -> None:
    with db.begin() as conn:
        again, created = run_queries.get_or_create_run(conn, spec(seed=7))
        assert not created and again.id == run.id
        with pytest.raises(RunMismatch, match=r"temperature: 1.0 → 0.6"):
            run_queries.get_or_create_run(conn, spec(seed=7, temperature=0.6))


def test_claim_is_conditional_so_redelivery_claims_nothing(
    db: Engine, run: run_queries.RunInfo
) -> None:
    with db.begin() as conn:
        queue.insert_items(conn, run.id, new_items(2))
        ids = queue.pending_ids(conn, run.id)
        assert queue.mark_queued(conn, ids) == 4
        first = claims.claim_items(conn, ids, owner="w1", server="a", lease_s=60)
        again = claims.claim_items(conn, ids, owner="w2", server="b", lease_s=60)
    assert [c.id for c in first] == ids
    assert again == []


def test_expired_lease_can_be_claimed_again(db: Engine, run: run_queries.RunInfo) -> None:
    with db.begin() as conn:
        queue.insert_items(conn, run.id, new_items(1, samples=1))
        ids = queue.pending_ids(conn, run.id)
        claims.claim_items(conn, ids, owner="dead", server="a", lease_s=60)
        conn.execute(
            update(common.items).values(lease_expires_at=common.utcnow() - timedelta(seconds=1))
        )
        assert outcomes.requeue_expired(conn, run_id=run.id) == ids
        assert outcomes.requeue_expired(conn, run_id=run.id) == []
        assert [
            c.id for c in claims.claim_items(conn, ids, owner="w", server="a", lease_s=9)
        ] == ids


def test_first_result_wins_and_is_never_overwritten(db: Engine, run: run_queries.RunInfo) -> None:
    with db.begin() as conn:
        queue.insert_items(conn, run.id, new_items(1, samples=1))
        (item_id,) = queue.pending_ids(conn, run.id)
        claims.claim_items(conn, [item_id], owner="w1", server="a", lease_s=60)
        outcomes.record_outcomes(
            conn, [outcomes.Done(item_id, result([5, 6, 163586]))], owner="w1", lease_s=60
        )
        # a duplicate worker finishing later (or a failure report) changes nothing
        outcomes.record_outcomes(
            conn, [outcomes.Done(item_id, result([9, 9, 9], "length"))], owner="w2", lease_s=60
        )
        outcomes.record_outcomes(conn, [outcomes.Failed(item_id, "late")], owner="w2", lease_s=60)
    with db.connect() as conn:
        (stored,) = list(reads.iter_items(conn, run.id))
        counts = reads.run_counts(conn, run)
    assert stored.output_ids == [5, 6, 163586]
    assert stored.finish_reason == "stop" and stored.attempts == 1 and stored.error is None
    assert counts.done == 1 and counts.total == 1 and counts.output_tokens == 3


def test_retry_counts_attempts_release_does_not(db: Engine, run: run_queries.RunInfo) -> None:
    with db.begin() as conn:
        queue.insert_items(conn, run.id, new_items(1))
        a, b = queue.pending_ids(conn, run.id)
        claims.claim_items(conn, [a, b], owner="w1", server="s", lease_s=60)
        outcomes.record_outcomes(conn, [outcomes.RetryLater(a, "HTTP 500")], owner="w1", lease_s=60)
        back = outcomes.record_outcomes(
            conn, [outcomes.Released(b, "server down")], owner="w1", lease_s=60
        )
        assert back == [b]
        # only the lease holder may release
        assert (
            outcomes.record_outcomes(conn, [outcomes.Released(a, "x")], owner="other", lease_s=60)
            == []
        )
    with db.connect() as conn:
        rows = {i.id: i for i in reads.iter_items(conn, run.id, statuses=("leased", "queued"))}
    assert rows[a].attempts == 1 and rows[a].status == "leased" and rows[a].error == "HTTP 500"
    assert rows[b].attempts == 0 and rows[b].status == "queued"


def test_concurrent_claimers_never_share_an_item(db: Engine, run: run_queries.RunInfo) -> None:
    with db.begin() as conn:
        queue.insert_items(conn, run.id, new_items(100))
    claimed: dict[str, list[int]] = {}

    def worker(name: str) -> None:
        got: list[int] = []
        while True:
            with db.begin() as conn:
                batch = claims.claim_next(
                    conn, owner=name, server="s", lease_s=60, limit=7, run_id=run.id
                )
            if not batch:
                break
            got += [c.id for c in batch]
        claimed[name] = got

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [i for got in claimed.values() for i in got]
    assert len(everything) == 200 and len(set(everything)) == 200


def test_release_owner_and_counts(db: Engine, run: run_queries.RunInfo) -> None:
    with db.begin() as conn:
        queue.insert_items(conn, run.id, new_items(3))
        ids = queue.pending_ids(conn, run.id)
        claims.claim_items(conn, ids[:4], owner="w1", server="s", lease_s=60)
        outcomes.record_outcomes(
            conn,
            [
                outcomes.Done(ids[0], result([1, 2, 3, 4], "length")),
                outcomes.Failed(ids[1], "permanent: too long"),
            ],
            owner="w1",
            lease_s=60,
        )
        assert outcomes.release_owner(conn, "w1") == ids[2:4]
        counts = reads.run_counts(conn, run)
    assert counts.to_json() == {
        "run": "r1",
        "total": 6,
        "waiting": 0,
        "pending": 2,
        "queued": 2,
        "leased": 0,
        "done": 1,
        "failed": 1,
        "truncated": 1,
        "output_tokens": 4,
        "prompt_tokens": 18,
    }
    assert not counts.finished


def test_many_outcomes_in_one_write(db: Engine, run: run_queries.RunInfo) -> None:
    with db.begin() as conn:
        queue.insert_items(conn, run.id, new_items(3))
        ids = queue.pending_ids(conn, run.id)
        claims.claim_items(conn, ids, owner="w", server="s", lease_s=60)
        outcomes.record_outcomes(
            conn,
            [outcomes.Done(i, result([i, 163586])) for i in ids[:3]]
            + [outcomes.Failed(i, f"bad {i}") for i in ids[3:5]]
            + [outcomes.RetryLater(ids[5], "500")],
            owner="w",
            lease_s=60,
        )
    with db.connect() as conn:
        rows = {i.id: i for i in reads.iter_items(conn, run.id, statuses=("done", "failed"))}
    assert {i: (r.status, r.output_ids) for i, r in rows.items()} == {
        **{i: ("done", [i, 163586]) for i in ids[:3]},
        **{i: ("failed", None) for i in ids[3:5]},
    }


def test_unknown_run_is_not_found(db: Engine) -> None:
    with db.connect() as conn, pytest.raises(NotFound, match="no run named 'nope'"):
        run_queries.get_run(conn, "nope")


def test_fingerprint_is_pinned_once(db: Engine, run: run_queries.RunInfo) -> None:
    with db.begin() as conn:
        first = run_queries.pin_fingerprint(conn, run.id, {"model_path": "a"})
        second = run_queries.pin_fingerprint(conn, run.id, {"model_path": "b"})
    assert first == second == {"model_path": "a"}

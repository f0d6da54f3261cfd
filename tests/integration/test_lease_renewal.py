"""The lease heartbeat rewrites a leased item's row once per half term, not at every beat: a
lease with more than max(lease_s / 2, 2 * heartbeat_s) left is left alone, one past that is
renewed to a full term."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Engine, select, update

from app.ledger import claims, common, queue
from tests.support.runs import make_run


def expiries(engine: Engine) -> list[float]:
    """Seconds left on each lease, in id order."""
    now = common.utcnow()
    with engine.connect() as conn:
        found = conn.execute(
            select(common.items.c.lease_expires_at).order_by(common.items.c.id)
        ).scalars()
        return [(at - now).total_seconds() for at in found]


def test_a_lease_is_renewed_once_past_half_its_term(pg_engine: Engine) -> None:
    with pg_engine.begin() as conn:
        run = make_run(conn, "leases")
        new = [queue.NewItem(f"k{i}", 0, i, None, [1, 2, 3]) for i in range(3)]
        queue.insert_items(conn, run.id, new)
        ids = queue.pending_ids(conn, run.id)
        claims.claim_items(conn, ids, owner="w", server="s", lease_s=300)
        # the first two are past half their term (100 s and 149 s left); the third is not
        for item_id, left_s in zip(ids[:2], (100, 149), strict=True):
            conn.execute(
                update(common.items)
                .where(common.items.c.id == item_id)
                .values(lease_expires_at=common.utcnow() + timedelta(seconds=left_s))
            )
    with pg_engine.begin() as conn:
        assert claims.extend_leases(conn, owner="w", lease_s=300, heartbeat_s=30) == 2
    assert [round(s) for s in expiries(pg_engine)] == [300, 300, 300]
    with pg_engine.begin() as conn:  # at the next beat, nothing is past half its term
        assert claims.extend_leases(conn, owner="w", lease_s=300, heartbeat_s=30) == 0


def test_a_slow_heartbeat_renews_every_lease_with_less_than_two_beats_left(
    pg_engine: Engine,
) -> None:
    with pg_engine.begin() as conn:
        run = make_run(conn, "slow-beat")
        queue.insert_items(conn, run.id, [queue.NewItem("k", 0, 0, None, [1, 2, 3])])
        claims.claim_items(conn, queue.pending_ids(conn, run.id), owner="w", server="s", lease_s=60)
    with pg_engine.begin() as conn:
        # 60 s left: more than half the term, less than two beats of 40 s
        assert claims.extend_leases(conn, owner="w", lease_s=60, heartbeat_s=40) == 1

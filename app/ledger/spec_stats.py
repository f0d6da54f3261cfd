"""Speculative-decoding counters of done items (item_spec_stats): written beside the result that
carried them, and read back per run for `tokenmill accept` and the report."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import JSON, Connection, DateTime, bindparam, select, text

from app.core.contracts import SpecStats
from app.core.models import item_spec_stats

# Only for an item that this very write finished (status done, finished_at this write's time):
# a later copy's counters (a hedge whose result lost) never replace the winner's.
_INSERT = text(
    """
INSERT INTO item_spec_stats (item_id, run_id, verify_ct, num_correct_drafts,
    num_proposed_drafts, accept_length, accept_rate, histogram)
SELECT items.id, items.run_id, :verify_ct, :correct, :proposed, :accept_length, :accept_rate,
    :histogram
FROM items
WHERE items.id = :item_id AND items.status = 'done' AND items.finished_at = :now
ON CONFLICT (item_id) DO NOTHING
"""
).bindparams(
    bindparam("now", type_=DateTime(timezone=True)),
    bindparam("histogram", type_=JSON()),
)


def record_spec_stats(
    conn: Connection, stats: Sequence[tuple[int, SpecStats]], now: datetime
) -> None:
    """Store the counters of items finished by the write at `now` (first result wins)."""
    if not stats:
        return
    conn.execute(
        _INSERT,
        [
            {
                "item_id": item_id,
                "verify_ct": s.verify_ct,
                "correct": s.num_correct_drafts,
                "proposed": s.num_proposed_drafts,
                "accept_length": s.accept_length,
                "accept_rate": s.accept_rate,
                "histogram": list(s.histogram),
                "now": now,
            }
            for item_id, s in stats
        ],
    )


def run_spec_stats(conn: Connection, run_id: int) -> dict[int, SpecStats]:
    """Every stored counter of a run, by item id."""
    t = item_spec_stats
    stmt = select(
        t.c.item_id,
        t.c.verify_ct,
        t.c.num_correct_drafts,
        t.c.num_proposed_drafts,
        t.c.accept_length,
        t.c.accept_rate,
        t.c.histogram,
    ).where(t.c.run_id == run_id)
    return {
        int(row.item_id): SpecStats(
            verify_ct=int(row.verify_ct),
            num_correct_drafts=int(row.num_correct_drafts),
            num_proposed_drafts=int(row.num_proposed_drafts),
            accept_length=float(row.accept_length),
            accept_rate=float(row.accept_rate),
            histogram=tuple(int(n) for n in row.histogram or ()),
        )
        for row in conn.execute(stmt)
    }


def run_has_spec_stats(conn: Connection, run_id: int) -> bool:
    t = item_spec_stats
    stmt = select(t.c.item_id).where(t.c.run_id == run_id).limit(1)
    return conn.execute(stmt).first() is not None

"""The Postgres bulk insert of items (COPY into a temporary table, then INSERT ... SELECT ...
ON CONFLICT DO NOTHING) against the plain multi-row INSERT SQLite keeps: same rows, same count."""

from __future__ import annotations

from sqlalchemy import Engine, select

from app.ledger import common, queue
from tests.support.runs import make_run

# text COPY escapes tabs, newlines and backslashes; JSON adds its own escapes on top
AWKWARD = 'tab\there, newline\nthere, back\\slash, "quotes", \\N, ünï, \u2028, \x7f'


def test_bulk_insert_counts_new_rows_exactly_and_keeps_order(db: Engine) -> None:
    with db.begin() as conn:
        run = make_run(conn, "copy")
    first = [
        queue.NewItem(f"key\t{i}\\", 0, i + 1, [{"role": "user", "content": AWKWARD}], [i, 7])
        for i in range(5)
    ]
    # a duplicate inside one call, rows already present, a waiting later turn, no messages
    second = [
        first[1],
        queue.NewItem("new", 0, None, None, [163_839, 0, 1]),
        queue.NewItem("new", 0, None, None, [9]),
        queue.NewItem("new", 0, None, None, [], turn_index=1, waiting=True),
        first[4],
    ]
    with db.begin() as conn:
        assert queue.insert_items(conn, run.id, first) == 5
        # a second call in the same transaction sees none of the first call's load rows
        assert queue.insert_items(conn, run.id, second) == 2
    with db.begin() as conn:
        assert queue.insert_items(conn, run.id, second) == 0
    with db.connect() as conn:
        rows = conn.execute(
            select(
                common.items.c.item_key,
                common.items.c.turn_index,
                common.items.c.status,
                common.items.c.messages,
                common.items.c.prompt_ids,
                common.items.c.prompt_tokens,
                common.items.c.line_no,
            )
            .where(common.items.c.run_id == run.id)
            .order_by(common.items.c.id)
        ).all()
    assert [(r.item_key, r.turn_index) for r in rows] == [
        *((f"key\t{i}\\", 0) for i in range(5)),
        ("new", 0),
        ("new", 1),
    ]
    assert rows[0].messages == [{"role": "user", "content": AWKWARD}]
    assert rows[2].prompt_ids == [2, 7] and rows[2].prompt_tokens == 2 and rows[2].line_no == 3
    assert rows[5].prompt_ids == [163_839, 0, 1] and rows[5].messages is None
    assert rows[5].line_no is None and rows[5].status == "pending"
    assert rows[6].prompt_ids == [] and rows[6].status == "waiting"

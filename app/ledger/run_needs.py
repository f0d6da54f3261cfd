"""What a run asks of a server's limits: its largest request (its longest prompt and the tokens
it asks to generate), which a server's context length, largest input and KV pool must admit for
the server to serve the run (app.sglang.limits.refusal)."""

from __future__ import annotations

from sqlalchemy import Connection, func, select

from app.ledger.common import items
from app.sglang.limits import RequestNeed


def longest_prompt(conn: Connection, run_id: int) -> int | None:
    """The prompt tokens of the run's longest item (None: the run has none): one probe of the
    (run_id, prompt_tokens) index, whatever the run's size."""
    stmt = select(func.max(items.c.prompt_tokens)).where(items.c.run_id == run_id)
    value = conn.execute(stmt).scalar()
    return None if value is None else int(value)


def largest_request(conn: Connection, run_id: int, max_new_tokens: int) -> RequestNeed | None:
    """The run's largest request: its longest prompt with the run's max_new_tokens (a row's own
    max_new_tokens is not read here: a server it does not fit refuses that item, which another
    server then confirms or serves). None: the run has no items."""
    longest = longest_prompt(conn, run_id)
    return None if longest is None else RequestNeed(longest, max_new_tokens)

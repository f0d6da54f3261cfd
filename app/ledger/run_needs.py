"""What a run asks of a server's limits: its largest request within the limits it pinned (its
longest such prompt and the tokens it asks to generate), which a server's context length,
largest input and KV pool must admit for the server to serve the run
(app.sglang.limits.refusal)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, select

from app.ledger import common
from app.sglang import limits
from app.sglang.limits import RequestNeed


def longest_prompt(conn: Connection, run_id: int, at_most: int | None = None) -> int | None:
    """The prompt tokens of the run's longest item (of at most at_most tokens, when given;
    None: the run has none): a read of the run's rows (O(the run)), so its callers read it
    once per run and worker process, or once per restart, never periodically."""
    stmt = select(func.max(common.items.c.prompt_tokens)).where(common.items.c.run_id == run_id)
    if at_most is not None:
        stmt = stmt.where(common.items.c.prompt_tokens <= at_most)
    value = conn.execute(stmt).scalar()
    return None if value is None else int(value)


def largest_request(
    conn: Connection, run_id: int, max_new_tokens: int, pinned: dict[str, Any] | None = None
) -> RequestNeed | None:
    """The run's largest request that the limits it pinned admit (a longer prompt is its
    item's own failure on every server, not a reason to leave the run): its longest such
    prompt with the run's max_new_tokens (a row's own max_new_tokens is not read here: a
    server it does not fit refuses that item, which another server then confirms or serves).
    None: the run has no such items."""
    longest = longest_prompt(conn, run_id, limits.largest_input(pinned, max_new_tokens))
    return None if longest is None else RequestNeed(longest, max_new_tokens)

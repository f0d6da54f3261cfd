"""`tokenmill priority RUN N`: change a live run's priority (higher first).

The ledger is the one place it lives: every worker re-reads the priorities of the runs with
items every few seconds (workers/engine/scheduling.py) and gives its next free slots by them,
so the change reaches the items already queued without a message being sent again.
"""

from __future__ import annotations

import click

from ops.options import handle_errors, open_db, print_json


@click.command("priority")
@click.argument("run_name")
@click.argument("priority", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the change as JSON.")
@handle_errors
def priority_cmd(run_name: str, priority: int, as_json: bool) -> None:
    """Give RUN_NAME priority PRIORITY (an integer, higher first; new runs have 0).

    Free slots go to the highest-priority run with items, runs of one priority share them
    round robin; nothing in flight is aborted. Workers see the change within seconds, for
    items already queued too.
    """
    from app.core.constants import EVENT_PRIORITY, PRIORITY_REFRESH_S
    from app.ledger import event_log, run_queries

    db = open_db()
    with db.begin() as conn:
        run = run_queries.get_run(conn, run_name)
        before = run_queries.set_priority(conn, run_name, priority)
        if before != priority:
            event_log.record_event(
                conn,
                EVENT_PRIORITY,
                f"run {run_name}: priority {before} → {priority}",
                run_id=run.id,
                details={"before": before, "priority": priority},
            )
    if as_json:
        print_json({"run": run_name, "before": before, "priority": priority})
        return
    if before == priority:
        click.echo(f"run {run_name}: priority {priority} (unchanged)")
        return
    click.echo(
        f"run {run_name}: priority {before} → {priority}; workers give their next free slots "
        f"by it within {PRIORITY_REFRESH_S:g} s"
    )

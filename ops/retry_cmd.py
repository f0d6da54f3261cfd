"""`tokenmill retry`: a run's failed items (all, or by reason, server, time) back to the queue
with fresh attempts, counted by reason; `--dry-run` says what it would re-queue and changes
nothing. Done items are never touched.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import click

from ops.options import (
    announce_embedded,
    broker_name,
    check_broker,
    get_settings,
    handle_errors,
    open_db,
    print_json,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from app.core.settings import Settings
    from app.ledger import retries, run_queries

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, *, now: datetime | None = None) -> datetime:
    """`--since`: a time (ISO 8601; without a zone, UTC) or a duration back from now (`90m`,
    `2h`, `1d`, `30s`)."""
    now = now or datetime.now(UTC)
    match = _DURATION.match(text.strip())
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is neither a time (2026-12-02T14:00) nor a duration (90m, 2h, 1d)",
            param_hint="--since",
        ) from None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


@click.command("retry")
@click.argument("run_name")
@click.option(
    "--reason",
    default=None,
    metavar="TEXT",
    help="Only items whose failure reason holds TEXT (any case); `tokenmill status RUN` lists "
    "the reasons.",
)
@click.option("--server", default=None, metavar="NAME", help="Only items that failed on NAME.")
@click.option(
    "--since",
    default=None,
    metavar="T",
    help="Only items that failed at or after T: a time (ISO 8601, UTC unless it says) or a "
    "duration back from now (90m, 2h, 1d).",
)
@click.option("--dry-run", is_flag=True, help="Say what would be re-queued; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@handle_errors
def retry_cmd(
    run_name: str,
    reason: str | None,
    server: str | None,
    since: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Re-queue RUN_NAME's failed items with fresh attempts (never a done item).

    A later turn of a `--turns all` chain is retried where it failed, and the turns after it
    wait behind it again. The items go to the broker for the fleet's workers; `tokenmill run`
    (the same command again) takes them from the ledger.
    """
    from app.core.constants import EVENT_RETRIED
    from app.core.errors import RunArchived
    from app.ledger import event_log, retries, run_queries

    settings = get_settings()
    if not dry_run:
        check_broker(settings)
        announce_embedded(settings, broker=True)
    db = open_db(settings)
    selection = retries.RetrySelection(
        reason=reason, server=server, since=parse_since(since) if since else None
    )
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        if run_queries.run_archived(conn, run.id):
            raise RunArchived(
                f"run {run_name!r} is archived: its items left the ledger, so its failed items "
                "cannot be retried (a new run regenerates them)"
            )
        plan = retries.plan_retry(conn, run.id, selection)
    if dry_run or not plan.retried:
        _report(run_name, plan, dry_run=True, as_json=as_json, selection=selection)
        return
    with db.begin() as conn:
        plan = retries.apply_retry(conn, plan)
        event_log.record_event(
            conn,
            EVENT_RETRIED,
            _event_message(plan),
            run_id=run.id,
            details=plan.to_json() | {"selection": selection.to_json()},
        )
    _report(run_name, plan, dry_run=False, as_json=as_json, selection=selection)
    _publish(db, settings, run, plan)


def _event_message(plan: retries.RetryPlan) -> str:
    reasons = "; ".join(f"{n} × {r}" for r, n in plan.by_reason.most_common(3))
    more = len(plan.by_reason) - 3
    if more > 0:
        reasons += f"; and {more} more reasons"
    return f"{plan.retried} failed items re-queued with fresh attempts: {reasons}"


def _report(
    run_name: str,
    plan: retries.RetryPlan,
    *,
    dry_run: bool,
    as_json: bool,
    selection: retries.RetrySelection,
) -> None:
    if as_json:
        print_json({"run": run_name, "dry_run": dry_run} | plan.to_json())
        return
    verb = "would re-queue" if dry_run else "re-queued"
    if not plan.retried:
        taken = [f"{k}={v}" for k, v in selection.to_json().items() if v is not None]
        where = f" matching {', '.join(taken)}" if taken else ""
        click.echo(f"run {run_name}: no failed items to retry{where}")
    else:
        click.echo(f"run {run_name}: {verb} {plan.retried} failed items with fresh attempts")
        width = len(str(max(plan.by_reason.values())))
        for reason, n in plan.by_reason.most_common():
            click.echo(f"  {n:>{width}}  {reason}")
        if plan.followers:
            click.echo(f"{len(plan.followers)} later turns of their chains wait behind them again")
    for why, n in plan.skipped.most_common():
        click.echo(f"left failed: {n} items, {why}")


def _publish(
    db: Engine, settings: Settings, run: run_queries.RunInfo, plan: retries.RetryPlan
) -> None:
    """Send the pending items to the broker and mark them queued, as enqueue does; start the
    later turns that wait on a done turn (their prompts are built again) and send those."""
    from app.core.errors import BrokerUnavailable
    from app.ledger import queue
    from workers.intake.publish import publish_items

    ids = list(plan.pending)
    try:
        if plan.waiting:
            from workers.chains.advance import advance
            from workers.chains.tokenizers import shared_cache

            ids += advance(db, shared_cache(), run_id=run.id).started
        for i in range(0, len(ids), settings.batch_size):
            chunk = ids[i : i + settings.batch_size]
            publish_items(
                chunk, batch_size=settings.batch_size, run=run.name, priority=run.priority
            )
            with db.begin() as conn:
                queue.mark_queued(conn, chunk)
    except Exception as exc:
        if "kombu" not in type(exc).__module__:
            raise
        raise BrokerUnavailable(
            f"the broker {broker_name(settings)} failed: {str(exc).strip().splitlines()[0]}; "
            f"the retried items of run {run.name} are pending in the ledger: "
            f"`tokenmill reconcile {run.name}` queues them once the broker answers"
        ) from exc
    click.echo(f"sent to the broker {broker_name(settings)} for the workers", err=True)

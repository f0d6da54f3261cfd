"""Outcomes of claimed items (Done, Failed, RetryLater, Released), written idempotently by
record_outcomes, and leases given back: by a worker shutting down, or because they expired."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import JSON, Connection, and_, bindparam, func, select, text, update

from app.core.contracts import GenerateResult
from app.core.failures import failure_reason
from app.core.models import ItemStatus, pack_ids
from app.ledger import common, database, spec_stats

ERROR_MAX_CHARS = 2000


@dataclass(frozen=True)
class Done:
    item_id: int
    result: GenerateResult
    attempts_used: int = 1
    # the server that produced the result, when it is not the one that claimed the item (a
    # hedge); None keeps the claimer's
    server: str | None = None
    # an image item's accepted counts: how many times the server repeated each image's
    # placeholder (the served prompt ids are derived from them); None for a text item
    image_token_counts: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Failed:
    item_id: int
    error: str
    attempts_used: int = 1


@dataclass(frozen=True)
class RetryLater:
    """A retryable failure: the attempt counts, the lease stays with the worker."""

    item_id: int
    error: str


@dataclass(frozen=True)
class Released:
    """Give the item back untouched (server down, paused, shutting down): no attempt spent.
    refused_by: the server that refused it for a reason that can depend on the server; the
    item waits for another server's verdict (that server's claims pass it over)."""

    item_id: int
    reason: str
    refused_by: str | None = None


Outcome = Done | Failed | RetryLater | Released


def _not_final() -> Any:
    # plain comparisons: an IN list cannot be used inside an executemany
    return and_(
        common.items.c.status != ItemStatus.DONE.value,
        common.items.c.status != ItemStatus.FAILED.value,
    )


def _trim(text: str) -> str:
    return text if len(text) <= ERROR_MAX_CHARS else text[: ERROR_MAX_CHARS - 1] + "…"


# Postgres: a batch of results as one UPDATE rather than one per item, so that the item
# counters' statement-level trigger (migration 0005e) runs once per batch, not once per item.
# The rows are locked in id order, as `_in_id_order` does; the first result of an item wins.
_DONE_TOGETHER = text(
    """
UPDATE items SET
    status = 'done', output_ids = v.output_ids, finish_reason = v.finish_reason,
    matched_stop = v.matched, prompt_tokens = v.prompt, completion_tokens = v.completion,
    cached_tokens = v.cached, latency_s = v.latency, server = coalesce(v.server, items.server),
    weight_version = v.weight_version, sampling_params = CAST(v.sampling AS json),
    image_token_counts = CAST(v.image_counts AS json),
    attempts = items.attempts + v.attempts, error = NULL, lease_owner = NULL,
    lease_expires_at = NULL, finished_at = :now
FROM unnest(
    CAST(:ids AS bigint[]), CAST(:outputs AS bytea[]), CAST(:reasons AS text[]),
    CAST(:matched AS text[]), CAST(:prompt AS integer[]), CAST(:completion AS integer[]),
    CAST(:cached AS integer[]), CAST(:latency AS double precision[]),
    CAST(:attempts AS integer[]), CAST(:servers AS text[]), CAST(:versions AS text[]),
    CAST(:samplings AS text[]), CAST(:image_counts AS text[])
) AS v(id, output_ids, finish_reason, matched, prompt, completion, cached, latency, attempts,
       server, weight_version, sampling, image_counts)
WHERE items.id = v.id AND items.status <> 'done' AND items.status <> 'failed'
  AND items.id IN (
    SELECT id FROM items WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id FOR UPDATE
  )
"""
)


def _record_done_together(conn: Connection, rows: list[dict[str, Any]], now: datetime) -> None:
    first: dict[int, dict[str, Any]] = {}
    for row in rows:
        first.setdefault(row["b_id"], row)
    picked = list(first.values())
    conn.execute(
        _DONE_TOGETHER,
        {
            "now": now,
            "ids": [r["b_id"] for r in picked],
            "outputs": [pack_ids(r["b_output_ids"]) for r in picked],
            "reasons": [r["b_finish_reason"] for r in picked],
            "matched": [r["b_matched"] for r in picked],
            "prompt": [r["b_prompt"] for r in picked],
            "completion": [r["b_completion"] for r in picked],
            "cached": [r["b_cached"] for r in picked],
            "latency": [r["b_latency"] for r in picked],
            "attempts": [r["b_attempts"] for r in picked],
            "servers": [r["b_server"] for r in picked],
            "versions": [r["b_weight_version"] for r in picked],
            "samplings": [
                None if r["b_sampling"] is None else json.dumps(r["b_sampling"]) for r in picked
            ],
            "image_counts": [
                None if r["b_image_counts"] is None else json.dumps(r["b_image_counts"])
                for r in picked
            ],
        },
    )


def record_outcomes(
    conn: Connection, outcomes: Sequence[Outcome], *, owner: str, lease_s: float
) -> list[int]:
    """Write outcomes idempotently in one transaction; return the ids released to the queue.

    The first result written for an item wins; a finished item is never written again.
    """
    now = common.utcnow()
    common._lock_in_id_order(conn, [o.item_id for o in outcomes])
    by_id = sorted(outcomes, key=lambda o: o.item_id)
    done = [o for o in by_id if isinstance(o, Done)]
    failed = [o for o in by_id if isinstance(o, Failed)]
    retries = [o for o in by_id if isinstance(o, RetryLater)]
    released = [o for o in by_id if isinstance(o, Released)]
    if done:
        _record_done(conn, done, now)
        spec_stats.record_spec_stats(
            conn, [(o.item_id, o.result.spec) for o in done if o.result.spec], now
        )
    if failed:
        _record_failed(conn, failed, now)
    if retries:
        _record_retries(conn, retries, owner=owner, lease_s=lease_s, now=now)
    if released:
        return _record_released(conn, released, owner=owner, now=now)
    return []


def _record_done(conn: Connection, done: Sequence[Done], now: datetime) -> None:
    """Results: done, unless the item is final already (the first result wins)."""
    stmt = (
        update(common.items)
        .where(common.items.c.id == bindparam("b_id"), _not_final())
        .values(
            status=ItemStatus.DONE.value,
            output_ids=bindparam("b_output_ids"),
            finish_reason=bindparam("b_finish_reason"),
            matched_stop=bindparam("b_matched"),
            # the server's count, which `tokenmill verify` checks against prompt_ids
            prompt_tokens=bindparam("b_prompt"),
            completion_tokens=bindparam("b_completion"),
            cached_tokens=bindparam("b_cached"),
            latency_s=bindparam("b_latency"),
            server=func.coalesce(
                bindparam("b_server", type_=common.items.c.server.type), common.items.c.server
            ),
            attempts=common.items.c.attempts + bindparam("b_attempts"),
            weight_version=bindparam("b_weight_version"),
            sampling_params=bindparam("b_sampling", type_=common.items.c.sampling_params.type),
            # a text item's None is SQL NULL (not JSON null), as the batched write leaves it
            image_token_counts=bindparam("b_image_counts", type_=JSON(none_as_null=True)),
            error=None,
            lease_owner=None,
            lease_expires_at=None,
            finished_at=now,
        )
    )
    rows = [
        {
            "b_id": o.item_id,
            "b_output_ids": o.result.output_ids,
            "b_finish_reason": o.result.finish_reason,
            "b_prompt": o.result.prompt_tokens,
            "b_matched": None if o.result.matched_stop is None else str(o.result.matched_stop)[:64],
            "b_completion": o.result.completion_tokens,
            "b_cached": o.result.cached_tokens,
            "b_latency": o.result.e2e_latency_s,
            "b_attempts": o.attempts_used,
            "b_server": o.server,
            "b_weight_version": o.result.weight_version,
            "b_sampling": o.result.sampling_params,
            "b_image_counts": (
                None if o.image_token_counts is None else list(o.image_token_counts)
            ),
        }
        for o in done
    ]
    if conn.dialect.name == "postgresql" and len(rows) > 1:
        _record_done_together(conn, rows, now)
    else:
        conn.execute(stmt, rows)


def _record_failed(conn: Connection, failed: Sequence[Failed], now: datetime) -> None:
    """Failures, each with its error, unless the item is final already."""
    stmt = (
        update(common.items)
        .where(common.items.c.id == bindparam("b_id"), _not_final())
        .values(
            status=ItemStatus.FAILED.value,
            error=bindparam("b_error"),
            fail_reason=bindparam("b_reason"),
            attempts=common.items.c.attempts + bindparam("b_attempts"),
            lease_owner=None,
            lease_expires_at=None,
            finished_at=now,
        )
    )
    conn.execute(
        stmt,
        [
            {
                "b_id": o.item_id,
                "b_error": _trim(o.error),
                "b_reason": failure_reason(o.error),
                "b_attempts": o.attempts_used,
            }
            for o in failed
        ],
    )


def _record_retries(
    conn: Connection, retries: Sequence[RetryLater], *, owner: str, lease_s: float, now: datetime
) -> None:
    """Failed attempts to be retried by this owner: an attempt spent, the lease extended."""
    stmt = (
        update(common.items)
        .where(
            common.items.c.id == bindparam("b_id"),
            common.items.c.status == ItemStatus.LEASED.value,
            common.items.c.lease_owner == owner,
        )
        .values(
            error=bindparam("b_error"),
            attempts=common.items.c.attempts + 1,
            lease_expires_at=now + timedelta(seconds=lease_s),
        )
    )
    conn.execute(stmt, [{"b_id": o.item_id, "b_error": _trim(o.error)} for o in retries])


def _record_released(
    conn: Connection, released: Sequence[Released], *, owner: str, now: datetime
) -> list[int]:
    """Items this owner gives back to the queue (no attempt spent); the ids it still held. An
    item a server refused names it (refused_by), in the same conditional update: only the
    lease's holder gives it back, once."""
    by_server: dict[str | None, list[int]] = {}
    for o in released:
        by_server.setdefault(o.refused_by, []).append(o.item_id)
    back: list[int] = []
    for server, ids in by_server.items():
        refused = {} if server is None else {"refused_by": server}
        stmt = (
            update(common.items)
            .where(
                common.items.c.id.in_(ids),
                common.items.c.status == ItemStatus.LEASED.value,
                common.items.c.lease_owner == owner,
            )
            .values(
                status=ItemStatus.QUEUED.value,
                lease_owner=None,
                lease_expires_at=None,
                queued_at=now,
                **refused,
            )
            .returning(common.items.c.id)
        )
        back += conn.execute(stmt).scalars()
    return sorted(back)


def release_owner(conn: Connection, owner: str) -> list[int]:
    """Give back every lease an owner holds (a worker shutting down); return the ids."""
    stmt = (
        update(common.items)
        .where(
            common.items.c.lease_owner == owner, common.items.c.status == ItemStatus.LEASED.value
        )
        .values(
            status=ItemStatus.QUEUED.value,
            lease_owner=None,
            lease_expires_at=None,
            queued_at=common.utcnow(),
        )
        .returning(common.items.c.id)
    )
    return sorted(conn.execute(stmt).scalars())


def requeue_expired(
    conn: Connection,
    *,
    run_id: int | None = None,
    limit: int = 10000,
    skip_runs: Sequence[int] = (),
) -> list[int]:
    """Items whose lease expired (their worker died) go back to queued; return their ids.
    skip_runs: runs left alone (the ones `tokenmill run` drives take their leases back)."""
    database.pin_index_plans(conn)
    now = common.utcnow()
    pick = (
        select(common.items.c.id)
        .where(
            common.items.c.status == ItemStatus.LEASED.value, common.items.c.lease_expires_at < now
        )
        .limit(limit)
    )
    if run_id is not None:
        pick = pick.where(common.items.c.run_id == run_id)
    if skip_runs:
        pick = pick.where(common.items.c.run_id.not_in(list(skip_runs)))
    ids = list(conn.execute(pick).scalars())
    if not ids:
        return []
    stmt = (
        update(common.items)
        .where(
            common.items.c.id.in_(ids),
            common.items.c.status == ItemStatus.LEASED.value,
            common.items.c.lease_expires_at < now,
        )
        .values(
            status=ItemStatus.QUEUED.value, lease_owner=None, lease_expires_at=None, queued_at=now
        )
        .returning(common.items.c.id)
    )
    return sorted(conn.execute(stmt).scalars())

"""What a slot does with a claimed item: sends it to the window's server and settles the answer
or the error as done, failed, retried later with backoff, or given back (the server at fault)."""

from __future__ import annotations

import heapq
import logging
import uuid

from app.core.contracts import GenerateResult
from app.core.errors import GenerationError, PermanentError, RetryableError, ServerUnavailable
from app.ledger import Done, Failed, Released, RetryLater
from workers.engine.window_types import Delayed, GenerateClient, Job, WindowHost

log = logging.getLogger(__name__)


def run_job(w: WindowHost, client: GenerateClient, job: Job) -> None:
    """Send job on this slot's client and settle it: done, failed (permanently or out of
    attempts), retried later with backoff, or given back when the server is at fault."""
    item = job.item
    name = w.config.server_name
    if w._stopping.is_set():
        w._settle(Released(item.id, "worker shutting down"), job)
        return
    if w.unavailable() or w._is_paused():
        log.info(
            "run %d item %d released by %s: server paused or unavailable",
            item.run_id,
            item.id,
            name,
            extra=w._ids(item),
        )
        w._settle(Released(item.id, "server paused or unavailable"), job)
        return
    rid = f"tm-{item.id}-{uuid.uuid4().hex[:12]}"
    job.tries += 1
    with w._cond:
        w.stats.sent += 1
        w.stats.inflight += 1
        job.rid = rid
        w._sending[item.id] = job
        if job.group is not None:
            w._groups.sent(job.group, job, w._clock())
    try:
        try:
            result: GenerateResult | None = client.generate(
                item.prompt_ids,
                job.sampling.for_sample(item.sample_index, item.row_sampling_params),
                rid,
            )
        except GenerationError:
            if not job.cancelled:
                raise
            result = None  # aborted because a hedge on another server finished it first
    except PermanentError as exc:
        log.info(
            "run %d item %d failed permanently on %s: %s",
            item.run_id,
            item.id,
            name,
            exc,
            extra=w._ids(item),
        )
        w._settle(Failed(item.id, f"permanent: {exc}", attempts_used=1), job)
        _note(w, failed=1, error=str(exc))
    except ServerUnavailable as exc:
        # the server, not the item, is at fault: no attempt is spent
        w._unavailable_until = w._clock() + w.config.unavailable_wait_s
        job.tries -= 1
        log.info(
            "server %s unavailable (%s); run %d item %d goes back",
            name,
            exc,
            item.run_id,
            item.id,
            extra=w._ids(item),
        )
        w._settle(Released(item.id, f"server unavailable: {exc}"), job)
        _note(w, error=str(exc))
    except RetryableError as exc:
        if job.abandoned:
            return
        if w._is_paused() or (exc.status_code is None and _server_gone(client)):
            # the server died or was paused under the request: not the item's fault
            w._unavailable_until = w._clock() + w.config.unavailable_wait_s
            job.tries -= 1
            log.info(
                "server %s went away (%s); run %d item %d goes back",
                name,
                exc,
                item.run_id,
                item.id,
                extra=w._ids(item),
            )
            w._settle(Released(item.id, f"server went away: {exc}"), job)
        elif item.attempts + job.tries >= w.config.max_attempts:
            log.info(
                "run %d item %d failed on %s after %d attempts: %s",
                item.run_id,
                item.id,
                name,
                item.attempts + job.tries,
                exc,
                extra=w._ids(item),
            )
            w._settle(
                Failed(
                    item.id,
                    f"gave up after {item.attempts + job.tries} attempts: {exc}",
                    attempts_used=1,
                ),
                job,
            )
            _note(w, failed=1, error=str(exc))
        else:
            w._writer.put(RetryLater(item.id, str(exc)), False)
            delay = min(
                w.config.retry_backoff_max_s,
                w.config.retry_backoff_s * 2 ** (item.attempts + job.tries - 1),
            )
            log.info(
                "run %d item %d attempt %d on %s failed (%s); retry in %.1fs",
                item.run_id,
                item.id,
                item.attempts + job.tries,
                name,
                exc,
                delay,
                extra=w._ids(item),
            )
            with w._cond:
                heapq.heappush(w._delayed, Delayed(w._clock() + delay, next(w._seq), job))
                w.stats.retried += 1
            _note(w, error=str(exc))
    except Exception as exc:  # a bug must not kill the slot or strand the lease
        log.exception(
            "unexpected error sending run %d item %d",
            item.run_id,
            item.id,
            extra=w._ids(item),
        )
        w._settle(Released(item.id, f"internal error: {exc!r}"), job)
    else:
        with w._cond:
            # answered: no longer out, so a hedge round never aborts it or counts it cancelled
            # because its own result, written meanwhile, shows it finished
            w._sending.pop(item.id, None)
        if result is None:
            log.info(
                "run %d item %d: the copy on %s was aborted, another server finished it",
                item.run_id,
                item.id,
                name,
                extra=w._ids(item),
            )
            w._settle(Released(item.id, "finished on another server"), job)
            return
        drift = w._check_result(item, result)
        if drift is not None:
            # made with other weights than the run's: never written; no attempt spent
            job.tries -= 1
            log.warning(
                "run %d item %d: result of %s refused (%s); it goes back",
                item.run_id,
                item.id,
                name,
                drift,
                extra=w._ids(item),
            )
            w._settle(Released(item.id, f"weights changed: {drift}"), job)
            return
        w._log_done(item, result, "")
        w._settle(Done(item.id, result, attempts_used=1, server=name), job)
        with w._cond:
            w.stats.done += 1
            w.stats.output_tokens += result.completion_tokens
            w.stats.last_completion = w._clock()
    finally:
        with w._cond:
            w.stats.inflight -= 1
            w._sending.pop(item.id, None)


def _server_gone(client: GenerateClient) -> bool:
    """After a reset or disconnect: is the server itself gone (refused, loading)?"""
    try:
        probe = client.health("/health")
    except Exception:
        return True
    return not probe.ok and (probe.status_code is None or probe.status_code == 503)


def _note(w: WindowHost, *, failed: int = 0, error: str | None = None) -> None:
    with w._cond:
        w.stats.failed += failed
        if error:
            w.stats.last_error = error[:300]

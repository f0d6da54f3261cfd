"""A slot of the in-flight window: one thread with one single-connection client that takes the
next job the moment its previous request finishes, sends it to the window's server, and settles
the answer or the error as done, failed, retried later with backoff, or given back (the server
at fault). An image item carries its images (read before sending: a missing one fails the
item) and its result is accepted only as the window's checks say. A hedge copy is sent the
same way and never spends an attempt. A slot asks its window only through the public methods
SlotHost names."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Protocol

from app.core.contracts import GenerateResult
from app.core.errors import (
    AuthRequired,
    BackPressure,
    GenerationError,
    PermanentError,
    RetryableError,
    ServerRefusal,
    ServerUnavailable,
)
from app.ledger import claims, outcomes
from app.storage.run_store import StorageUnreachable
from workers.engine.window_hedges import HedgeGate
from workers.engine.window_refusals import Refusals
from workers.engine.window_types import Checked, GenerateClient, Job, Verdict, WindowConfig

log = logging.getLogger(__name__)


class SlotHost(Protocol):
    """The window, as its slots see it. Every method takes the window's lock itself."""

    @property
    def config(self) -> WindowConfig: ...

    def next_job(self) -> Job | None: ...

    def is_stopping(self) -> bool: ...

    def unavailable(self) -> bool: ...

    def paused(self) -> bool: ...

    def mark_unavailable(self) -> None: ...

    def settle(self, outcome: outcomes.Outcome, job: Job | None = None) -> None: ...

    def sent(self, job: Job, rid: str) -> None: ...

    def answered(self, job: Job) -> None: ...

    def sending_ended(self, job: Job) -> None: ...

    def retry_later(self, job: Job, reason: str, delay_s: float) -> None: ...

    @property
    def refusals(self) -> Refusals: ...

    def needs_key(self, error: str) -> None: ...

    def note(self, *, failed: int = 0, error: str | None = None) -> None: ...

    def count_done(self, result: GenerateResult) -> None: ...

    def check_result(self, item: claims.ClaimedItem, result: GenerateResult) -> Checked: ...

    def image_data(self, item: claims.ClaimedItem) -> list[str]: ...

    def refused_here(self, item: claims.ClaimedItem, error: ServerRefusal) -> Verdict: ...

    @property
    def hedging(self) -> HedgeGate: ...


def item_fields(item: claims.ClaimedItem, server: str, action: str) -> dict[str, object]:
    """The fields an item's log line carries (JSON logs) besides the message: what happened
    to it, and its ids."""
    return {"action": action, "run_id": item.run_id, "item_id": item.id, "server": server}


def log_done(item: claims.ClaimedItem, result: GenerateResult, server: str, how: str) -> None:
    log.info(
        "run %d item %d done on %s%s: %d tokens, %s",
        item.run_id,
        item.id,
        server,
        how,
        result.completion_tokens,
        result.finish_reason,
        extra=item_fields(item, server, action="done"),
    )


class Slot:
    """One slot thread's loop and its client (made at its first job, closed when it ends)."""

    def __init__(self, window: SlotHost, client_factory: Callable[[], GenerateClient]) -> None:
        self._window = window
        self._client_factory = client_factory
        self._client: GenerateClient | None = None
        self._server = window.config.server_name

    def loop(self) -> None:
        try:
            while True:
                job = self._window.next_job()
                if job is None:
                    return
                if self._client is None:
                    self._client = self._client_factory()
                if job.hedge:
                    self._hedge(self._client, job)
                else:
                    self._run(self._client, job)
                if job.abandoned:
                    return  # a replacement slot took this one's place when it was given up
        finally:
            if self._client is not None:
                self._client.close()

    def _run(self, client: GenerateClient, job: Job) -> None:
        """Send job on this slot's client and settle it: done, failed (permanently or out of
        attempts), retried later with backoff, or given back when the server is at fault."""
        w, item = self._window, job.item
        if w.is_stopping():
            w.settle(outcomes.Released(item.id, "worker shutting down"), job)
            return
        if w.unavailable() or w.paused():
            log.info(
                "run %d item %d released by %s: server paused or unavailable",
                item.run_id,
                item.id,
                self._server,
                extra=item_fields(item, self._server, action="released"),
            )
            w.settle(outcomes.Released(item.id, "server paused or unavailable"), job)
            return
        try:
            images = w.image_data(item) if item.images else None
        except PermanentError as exc:  # an image missing or changed in the store, say
            self._failed_permanently(job, exc)
            return
        except StorageUnreachable as exc:  # said once per run (RunStores): given back
            w.settle(outcomes.Released(item.id, str(exc)), job)
            return
        except Exception as exc:  # the store cannot be opened: not the item's fault
            log.exception(
                "could not read the images of run %d item %d",
                item.run_id,
                item.id,
                extra=item_fields(item, self._server, action="images_unreadable"),
            )
            w.settle(outcomes.Released(item.id, f"images not read: {exc!r}"), job)
            return
        if not w.refusals.may_send():
            w.refusals.hold_back(
                job
            )  # the server pushed back: fewer requests out to it for a while
            return
        rid = f"tm-{item.id}-{uuid.uuid4().hex[:12]}"
        job.tries += 1
        w.sent(job, rid)
        try:
            try:
                result: GenerateResult | None = job.policy.send(
                    client, job.item, rid, images, priority=job.priority
                )
            except GenerationError:
                if not job.cancelled:
                    raise
                result = None  # aborted because a hedge on another server finished it first
        except ServerRefusal as exc:
            self._refused_here(job, exc)
        except PermanentError as exc:
            self._failed_permanently(job, exc)
        except BackPressure as exc:
            # the server is up but full: the request was fine, so no attempt is spent
            job.tries -= 1
            w.refusals.pushed_back(job, str(exc))
        except AuthRequired as exc:
            w.needs_key(str(exc))
            self._given_back(job, "unavailable", exc)
        except ServerUnavailable as exc:
            # the server, not the item, is at fault: no attempt is spent
            self._given_back(job, "unavailable", exc)
        except RetryableError as exc:
            self._retryable(client, job, exc)
        except Exception as exc:  # a bug must not kill the slot or strand the lease
            log.exception(
                "unexpected error sending run %d item %d",
                item.run_id,
                item.id,
                extra=item_fields(item, self._server, action="send_failed"),
            )
            w.settle(outcomes.Released(item.id, f"internal error: {exc!r}"), job)
        else:
            self._answered(job, result)
        finally:
            w.sending_ended(job)

    def _answered(self, job: Job, result: GenerateResult | None) -> None:
        w, item = self._window, job.item
        # answered: no longer out, so a hedge round never aborts it or counts it cancelled
        # because its own result, written meanwhile, shows it finished
        w.answered(job)
        if result is None:
            log.info(
                "run %d item %d: the copy on %s was aborted, another server finished it",
                item.run_id,
                item.id,
                self._server,
                extra=item_fields(item, self._server, action="hedge_lost"),
            )
            w.settle(outcomes.Released(item.id, "finished on another server"), job)
            return
        checked = w.check_result(item, result)
        if checked.refusal is not None:
            # other weights than the run's, or token drift: never written; no attempt spent
            job.tries -= 1
            log.warning(
                "run %d item %d: result of %s refused (%s); it goes back",
                item.run_id,
                item.id,
                self._server,
                checked.refusal,
                extra=item_fields(item, self._server, action="result_refused"),
            )
            w.settle(outcomes.Released(item.id, checked.refusal), job)
            return
        log_done(item, result, self._server, "")
        w.settle(job.policy.outcome(item, result, checked, self._server), job)
        w.count_done(result)

    def _failed_permanently(self, job: Job, exc: PermanentError, why: str = "") -> None:
        item = job.item
        log.info(
            "run %d item %d failed permanently on %s: %s%s",
            item.run_id,
            item.id,
            self._server,
            exc,
            why,
            extra=item_fields(item, self._server, action="failed"),
        )
        self._window.settle(
            outcomes.Failed(item.id, f"permanent: {exc}{why}", attempts_used=1), job
        )
        self._window.note(failed=1, error=str(exc))

    def _refused_here(self, job: Job, exc: ServerRefusal) -> None:
        """A refusal that can depend on the server (its limits, tokenizer, vocabulary): final
        once another server agrees or none other can take the item; otherwise the item goes
        back for another server, with no attempt spent."""
        verdict = self._window.refused_here(job.item, exc)
        if verdict.final:
            self._failed_permanently(job, exc, verdict.why)
            return
        item = job.item
        job.tries -= 1
        log.info(
            "run %d item %d refused by %s (%s); it goes back for another server",
            item.run_id,
            item.id,
            self._server,
            exc,
            extra=item_fields(item, self._server, action="refused_here"),
        )
        refuser = self._server if verdict.refused else None
        self._window.settle(outcomes.Released(item.id, verdict.why, refused_by=refuser), job)
        self._window.note(error=str(exc))

    def _given_back(self, job: Job, how: str, exc: Exception) -> None:
        """The server is unavailable ("unavailable") or died or was paused under the request
        ("went away"): not the item's fault, so the attempt is not spent."""
        item = job.item
        self._window.mark_unavailable()
        job.tries -= 1
        log.info(
            "server %s %s (%s); run %d item %d goes back",
            self._server,
            how,
            exc,
            item.run_id,
            item.id,
            extra=item_fields(item, self._server, action="released"),
        )
        self._window.settle(outcomes.Released(item.id, f"server {how}: {exc}"), job)
        if how == "unavailable":
            self._window.note(error=str(exc))

    def _retryable(self, client: GenerateClient, job: Job, exc: RetryableError) -> None:
        w, item = self._window, job.item
        if job.abandoned:
            return
        attempt = item.attempts + job.tries
        if w.paused() or (exc.status_code is None and _server_gone(client)):
            self._given_back(job, "went away", exc)
        elif attempt >= w.config.max_attempts:
            log.info(
                "run %d item %d failed on %s after %d attempts: %s",
                item.run_id,
                item.id,
                self._server,
                attempt,
                exc,
                extra=item_fields(item, self._server, action="failed"),
            )
            w.settle(
                outcomes.Failed(
                    item.id, f"gave up after {attempt} attempts: {exc}", attempts_used=1
                ),
                job,
            )
            w.note(failed=1, error=str(exc))
        else:
            delay_s = min(
                w.config.retry_backoff_max_s, w.config.retry_backoff_s * 2 ** (attempt - 1)
            )
            log.info(
                "run %d item %d attempt %d on %s failed (%s); retry in %.1fs",
                item.run_id,
                item.id,
                attempt,
                self._server,
                exc,
                delay_s,
                extra=item_fields(item, self._server, action="retrying"),
            )
            w.retry_later(job, str(exc), delay_s)
            w.note(error=str(exc))

    def _hedge(self, client: GenerateClient, job: Job) -> None:
        """Send a second copy of an item leased to another server; write its result if it
        comes (first wins), drop it silently otherwise: a hedge never spends an attempt and
        never changes the item's lease."""
        w, item = self._window, job.item
        if w.unavailable() or w.paused():
            w.hedging.hedge_dropped(job)
            return
        try:
            images = w.image_data(item) if item.images else None
        except Exception:  # the item's holder meets the same error and settles it
            w.hedging.hedge_dropped(job)
            return
        rid = f"tm-{item.id}-hedge-{uuid.uuid4().hex[:8]}"
        if not w.hedging.hedge_sent(job, rid):
            w.hedging.hedge_dropped(job)
            return
        try:
            result = job.policy.send(client, job.item, rid, images, priority=job.priority)
        except Exception as exc:
            if isinstance(exc, ServerUnavailable):
                w.mark_unavailable()
            log.info(
                "run %d item %d: hedge on %s ended without a result (%s)",
                item.run_id,
                item.id,
                self._server,
                "aborted" if job.cancelled else exc,
                extra=item_fields(item, self._server, action="hedge_ended"),
            )
            if not job.abandoned:
                w.hedging.hedge_dropped(job)
        else:
            checked = w.check_result(item, result)
            if checked.refusal is not None:
                w.hedging.hedge_dropped(
                    job
                )  # other weights, or drift: the item stays with its holder
                return
            log_done(item, result, self._server, " (hedge)")
            w.hedging.hedge_answered(job)
            w.settle(job.policy.outcome(item, result, checked, self._server), job)
        finally:
            w.hedging.hedge_ended()


def _server_gone(client: GenerateClient) -> bool:
    """After a reset or disconnect: is the server itself gone (refused, loading)?"""
    try:
        probe = client.health("/health")
    except Exception:
        return True
    return not probe.ok and (probe.status_code is None or probe.status_code == 503)

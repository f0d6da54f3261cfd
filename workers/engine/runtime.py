"""One worker's runtime: the server it serves, its in-flight window and per-run pinned config.

Created lazily in the worker process (after any fork); the Celery task and the embedded
runner both hand claimed items to it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from app.core.constants import (
    EVENT_FINGERPRINT_MISMATCH,
    EVENT_FINGERPRINT_PINNED,
    EVENT_IMAGE_DRIFT,
    PAUSED_BY_IMAGES,
)
from app.core.contracts import GenerateResult, SamplingParams, ServerFingerprint
from app.core.errors import AuthRequired, GenerationError
from app.core.images import ImageDrift
from app.core.settings import Settings
from app.ledger import claims, event_log, registry, run_queries
from app.ledger.database import limit_periodic
from app.ledger.image_tokens import pin_image_settings
from app.sglang.client import SGLangClient
from app.storage.image_store import image_location
from workers.control.pausing import CeleryControl, pause_server
from workers.control.weights import note_weights
from workers.engine import autosize
from workers.engine.failure_digest import FailureDigest
from workers.engine.identity import server_name_for
from workers.engine.image_checks import ImageChecks
from workers.engine.image_data import ImageData
from workers.engine.run_stores import RunStores
from workers.engine.window import InflightWindow, WindowConfig
from workers.engine.window_types import Checked
from workers.intake.turns import TurnAdvancer

log = logging.getLogger(__name__)


def client_for(url: str, settings: Settings) -> SGLangClient:
    """A single-connection client of url with every timeout from settings."""
    return SGLangClient(
        url,
        connect_timeout_s=settings.connect_timeout_s,
        generate_timeout_s=settings.generate_timeout_s,
        info_timeout_s=settings.info_timeout_s,
        probe_timeout_s=settings.probe_timeout_s,
        api_key=settings.sglang_api_key.get_secret_value() if settings.sglang_api_key else None,
    )


def make_owner(label: str) -> str:
    """A lease owner id unique to this process and window."""
    return f"{socket.gethostname()}:{os.getpid()}:{label}:{uuid.uuid4().hex[:8]}"


def fingerprint_summary(fingerprint: dict[str, Any]) -> str:
    """A fingerprint on one line, `key=value` for each field that has a value (the event's
    details keep the whole of it)."""
    parts = []
    for key, value in fingerprint.items():
        if value is None or value == {} or value == []:
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items() if v is not None)
            value = f"{{{value}}}"
        parts.append(f"{key}={value}")
    return " ".join(parts)


class WorkerRuntime:
    """Everything one worker process needs to turn claimed item ids into stored results."""

    def __init__(
        self,
        settings: Settings,
        *,
        db: Engine,
        server_url: str,
        server_name: str | None = None,
        on_released: Callable[[list[int], float], None],
        inflight: int | None = None,
        backlog: int | None = None,
        owner_prefix: str = "",
        only_run: int | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.server_url = server_url.rstrip("/")
        self.server_name = server_name or server_name_for(self.server_url)
        # the embedded runner marks its owners, so its rerun can tell them apart
        self.owner = make_owner(owner_prefix + self.server_name)
        self._lock = threading.Lock()
        self._pin_lock = threading.Lock()
        self._runs: dict[int, run_queries.RunInfo] = {}
        self._run_ok: dict[int, bool] = {}
        self._pause_cache: tuple[float, bool, str | None] = (-1e9, False, None)
        self._fingerprint: ServerFingerprint | None = None
        # the weight version each run this worker serves pinned (results are checked by it),
        # and the weight changes this worker already reported
        self._pinned_versions: dict[int, str | None] = {}
        self._drifts_seen: set[tuple[int, str]] = set()
        # token drift on an image item was reported (the server paused) since the last resume;
        # the reason it pauses itself when the registry has no such server (`tokenmill run`)
        self._image_drift_reported = False
        self._local_pause: str | None = None
        # the embedded runner serves its own run only; a fleet worker the runs bound to it
        self.only_run = only_run
        self._refused_runs: set[int] = set()  # runs this worker gave back, said once each
        self.images = ImageChecks(
            db,
            self.server_name,
            ImageData(lambda: image_location(settings)),
            RunStores(db, settings, self.server_name),
        )
        if inflight is not None:  # a caller's fixed window wins over the setting
            settings = settings.model_copy(update={"inflight": inflight})
            self.settings = settings
        n = autosize.start_size(settings)
        # permanent failures: a WARNING and an item_failed event per reason and interval
        self.failures = FailureDigest(db, self.server_name)
        # later turns of `--turns all` chains, started as their previous turn is committed
        self._on_released = on_released
        self.turns = TurnAdvancer(db, publish=lambda ids: on_released(ids, 0.0))
        self.window = InflightWindow(
            WindowConfig(
                server_name=self.server_name,
                inflight=n,
                lease_s=settings.lease_s,
                heartbeat_s=settings.heartbeat_s,
                max_attempts=settings.max_attempts,
                retry_backoff_s=settings.retry_backoff_s,
                retry_backoff_max_s=settings.retry_backoff_max_s,
                unavailable_wait_s=settings.unavailable_wait_s,
                backlog=backlog if backlog is not None else autosize.backlog_for(settings, n),
                backlog_s=settings.backlog_s,
                hedge_interval_s=settings.hedge_interval_s,
                # without hedging the window still aborts its copies of items finished
                # elsewhere (another worker's hedge won)
                hedge=settings.hedge,
                group_stagger_s=settings.group_stagger_s,
            ),
            db=db,
            owner=self.owner,
            policy=self,  # the window's RunPolicy: this runtime knows the runs and the server
        )
        # fixed, or auto: sized by the server's capacity and load (its own thread and client)
        self.sizer = autosize.WindowSizer(
            settings,
            self.window,
            db=db,
            server_name=self.server_name,
            owner=self.owner,
            client_factory=self.new_client,
        )

    def new_client(self) -> SGLangClient:
        return client_for(self.server_url, self.settings)

    def start(self) -> None:
        self.turns.start()
        self.failures.start()
        self.window.start()
        self.sizer.start()

    def stop(self) -> None:
        self.sizer.stop()
        self.window.stop(self.settings.drain_timeout_s)
        self.turns.stop()
        self.failures.stop()

    def released(self, item_ids: list[int], wait_s: float) -> None:
        """Items the window gave back: to the queue again, after wait_s."""
        self._on_released(item_ids, wait_s)

    def finished(self, item_ids: list[int]) -> None:
        """Results just committed: the `--turns all` chains among them start their next turn."""
        self.turns.notify(item_ids)

    def failed(self, run_id: int, item_id: int, error: str) -> None:
        """An item failed for good: the digest logs and counts it by reason."""
        self.failures.add(run_id, item_id, error)

    def image_data(self, item: claims.ClaimedItem) -> list[str]:
        return self.images.image_data(item)

    def find_hedges(self, limit: int) -> list[claims.ClaimedItem]:
        """Up to limit items running on other servers, in runs with nothing left to claim,
        that this server may serve (not boundary samples); marked as hedged by this worker."""
        with self._lock:
            refused = [run_id for run_id, ok in self._run_ok.items() if not ok]
            refused += [run_id for run_id, info in self._runs.items() if info.turns == "each"]
        text_only = not self.reads_images()
        with self.db.connect() as conn:
            limit_periodic(conn)
            candidates = claims.hedge_candidates(
                conn, server=self.server_name, limit=limit, skip_runs=refused, text_only=text_only
            )
        # checked outside the transaction: a first use pins the run's fingerprint (a write).
        # Boundary samples are not hedged: a conversation's items wait on their server on
        # purpose (its prefix cache holds their history), and a copy elsewhere finds none.
        ids = [
            item_id
            for item_id, run_id in candidates
            if self.serves_run(run_id)
            and self.run_info(run_id).turns != "each"
            and self.run_matches_server(run_id)
            and self.images.reaches(run_id)
        ]
        if not ids:
            return []
        with self.db.begin() as conn:
            return claims.mark_hedged(conn, ids, owner=self.owner)

    def unmark_hedges(self, ids: list[int]) -> None:
        """Hedges marked but never sent (the worker is stopping): others may take them."""
        with self.db.begin() as conn:
            claims.unmark_hedged(conn, ids, owner=self.owner)

    # --- per-run configuration --------------------------------------------------------------

    def run_info(self, run_id: int) -> run_queries.RunInfo:
        """The run's pinned configuration, read once per process."""
        with self._lock:
            cached = self._runs.get(run_id)
        if cached is not None:
            return cached
        with self.db.connect() as conn:
            info = run_queries.get_run_by_id(conn, run_id)
        with self._lock:
            self._runs[run_id] = info
        return info

    def serves_run(self, run_id: int) -> bool:
        """Whether this worker may take the run's items: the embedded runner its own run only;
        a fleet worker a fleet run (not one `tokenmill run` drives) bound to no servers or to
        its own. The first item of a run it does not serve is logged, once."""
        if self.only_run is not None:
            return run_id == self.only_run
        run = self.run_info(run_id)
        if run.served_by(self.server_name):
            return True
        with self._lock:
            first = run_id not in self._refused_runs
            self._refused_runs.add(run_id)
        if first:
            log.info(
                "server %s does not serve run %s: served by %s",
                self.server_name,
                run.name,
                run.binding(),
                extra={"action": "run_not_served", "run": run.name},
            )
        return False

    def sampling_for_run(self, run_id: int) -> SamplingParams:
        return self.run_info(run_id).sampling

    def group_of(self, run_id: int, item_key: str) -> Hashable | None:
        """The conversation an item belongs to, for runs of boundary samples (`--turns
        each`): its items run on one server, one after another; None for other runs."""
        if self.run_info(run_id).turns != "each":
            return None
        return (run_id, item_key)

    def paused(self) -> bool:
        """The durable pause flag of this server, read at most once a second (or its own
        pause for token drift, when the registry does not know the server)."""
        return self._local_pause is not None or self.pause_state()[0]

    @property
    def local_pause(self) -> str | None:
        """Why this worker stopped sending on its own (token drift, unregistered server)."""
        return self._local_pause

    def pause_state(self, *, max_age_s: float = 1.0) -> tuple[bool, str | None]:
        """(paused, who paused it) from the ledger; on a read error the last known value."""
        now = time.monotonic()
        at, paused, by = self._pause_cache
        if now - at < max_age_s:
            return paused, by
        was_paused = paused
        try:
            with self.db.connect() as conn:
                paused, by = registry.pause_flag(conn, self.server_name)
        except Exception as exc:
            log.warning(
                "could not read the pause flag of %s (%s)",
                self.server_name,
                exc,
                extra={"action": "pause_flag_unreadable"},
            )
        self._pause_cache = (now, paused, by)
        if was_paused and not paused:
            # resumed: its configuration may have changed meanwhile (a restart, new weights)
            self.forget_runs()
            self._image_drift_reported = False
        return paused, by

    def register(self, worker: str | None, *, node: str | None = None) -> None:
        """Record the worker serving this server in the ledger's registry, and the server with
        this worker's URL if it is new (a registered server keeps its URL: the control
        plane's; workers/engine/identity.py registers one the fleet reaches at start)."""
        with self.db.begin() as conn:
            registry.claim_server(
                conn, self.server_name, url=self.server_url, worker_url=self.server_url, node=node
            )
            if worker:
                registry.add_worker(conn, self.server_name, worker)

    def unregister(self, worker: str) -> None:
        try:
            with self.db.begin() as conn:
                registry.remove_worker(conn, self.server_name, worker)
        except Exception as exc:
            log.warning(
                "could not unregister worker %s (%s)",
                worker,
                exc,
                extra={"action": "unregister_failed"},
            )

    def reads_images(self) -> bool:
        """Whether the server understands images (`has_image_understanding`); a server whose
        fingerprint cannot be read now counts as one that does not (it gets text items,
        which its run check then defers)."""
        try:
            return self.server_fingerprint().reads_images
        except GenerationError:
            return False

    def known_text_only(self) -> bool:
        """The server was read and understands no images (not merely unknown now)."""
        fingerprint = self._fingerprint
        return fingerprint is not None and not fingerprint.reads_images

    def server_fingerprint(self) -> ServerFingerprint:
        if self._fingerprint is None:
            client = self.new_client()
            try:
                self._fingerprint = client.fingerprint()
            finally:
                client.close()
            self.sizer.reread()  # read anew: the server's capacity may have changed with it
        return self._fingerprint

    def run_matches_server(self, run_id: int) -> bool:
        """Pin the server fingerprint on first use of a run; refuse a server that differs."""
        with self._lock:
            known = self._run_ok.get(run_id)
        if known is not None:
            return known
        with self._pin_lock:  # the pool's threads meet a new run at once: one of them checks
            with self._lock:
                known = self._run_ok.get(run_id)
            if known is not None:
                return known
            return self._check_run(run_id)

    def _check_run(self, run_id: int) -> bool:
        try:
            fingerprint = self.server_fingerprint()
        except AuthRequired as exc:
            self.window.needs_key(str(exc))  # nothing is sent (or claimed) until a key passes
            return False
        except GenerationError as exc:
            log.info(
                "fingerprint of %s unavailable (%s); deferring",
                self.server_name,
                exc,
                extra={"action": "fingerprint_deferred"},
            )
            return False
        mine = fingerprint.to_json()
        required = self.run_info(run_id).weight_version
        if required is not None and fingerprint.weight_version != required:
            return self._refuse_version(run_id, required, fingerprint)
        image_run = self.images.pins(run_id) is not None
        with self.db.begin() as conn:
            pinned = run_queries.pin_fingerprint(conn, run_id, mine)
            if fingerprint.images is not None and image_run:
                # a run of images pins the image settings of the first server that reads them
                pinned = pin_image_settings(conn, run_id, fingerprint.images)
            ok = not ServerFingerprint(**pinned).differences(fingerprint)
            # once per run and server: not again from its other workers, or after a resume
            if ok and not event_log.has_event(
                conn, EVENT_FINGERPRINT_PINNED, run_id=run_id, server=self.server_name
            ):
                run_name = self.run_info(run_id).name
                summary = fingerprint_summary(mine)
                log.info(
                    "run %s uses server %s: %s",
                    run_name,
                    self.server_name,
                    summary,
                    extra={"action": "fingerprint_pinned"},
                )
                event_log.record_event(
                    conn,
                    EVENT_FINGERPRINT_PINNED,
                    f"{self.server_name} serves run {run_name}: {summary}",
                    run_id=run_id,
                    server=self.server_name,
                    details=mine,
                )
            if not ok:
                diff = ServerFingerprint(**pinned).differences(fingerprint)
                message = (
                    f"server {self.server_name} does not match the run's pinned configuration: "
                    + "; ".join(diff)
                )
                log.warning(message, extra={"action": "run_refused"})
                self._mismatch(conn, run_id, message, {"pinned": pinned, "server": mine})
        with self._lock:
            self._run_ok[run_id] = ok
            if ok:
                self._pinned_versions[run_id] = pinned.get("weight_version")
        return ok

    def refuses_run(self, run_id: int) -> bool:
        """This server's fingerprint was found to differ from the run's pinned one."""
        with self._lock:
            return self._run_ok.get(run_id) is False

    def _refuse_version(self, run_id: int, required: str, fingerprint: ServerFingerprint) -> bool:
        """A run pinned to another weight version: this server skips it (and may serve others)."""
        message = (
            f"server {self.server_name} does not serve run {self.run_info(run_id).name}: "
            f"weight_version: {required} (--weight-version) → {fingerprint.weight_version}"
        )
        log.info(message, extra={"action": "run_refused"})
        with self.db.begin() as conn:
            details = {"weight_version": required, "server": fingerprint.to_json()}
            self._mismatch(conn, run_id, message, details)
        with self._lock:
            self._run_ok[run_id] = False
        return False

    def _mismatch(
        self, conn: Connection, run_id: int, message: str, details: dict[str, Any]
    ) -> None:
        """The timeline's entry for a run this server does not serve."""
        event_log.record_event(
            conn,
            EVENT_FINGERPRINT_MISMATCH,
            message,
            run_id=run_id,
            server=self.server_name,
            details=details,
        )

    def check_result(self, item: claims.ClaimedItem, result: GenerateResult) -> Checked:
        """Whether this result may be written: not if it was made (in part) under other
        weights than the run pinned, nor, for an image item, if its served prompt is not the
        request expanded (token drift: the server is paused); its image token counts if so."""
        change = self._weights_refusal(item, result)
        if change is not None:
            return Checked(refusal=f"weights changed: {change}")
        if not item.images:
            return Checked()
        try:
            counts = self.images.accept(item, result)
        except ImageDrift as exc:
            return Checked(refusal=self._image_drift(item, str(exc)))
        except SQLAlchemyError as exc:  # the counts could not be compared: not written yet
            log.warning(
                "could not check the image counts of item %d (%s)",
                item.id,
                exc,
                extra={"action": "image_check_failed"},
            )
            return Checked(refusal=f"image counts not checked (ledger error: {exc})")
        return Checked(image_token_counts=counts)

    def _image_drift(self, item: claims.ClaimedItem, difference: str) -> str:
        """Once until the server is resumed: record the drift and pause the server (in the
        registry, or on its own when the registry has no such server); the refusal."""
        refusal = f"token drift: {difference}"
        with self._lock:
            first = not self._image_drift_reported
            self._image_drift_reported = True
        if not first:
            return refusal
        run = self.run_info(item.run_id).name
        reason = f"token drift on run {run} item {item.id}: {difference}"
        log.warning("server %s: %s", self.server_name, reason, extra={"action": "token_drift"})
        try:
            with self.db.begin() as conn:
                event_log.record_event(
                    conn,
                    EVENT_IMAGE_DRIFT,
                    f"{self.server_name}: {reason}",
                    run_id=item.run_id,
                    server=self.server_name,
                    details={"item_id": item.id, "difference": difference},
                )
                registered = registry.find_server(conn, self.server_name) is not None
            if registered:
                pause_server(
                    self.db, CeleryControl(), self.server_name, by=PAUSED_BY_IMAGES, reason=reason
                )
            else:
                self._local_pause = reason
        except Exception:
            log.exception(
                "could not pause %s for token drift",
                self.server_name,
                extra={"action": "drift_pause_failed"},
            )
            self._local_pause = reason  # this worker stops sending at least
        self._pause_cache = (-1e9, False, None)  # read the flag again at once
        return refusal

    def _weights_refusal(self, item: claims.ClaimedItem, result: GenerateResult) -> str | None:
        """The change ("weight_version: A → B") when result was made (in part) under other
        weights than the run pinned; None when it is the run's."""
        with self._lock:
            pinned = self._pinned_versions.get(item.run_id)
        seen = result.weight_versions or (
            (result.weight_version,) if result.weight_version is not None else ()
        )
        other = [v for v in seen if v != pinned]
        if pinned is None or not other:
            return None
        change = f"weight_version: {pinned} → {other[-1]}"
        self._weights_changed(item.run_id, other[-1])
        return change

    def _weights_changed(self, run_id: int, version: str) -> None:
        """Once per run and version: look at the server again, record the change and pause the
        server if no active run takes its new weights; check every run again on next use."""
        with self._lock:
            if (run_id, version) in self._drifts_seen:
                return
            self._drifts_seen.add((run_id, version))
            before = self._fingerprint.to_json() if self._fingerprint is not None else None
        self.forget_runs()
        try:
            fingerprint = self.server_fingerprint()
        except GenerationError as exc:
            log.warning(
                "fingerprint of %s unavailable (%s)",
                self.server_name,
                exc,
                extra={"action": "fingerprint_unavailable"},
            )
            fingerprint = ServerFingerprint(weight_version=version)
        if before is not None and fingerprint.weight_version == before.get("weight_version"):
            # the server answers with other weights than /model_info says: what it answered wins
            fingerprint = ServerFingerprint(**{**before, "weight_version": version})
        try:
            note_weights(
                self.db, CeleryControl(), self.server_name, fingerprint, "a worker", before
            )
        except Exception:
            # the next result of these weights tries again (a busy SQLite ledger, say)
            log.exception(
                "could not record the weight change of %s",
                self.server_name,
                extra={"action": "weights_record_failed"},
            )
            with self._lock:
                self._drifts_seen.discard((run_id, version))
                if before is not None and self._fingerprint is None:
                    self._fingerprint = ServerFingerprint(**before)
        self._pause_cache = (-1e9, False, None)  # read the flag again at once

    def forget_runs(self) -> None:
        """Check every run against the server's fingerprint again on next use (a run's pinned
        weight version stays: results still in flight are checked by it)."""
        with self._lock:
            self._run_ok.clear()
        self._fingerprint = None

    def forget_run(self, run_id: int) -> None:
        """Check this run's fingerprint again on next use (the server may have changed)."""
        with self._lock:
            self._run_ok.pop(run_id, None)
        self._fingerprint = None

"""What one worker knows of the runs it meets and of its server: each run's pinned
configuration, whether the server's fingerprint matches what the run pinned and its limits
admit the run's largest request, and the weight version each run's results are checked by.

The worker's runtime owns one; the window asks it (through the runtime, its RunPolicy)
whether a claimed item may be sent to this server and whether a result may be written.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from sqlalchemy import Connection, Engine

from app.core.constants import (
    EVENT_FINGERPRINT_MISMATCH,
    EVENT_FINGERPRINT_PINNED,
    EventKind,
)
from app.core.contracts import GenerateResult, ServerFingerprint
from app.core.errors import AuthRequired, GenerationError
from app.ledger import event_log, image_tokens, run_needs, run_queries
from app.sglang import limits
from app.sglang.client import SGLangClient
from workers.control.pausing import CeleryControl
from workers.control.weights import note_weights
from workers.engine.image_checks import ImageChecks

log = logging.getLogger(__name__)


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


# how often a refused run is looked at again: its server may have changed without this worker
# seeing a pause lifted (an update-weights that paused and resumed between two pause checks)
REFUSED_RECHECK_S: Final = 10.0


class RunPins:
    """The runs one worker serves, checked against its server's fingerprint once each.

    new_client reaches the server; images answers which runs carry images. The callbacks tell
    the rest of the runtime what the pins found: on_fingerprint_read after the server's
    fingerprint was read anew (its capacity may have changed with it), on_auth with the
    server's refusal when it wants an API key, on_weights_noted after a weight change was
    recorded (the server may have been paused).
    """

    def __init__(
        self,
        db: Engine,
        server_name: str,
        *,
        only_run: int | None,
        new_client: Callable[[], SGLangClient],
        images: ImageChecks,
        on_fingerprint_read: Callable[[], None],
        on_auth: Callable[[str], None],
        on_weights_noted: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.server_name = server_name
        # the embedded runner serves its own run only; a fleet worker the runs bound to it
        self.only_run = only_run
        self._new_client = new_client
        self._images = images
        self._on_fingerprint_read = on_fingerprint_read
        self._on_auth = on_auth
        self._on_weights_noted = on_weights_noted
        self._lock = threading.Lock()
        self._pin_lock = threading.Lock()
        self._runs: dict[int, run_queries.RunInfo] = {}
        self._run_ok: dict[int, bool] = {}
        self._fingerprint: ServerFingerprint | None = None
        # the weight version each run this worker serves pinned (results are checked by it),
        # and the weight changes this worker already reported
        self._pinned_versions: dict[int, str | None] = {}
        self._pinned_limits: dict[int, dict[str, Any] | None] = {}
        self._why_refused: dict[int, str] = {}  # the last refusal of each run, said
        # each run's largest request within the limits it pinned (run_needs.largest_request)
        self._needs: dict[tuple[int, str], limits.RequestNeed | None] = {}
        self._drifts_seen: set[tuple[int, str]] = set()
        self._refused_runs: set[int] = set()  # runs this worker gave back, said once each
        # each refused run: the fingerprint it was refused under, and when to look again
        self._clock = clock
        self._refused_under: dict[int, tuple[dict[str, Any], float]] = {}

    # --- the runs ---------------------------------------------------------------------------

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

    def checked_runs(self) -> list[int]:
        """The runs found not to match this server, and the runs of boundary samples (whose
        items wait on their conversation's server): hedging skips both."""
        with self._lock:
            refused = [run_id for run_id, ok in self._run_ok.items() if not ok]
            refused += [
                run_id
                for run_id, info in self._runs.items()
                if info.generation.turns.boundary_samples
            ]
        return refused

    # --- the server -------------------------------------------------------------------------

    def server_fingerprint(self) -> ServerFingerprint:
        if self._fingerprint is None:
            client = self._new_client()
            try:
                self._fingerprint = client.fingerprint()
            finally:
                client.close()
            self._on_fingerprint_read()
        return self._fingerprint

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

    # --- a run against the server -----------------------------------------------------------

    def run_matches_server(self, run_id: int) -> bool:
        """Pin the server fingerprint on first use of a run; refuse a server that differs."""
        with self._lock:
            known = self._run_ok.get(run_id)
        if known is False:
            known = self._refused_still(run_id)
        if known is not None:
            return known
        with self._pin_lock:  # the pool's threads meet a new run at once: one of them checks
            with self._lock:
                known = self._run_ok.get(run_id)
            if known is not None:
                return known
            return self._check_run(run_id)

    def _refused_still(self, run_id: int) -> bool | None:
        """False while a refused run's server shows the fingerprint it was refused under (read
        again every REFUSED_RECHECK_S); None once it shows another: check the run again."""
        with self._lock:
            under, due = self._refused_under.get(run_id, ({}, 0.0))
            if self._clock() < due:
                return False
            self._refused_under[run_id] = (under, self._clock() + REFUSED_RECHECK_S)
        self._fingerprint = None
        try:
            now = self.server_fingerprint().to_json()
        except GenerationError:
            return False
        if now == under:
            return False
        with self._lock:
            self._run_ok.pop(run_id, None)
            self._refused_under.pop(run_id, None)
        return None

    def _refused(self, run_id: int, fingerprint: ServerFingerprint) -> bool:
        """Remember the refusal of a run under this fingerprint; False."""
        with self._lock:
            self._run_ok[run_id] = False
            due = self._clock() + REFUSED_RECHECK_S
            self._refused_under[run_id] = (fingerprint.to_json(), due)
        return False

    def refuses_run(self, run_id: int) -> bool:
        """This server's fingerprint was found to differ from the run's pinned one."""
        with self._lock:
            return self._run_ok.get(run_id) is False

    def forget_runs(self) -> None:
        """Check every run against the server's fingerprint again on next use (a run's pinned
        weight version stays: results still in flight are checked by it)."""
        with self._lock:
            self._run_ok.clear()
            self._refused_under.clear()
        self._fingerprint = None

    def forget_run(self, run_id: int) -> None:
        """Check this run's fingerprint again on next use (the server may have changed)."""
        with self._lock:
            self._run_ok.pop(run_id, None)
            self._refused_under.pop(run_id, None)
        self._fingerprint = None

    def _check_run(self, run_id: int) -> bool:
        try:
            fingerprint = self.server_fingerprint()
        except AuthRequired as exc:
            self._on_auth(str(exc))  # nothing is sent (or claimed) until a key passes
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
        image_run = self._images.pins(run_id) is not None
        with self.db.begin() as conn:
            pinned = run_queries.pin_fingerprint(conn, run_id, mine)
            if fingerprint.images is not None and image_run:
                # a run of images pins the image settings of the first server that reads them
                pinned = image_tokens.pin_image_settings(conn, run_id, fingerprint.images)
            ok = not ServerFingerprint(**pinned).differences(fingerprint)
            too_small = self._limits_refusal(conn, run_id, pinned, fingerprint) if ok else None
            if too_small is not None:
                ok = False
                log.warning(too_small, extra={"action": "run_refused"})
                details = {"pinned": pinned, "server": mine, "limits": fingerprint.limits}
                self._mismatch(conn, run_id, too_small, details)
            # once per run and server (not again from its other workers, or after a resume),
            # and again once it serves the run after a refusal (`servers` shows the latest)
            if ok and self._latest_said(conn, run_id) != EVENT_FINGERPRINT_PINNED:
                self._pinned_event(conn, run_id, mine)
            if not ok and too_small is None:
                diff = ServerFingerprint(**pinned).differences(fingerprint)
                message = (
                    f"server {self.server_name} does not match the run's pinned configuration: "
                    + "; ".join(diff)
                )
                log.warning(message, extra={"action": "run_refused"})
                self._mismatch(conn, run_id, message, {"pinned": pinned, "server": mine})
        if not ok:
            return self._refused(run_id, fingerprint)
        with self._lock:
            self._run_ok[run_id] = ok
            self._pinned_versions[run_id] = pinned.get("weight_version")
            self._pinned_limits[run_id] = pinned.get("limits")
        return ok

    def _limits_refusal(
        self,
        conn: Connection,
        run_id: int,
        pinned: dict[str, Any],
        fingerprint: ServerFingerprint,
    ) -> str | None:
        """Why the server's limits do not admit the run's largest request still to be served
        (the server is drifted for this run: its items are left to the others); None when
        they do (a limit that grew, or shrank but still admits them, is no drift)."""
        run = self.run_info(run_id)
        key = (run_id, json.dumps(pinned.get("limits"), sort_keys=True))
        with self._lock:
            known = key in self._needs
            need = self._needs.get(key)
        if not known:  # a read of the run's rows: once per run (and pinned limits) per process
            need = run_needs.largest_request(
                conn, run_id, run.generation.sampling.max_new_tokens, pinned.get("limits")
            )
            with self._lock:
                self._needs[key] = need
        why = None if need is None else limits.refusal(fingerprint.limits, need)
        if why is None:
            return None
        changed = limits.limit_changes(pinned.get("limits"), fingerprint.limits)
        since = f" (since the run pinned its limits: {'; '.join(changed)})" if changed else ""
        return (
            f"server {self.server_name} does not serve run {run.name}: its limits do not admit "
            f"the run's largest request: {why}{since}"
        )

    def why_refused(self, run_id: int) -> str | None:
        """Why this server last refused the run (None: it serves it, or was not checked)."""
        with self._lock:
            return self._why_refused.get(run_id) if self._run_ok.get(run_id) is False else None

    def pinned_limits(self, run_id: int) -> dict[str, Any] | None:
        """The limits the run pinned, as this worker last checked it (None: not checked yet,
        or pinned by a server that reported none)."""
        with self._lock:
            return self._pinned_limits.get(run_id)

    def _latest_said(self, conn: Connection, run_id: int) -> str | None:
        """The latest of this server's pin and refusal events for the run (None: neither)."""
        kinds: tuple[EventKind, ...] = (EVENT_FINGERPRINT_PINNED, EVENT_FINGERPRINT_MISMATCH)
        return event_log.latest_kind(conn, kinds, run_id=run_id, server=self.server_name)

    def _pinned_event(self, conn: Connection, run_id: int, mine: dict[str, Any]) -> None:
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
        return self._refused(run_id, fingerprint)

    def _mismatch(
        self, conn: Connection, run_id: int, message: str, details: dict[str, Any]
    ) -> None:
        """The timeline's entry for a run this server does not serve (and why, as the task's
        result in Flower says it)."""
        with self._lock:
            self._why_refused[run_id] = message
        event_log.record_event(
            conn,
            EVENT_FINGERPRINT_MISMATCH,
            message,
            run_id=run_id,
            server=self.server_name,
            details=details,
        )

    # --- the weights a result was made under ------------------------------------------------

    def weights_refusal(self, run_id: int, result: GenerateResult) -> str | None:
        """The change ("weight_version: A → B") when result was made (in part) under other
        weights than the run pinned; None when it is the run's."""
        with self._lock:
            pinned = self._pinned_versions.get(run_id)
        seen = result.weight_versions or (
            (result.weight_version,) if result.weight_version is not None else ()
        )
        other = [v for v in seen if v != pinned]
        if pinned is None or not other:
            return None
        change = f"weight_version: {pinned} → {other[-1]}"
        self._weights_changed(run_id, other[-1])
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
        self._on_weights_noted()

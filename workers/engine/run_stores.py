"""Per worker: each run's storage (its pinned URL, opened once per URL) and whether this worker
reaches it, so a worker that cannot read a run's images gives their items back, saying so once.

Reaching is reading the run's marker (app.storage.run_store): a worker on another machine
than a local folder, or without access to a bucket, does not find it. A run not reached is
looked at again after RECHECK_S (a mount may appear); the warning is logged once per run.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import Engine

from app.core.settings import Settings
from app.ledger import run_queries
from app.storage import run_store
from app.storage.image_store import image_location
from app.storage.shards import Location, StorageError

log = logging.getLogger(__name__)

RECHECK_S = 60.0


class RunStores:
    """The storage of each run this worker meets, and whether it reaches it."""

    def __init__(self, db: Engine, settings: Settings, server_name: str) -> None:
        self._db = db
        self._settings = settings
        self._server = server_name
        self._lock = threading.Lock()
        self._runs: dict[int, tuple[str, str | None]] = {}  # run id → (name, storage URL)
        self._locations: dict[str | None, Location] = {}
        self._reached: dict[int, tuple[bool, float]] = {}  # run id → (reached, when checked)
        self._warned: set[int] = set()

    def _run(self, run_id: int) -> tuple[str, str | None]:
        with self._lock:
            known = self._runs.get(run_id)
        if known is None:
            with self._db.connect() as conn:
                run = run_queries.get_run_by_id(conn, run_id)
            known = (run.name, run.storage_url)
            with self._lock:
                self._runs[run_id] = known
        return known

    def location(self, run_id: int) -> Location:
        """The run's storage (a run older than the pin: this worker's TOKENMILL_STORAGE_URL)."""
        url = self._run(run_id)[1]
        with self._lock:
            loc = self._locations.get(url)
        if loc is None:
            loc = image_location(self._settings, url)
            with self._lock:
                loc = self._locations.setdefault(url, loc)
        return loc

    def reaches(self, run_id: int) -> bool:
        """Whether this worker reads the run's images where its enqueue stored them; the first
        time it does not, one WARNING line says so (its image items go back to the queue)."""
        with self._lock:
            known = self._reached.get(run_id)
        if known is not None and (known[0] or time.monotonic() - known[1] < RECHECK_S):
            return known[0]
        name, url = self._run(run_id)
        if url is None:  # a run older than the pin: its images are where this worker looks
            reached = True
        else:
            try:
                reached = run_store.reaches(self.location(run_id), run_id, name)
            except StorageError as exc:  # the storage did not answer: not now, maybe later
                log.warning(
                    "server %s: %s", self._server, exc, extra={"action": "storage_unreached"}
                )
                reached = False
        with self._lock:
            self._reached[run_id] = (reached, time.monotonic())
            warn = not reached and run_id not in self._warned
            if warn:
                self._warned.add(run_id)
        if warn:
            log.warning(
                "server %s: run %s stores its images in %s, which this worker does not reach "
                "(no %s there); its image items go back to the queue for workers that do "
                "(set TOKENMILL_STORAGE_URL so every node reaches the run's storage)",
                self._server,
                name,
                url,
                f"runs/{name}/storage.json",
                extra={"action": "storage_unreachable", "run": name, "storage_url": url},
            )
        return reached

"""Each run's tokenizer for advancing its chains: loaded once per process, used only while
its files and template are the run's pinned ones; a run whose tokenizer cannot be used is
blocked (its later turns stay waiting, one event) and tried again after a while. The same
cache holds the run's render client (`--render-with`) and image store.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from sqlalchemy import Engine

from app.core.constants import EVENT_TURNS_BLOCKED
from app.core.errors import TokenmillError
from app.core.settings import get_settings
from app.ledger import event_log, run_queries
from app.prompts.chat_path import check_version
from app.prompts.tokenization import ChatTokenizer, load_for_run
from app.prompts.tokenizer_files import folder_changes
from app.sglang.render import RenderClient, render_client
from app.storage.image_store import image_location
from workers.intake.images import StoredImages

log = logging.getLogger(__name__)

# a run whose tokenizer could not be used is tried again after this long (it may be fixed)
BLOCKED_RETRY_S = 60.0


class TokenizerCache:
    """Each run's tokenizer, loaded once per process from the run's tokenizer path and used
    only if its hashes are the run's pinned ones (never a prompt from another template)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[int, run_queries.RunInfo] = {}
        self._tokenizers: dict[int, ChatTokenizer] = {}
        self._blocked: dict[int, float] = {}
        self._reported: set[int] = set()
        self._renderers: dict[str, RenderClient] = {}
        self._stored_images: dict[str | None, StoredImages] = {}

    def stored_images(self, storage_url: str | None) -> StoredImages:
        """A run's image store (its pinned URL) as render servers take its images (opened
        once per process and URL)."""
        with self._lock:
            images = self._stored_images.get(storage_url)
            if images is None:
                images = self._stored_images[storage_url] = StoredImages(
                    lambda: image_location(get_settings(), storage_url)
                )
            return images

    def renderer(self, url: str) -> RenderClient:
        """The render client of a `--render-with` run's server (one per process and URL)."""
        with self._lock:
            client = self._renderers.get(url)
            if client is None:
                client = self._renderers[url] = render_client(url, get_settings())
            return client

    def run(self, db: Engine, run_id: int) -> run_queries.RunInfo:
        with self._lock:
            cached = self._runs.get(run_id)
        if cached is None:
            with db.connect() as conn:
                cached = run_queries.get_run_by_id(conn, run_id)
            with self._lock:
                self._runs[run_id] = cached
        return cached

    def tokenizer(self, db: Engine, run: run_queries.RunInfo) -> ChatTokenizer | None:
        """The run's tokenizer, or None (ERROR logged, event recorded once) if it changed or
        cannot be loaded; the turns stay waiting."""
        with self._lock:
            found = self._tokenizers.get(run.id)
            blocked_at = self._blocked.get(run.id)
        if found is not None:
            return found
        if blocked_at is not None and time.monotonic() - blocked_at < BLOCKED_RETRY_S:
            return None
        try:
            tokenizer = self._load(run)
        except TokenmillError as exc:
            self._block(db, run, str(exc))
            return None
        with self._lock:
            self._tokenizers[run.id] = tokenizer
            self._blocked.pop(run.id, None)
        return tokenizer

    @staticmethod
    def _load(run: run_queries.RunInfo) -> ChatTokenizer:
        check_version(run.generation.normalization_version, run=run.name)
        folder = Path(run.generation.tokenizer_path)
        # hash the files before loading: the tokenizer's own code (trust_remote_code) only
        # runs if it is byte for byte what the run was enqueued with
        changes = folder_changes(
            folder, run.generation.tokenizer_hash, run.generation.tokenizer_files
        )
        if changes:
            raise TokenmillError(
                f"the tokenizer files at {run.generation.tokenizer_path} changed since the run was "
                f"created: {'; '.join(changes)}"
            )
        tokenizer = load_for_run(
            folder,
            trust_remote_code=run.generation.trust_remote_code,
            chat_pins=run.generation.chat_pins,
        )
        if tokenizer.chat_template_hash != run.generation.chat_template_hash:
            raise TokenmillError(
                f"the chat template at {run.generation.tokenizer_path} differs from the run's "
                f"(hash {tokenizer.chat_template_hash[:12]}, "
                f"pinned {run.generation.chat_template_hash[:12]})"
            )
        return tokenizer

    def _block(self, db: Engine, run: run_queries.RunInfo, reason: str) -> None:
        with self._lock:
            self._blocked[run.id] = time.monotonic()
            first = run.id not in self._reported
            self._reported.add(run.id)
        message = f"run {run.name}: later turns stay waiting: {reason}"
        log.error(message, extra={"action": "turns_blocked"})
        if first:
            try:
                with db.begin() as conn:
                    event_log.record_event(conn, EVENT_TURNS_BLOCKED, message, run_id=run.id)
            except Exception as exc:
                log.warning(
                    "could not record the event (%s)", exc, extra={"action": "event_failed"}
                )


_shared_cache = TokenizerCache()


def shared_cache() -> TokenizerCache:
    """This process's tokenizer cache (loaded lazily, never at import)."""
    return _shared_cache

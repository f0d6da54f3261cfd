"""The embedded runner behind `tokenmill run` and `tokenmill demo`: one in-flight window per
server, fed straight from the ledger (no broker), until every item is done or failed.

Uses the same window, claims and idempotent writes as the Celery workers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sqlalchemy import Engine

from app.core.errors import ConfigurationError
from app.core.settings import Settings
from app.ledger import claims, outcomes, reads, run_queries
from workers.chains.advance import advance
from workers.chains.tokenizers import shared_cache
from workers.control.health import Health
from workers.control.parity import preflight
from workers.engine.contact import ServerContact
from workers.engine.orphans import EMBEDDED_OWNER_PREFIX, take_back
from workers.engine.probes import Seen, ServerProbe, auth_line
from workers.engine.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@dataclass
class ServerView:
    name: str
    url: str
    inflight: int
    done: int
    failed: int
    output_tokens: int
    unavailable: bool
    refused: bool  # its fingerprint differs from the run's: it takes no work
    last_error: str | None
    # its rendering of the run's prompts differs from the stored ones (the parity preflight);
    # with --require-parity it takes no work
    parity_differs: bool = False
    # not answering: for how long (None: not yet known) and why
    down: bool = False
    down_for_s: float | None = None
    down_error: str | None = None
    # it understands no images (`has_image_understanding` is not true): it takes text items only
    text_only: bool = False
    # it stopped on its own for token drift on an image item (why); it takes no work
    drift: str | None = None
    # its /health answers 503 while it still serves (SIGTERM): no new work, in flight finishes
    draining: bool = False
    # it wants an API key tokenmill does not send (401/403): no work
    auth: bool = False


class EmbeddedRunner:
    """Feeds claimable items of one run to a window per server until the run is finished."""

    def __init__(
        self,
        db: Engine,
        settings: Settings,
        run: run_queries.RunInfo,
        server_urls: list[str],
        *,
        poll_s: float = 0.05,
        on_notice: Callable[[str], None] = log.warning,
    ) -> None:
        if not server_urls:
            raise ConfigurationError("give at least one --server URL")
        self.db = db
        self.settings = settings
        self.run = run
        self.poll_s = poll_s
        # what the user should hear at once: a server down or back, leases taken back
        self.on_notice = on_notice
        self.runtimes = [
            WorkerRuntime(
                settings,
                db=db,
                server_url=url,
                server_name=None,
                on_released=lambda ids, wait_s: None,  # released items are claimed from the ledger
                owner_prefix=EMBEDDED_OWNER_PREFIX,
                only_run=run.id,
            )
            for url in server_urls
        ]
        self._contacts = {
            rt.server_name: ServerContact(rt.server_url, on_notice) for rt in self.runtimes
        }
        self._probes = {rt.server_name: self._probe_of(rt) for rt in self.runtimes}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._refused: dict[str, bool] = {}
        self._parity: dict[str, str] = {}  # server name → "equal" | "differs"
        # `--turns each`: a conversation's items are claimed together by one server's feed
        self._claim_lock = threading.Lock()

    def _probe_of(self, rt: WorkerRuntime) -> ServerProbe:
        def changed(before: Health | None, seen: Seen) -> None:
            self._changed(rt, before, seen)

        return ServerProbe(rt, on_change=changed)

    def start(self) -> None:
        self._take_back()
        with ThreadPoolExecutor(len(self.runtimes), thread_name_prefix="tm-probe") as pool:
            list(pool.map(lambda rt: self._probes[rt.server_name].probe_once(), self.runtimes))
        for probe in self._probes.values():
            probe.start()
        self._preflight_all()
        for rt in self.runtimes:
            rt.start()
            thread = threading.Thread(
                target=self._feed, args=(rt,), name=f"tm-feed-{rt.server_name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _take_back(self) -> None:
        """A rerun takes back at once the leases its own dead predecessor held (the same run in
        the same ledger, its process gone), instead of waiting for them to expire."""
        taken = take_back(self.db, self.run.id)
        if taken.items:
            pids = ", ".join(map(str, taken.pids))
            self.on_notice(
                f"took back {taken.items} items of run {self.run.name} leased by an earlier "
                f"`tokenmill run` (pid {pids}) that is no longer running"
            )

    def _reachable(self, rt: WorkerRuntime) -> bool:
        """Whether the server takes work now: its probes found it healthy (see probes.py), and
        its window did not find it gone since (then it is down until a probe says otherwise)."""
        contact = self._contacts[rt.server_name]
        window = rt.window
        if rt.server_state.finishing():
            return False
        if window.unavailable():
            contact.found_down(window.stats.last_error or "the server went away")
            return False
        return contact.up

    def _changed(self, rt: WorkerRuntime, before: Health | None, seen: Seen) -> None:
        """A probe found the server in another state: tell the user, once per change."""
        contact = self._contacts[rt.server_name]
        if seen.state is Health.HEALTHY:
            if not contact.up:
                contact.found_up()
                # back from being down: it may have restarted with other weights or image
                # settings, so its fingerprint is read again before it takes work
                rt.pins.forget_run(self.run.id)
            elif before is Health.DRAINING:
                self.on_notice(f"--server {rt.server_url} serves again (its drain is over)")
        elif seen.state is Health.DRAINING:
            self.on_notice(
                f"--server {rt.server_url} drains (its /health answers 503): nothing new goes "
                f"to it, its {rt.window.stats.inflight} requests in flight finish"
            )
        elif seen.state is Health.AUTH:
            key_set = self.settings.sglang_api_key is not None
            self.on_notice(auth_line(rt.server_name, key_set))
        else:
            contact.found_down(seen.error or "no answer")

    def _preflight_all(self) -> None:
        """The parity preflight of every server that answers, at once, before any takes work,
        so that no server starts ahead of the others; one that does not answer is checked
        when it does."""
        if self.settings.parity_sample <= 0:
            return

        def check(rt: WorkerRuntime) -> None:
            report = preflight(self.db, self.settings, self.run, rt.server_name, rt.server_url)
            if report is not None:
                self._parity[rt.server_name] = report.status

        reachable = [rt for rt in self.runtimes if self._contacts[rt.server_name].up]
        if not reachable:
            return
        with ThreadPoolExecutor(len(reachable), thread_name_prefix="tm-parity") as pool:
            list(pool.map(check, reachable))

    def _parity_blocks(self, rt: WorkerRuntime) -> bool:
        """The preflight, once per server when it first answers: True when the server renders
        this `--require-parity` run's prompts differently (it then takes no work)."""
        status = self._parity.get(rt.server_name)
        if status is None and self.settings.parity_sample > 0:
            report = preflight(self.db, self.settings, self.run, rt.server_name, rt.server_url)
            if report is None:  # the server did not answer: try again in a moment
                return True
            status = self._parity[rt.server_name] = report.status
        return self.run.generation.require_parity and status == "differs"

    def _feed(self, rt: WorkerRuntime) -> None:
        while not self._stop.is_set():
            if rt.window.room() <= 0 or not self._reachable(rt) or rt.paused():
                self._stop.wait(self.poll_s)
                continue
            if self._parity_blocks(rt):
                self._stop.wait(max(self.poll_s, rt.settings.unavailable_wait_s))
                continue
            if not rt.pins.run_matches_server(self.run.id):
                # refused (its fingerprint differs), or its fingerprint could not be read yet
                self._refused[rt.server_name] = rt.pins.refuses_run(self.run.id)
                self._stop.wait(max(self.poll_s, rt.settings.unavailable_wait_s))
                rt.pins.forget_run(self.run.id)  # look again: the server may come back fixed
                continue
            self._refused[rt.server_name] = False
            try:
                # the window's one gate: it holds the room, and the claim fills it
                admitted = rt.window.admit(
                    256,
                    lambda room: self._claim(rt, room),
                    conversations=self.run.generation.turns.boundary_samples,
                )
            except Exception as exc:
                log.warning(
                    "claiming from the ledger failed (%s); retrying",
                    exc,
                    extra={"action": "claim_failed"},
                )
                self._stop.wait(1.0)
                continue
            if not admitted.items:
                self._stop.wait(self.poll_s)

    def _claim(self, rt: WorkerRuntime, room: int) -> list[claims.ClaimedItem]:
        """Up to room items, or (boundary samples) every item of up to room conversations;
        text items only for a server that reads no images."""
        text_only = not rt.pins.reads_images()
        if not self.run.generation.turns.boundary_samples:
            with self.db.begin() as conn:
                return claims.claim_next(
                    conn,
                    owner=rt.owner,
                    server=rt.server_name,
                    lease_s=rt.settings.lease_s,
                    limit=room,
                    run_id=self.run.id,
                    text_only=text_only,
                )
        with self._claim_lock, self.db.begin() as conn:
            return claims.claim_next_groups(
                conn,
                owner=rt.owner,
                server=rt.server_name,
                lease_s=rt.settings.lease_s,
                limit=room,
                run_id=self.run.id,
                text_only=text_only,
            )

    def counts(self) -> reads.RunCounts:
        with self.db.connect() as conn:
            return reads.run_counts(conn, self.run)

    def servers(self) -> list[ServerView]:
        views = []
        for rt in self.runtimes:
            contact = self._contacts[rt.server_name].state()
            views.append(
                ServerView(
                    name=rt.server_name,
                    url=rt.server_url,
                    inflight=rt.window.stats.inflight,
                    done=rt.window.stats.done,
                    failed=rt.window.stats.failed,
                    output_tokens=rt.window.stats.output_tokens,
                    unavailable=rt.window.unavailable(),
                    refused=self._refused.get(rt.server_name, False),
                    last_error=rt.window.stats.last_error,
                    parity_differs=self._parity.get(rt.server_name) == "differs",
                    down=not contact.up,
                    down_for_s=contact.down_for_s,
                    down_error=contact.error,
                    text_only=rt.pins.known_text_only(),
                    drift=rt.pauses.local,
                    draining=rt.server_state.draining is not None,
                    auth=rt.server_state.key_refused is not None,
                )
            )
        return views

    def inflight(self) -> int:
        """Requests out to the servers now (what a stop waits for)."""
        return sum(rt.window.stats.inflight for rt in self.runtimes)

    def wait(
        self, on_tick: Callable[[reads.RunCounts], None] = lambda c: None, tick_s: float = 0.5
    ) -> reads.RunCounts:
        """Block until the run has no unfinished items; lease expiries are swept meanwhile."""
        last_sweep = time.monotonic()
        while True:
            counts = self.counts()
            on_tick(counts)
            if counts.finished and all(rt.window.idle() for rt in self.runtimes):
                return counts
            if self.run.generation.require_parity and all(
                self._parity.get(rt.server_name) == "differs" for rt in self.runtimes
            ):
                raise ConfigurationError(
                    f"every server renders the prompts of run {self.run.name} differently from "
                    "the stored ones, and the run requires parity (see `tokenmill parity "
                    f"{self.run.name} --server URL`); nothing was sent"
                )
            stuck = self._stuck(counts)
            if stuck is not None:
                raise ConfigurationError(stuck)
            if counts.waiting and self._only_waiting(counts):
                self._catch_up_turns()
            if time.monotonic() - last_sweep > self.settings.heartbeat_s:
                last_sweep = time.monotonic()
                with self.db.begin() as conn:
                    outcomes.requeue_expired(conn, run_id=self.run.id)
            time.sleep(tick_s)

    def _stuck(self, counts: reads.RunCounts) -> str | None:
        """Why no server will take the run's items left (None: some server may): every server
        stopped for token drift, or the items left have images and every server was read and
        understands none. Asked only while nothing is leased or in flight."""
        if counts.leased or not (counts.pending or counts.queued):
            return None
        if not all(rt.window.idle() for rt in self.runtimes):
            return None
        if all(rt.pauses.local for rt in self.runtimes):
            drifts = "; ".join(f"{rt.server_name}: {rt.pauses.local}" for rt in self.runtimes)
            return (
                f"every server stopped for token drift, so run {self.run.name} cannot go on "
                f"(nothing it served was written): {drifts}"
            )
        if not all(rt.pins.known_text_only() or rt.pauses.local for rt in self.runtimes):
            return None
        with self.db.connect() as conn:
            if claims.text_items_left(conn, self.run.id):
                return None
        left = counts.pending + counts.queued
        return (
            f"{left} image items of run {self.run.name} wait for a server that understands "
            "images, and no --server does (their /model_info has_image_understanding is not "
            "true); they stay queued"
        )

    def _only_waiting(self, counts: reads.RunCounts) -> bool:
        active = counts.pending or counts.queued or counts.leased
        return not active and all(rt.window.idle() and rt.turns.idle() for rt in self.runtimes)

    def _catch_up_turns(self) -> None:
        """Nothing in flight, yet later turns wait: start them (a notification was lost), or
        stop with the reason if none can be started (the run's tokenizer cannot be used)."""
        advanced = advance(self.db, shared_cache(), run_id=self.run.id)
        if advanced.started or advanced.failed:
            return
        counts = self.counts()
        if counts.waiting and self._only_waiting(counts):
            raise ConfigurationError(
                f"{counts.waiting} later turns of run {self.run.name} cannot be started "
                f"(see `tokenmill events --run {self.run.name}`); they stay waiting"
            )

    def stop(self) -> None:
        """Stop feeding, then stop every window at once: each lets its requests in flight
        finish for up to drain_timeout_s and gives back what is still leased."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for probe in self._probes.values():
            probe.stop()
        if not self.runtimes:
            return
        with ThreadPoolExecutor(len(self.runtimes), thread_name_prefix="tm-stop") as pool:
            list(pool.map(lambda rt: rt.stop(), self.runtimes))

"""One worker's runtime: the server it serves, its in-flight window, and the parts that hold
the worker's state, each in a module of its own:

- `run_pins.RunPins`: the runs it met, its server's fingerprint, what each run pinned;
- `server_state.ServerState`: what it believes about its server (down, draining, a key
  refused, back-pressure, paused), the one owner of those facts;
- `pause_watch.PauseWatch`: the server's pause flag, and the worker's own pause for drift;
- `confirming.Confirmation`: its server's refusals that can depend on the server, confirmed
  by another server before they are final, and the pause of a server that fails many;
- `app.sglang.client.client_for`: the clients of its server, one per thread that sends;
- the window (`window.InflightWindow`) and its sizer (`autosize.WindowSizer`).

The runtime is the window's RunPolicy: it answers the window's questions from those parts.
Created lazily in the worker process (after any fork); the Celery task and the embedded
runner both hand claimed items to it.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Hashable

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from app.core.contracts import GenerateResult
from app.core.errors import ServerRefusal
from app.core.images import ImageDrift
from app.core.settings import Settings
from app.ledger import claims, database, registry
from app.sglang.client import SGLangClient, client_for
from app.sglang.limits import RequestNeed
from app.storage.image_store import image_location
from workers.chains.advancer import TurnAdvancer
from workers.engine import autosize
from workers.engine.confirming import Confirmation, OtherServers
from workers.engine.failure_digest import FailureDigest
from workers.engine.identity import server_name_for
from workers.engine.image_checks import ImageChecks
from workers.engine.image_data import ImageData
from workers.engine.pause_watch import PauseWatch
from workers.engine.policies import policy_for
from workers.engine.run_pins import RunPins
from workers.engine.run_stores import RunStores
from workers.engine.scheduling import ClaimOrder, ServerPriority, read_work
from workers.engine.server_state import ServerState
from workers.engine.window import InflightWindow, WindowConfig
from workers.engine.window_types import Checked, KindPolicy, Verdict

log = logging.getLogger(__name__)


def make_owner(label: str) -> str:
    """A lease owner id unique to this process and window."""
    return f"{socket.gethostname()}:{os.getpid()}:{label}:{uuid.uuid4().hex[:8]}"


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
        if inflight is not None:  # a caller's fixed window wins over the setting
            settings = settings.model_copy(update={"inflight": inflight})
        self.settings = settings
        self.db = db
        self.server_url = server_url.rstrip("/")
        self.server_name = server_name or server_name_for(self.server_url)
        # the embedded runner marks its owners, so its rerun can tell them apart
        self.owner = make_owner(owner_prefix + self.server_name)
        self.images = ImageChecks(
            db,
            self.server_name,
            ImageData(lambda: image_location(settings)),
            RunStores(db, settings, self.server_name),
        )
        self.pins = RunPins(
            db,
            self.server_name,
            only_run=only_run,
            new_client=self.new_client,
            images=self.images,
            on_fingerprint_read=self._fingerprint_read,
            on_auth=lambda message: self.server_state.needs_key(message),
            on_weights_noted=lambda: self.pauses.reread(),
        )
        # whose items free room takes: the highest priority first, one priority round robin
        self.claim_order = ClaimOrder(lambda: read_work(db))
        # the server's own queue order, when it schedules by request priority
        self.server_priority = ServerPriority(self._server_info)
        # resumed: the server's configuration may have changed meanwhile (a restart, weights)
        n = autosize.start_size(settings)
        self.server_state = ServerState(
            size=n,
            retry_backoff_s=settings.retry_backoff_s,
            retry_backoff_max_s=settings.retry_backoff_max_s,
            unavailable_wait_s=settings.unavailable_wait_s,
            registry_paused=lambda: self.pauses.state()[0],
        )
        self.pauses = PauseWatch(db, self.server_name, self.server_state, on_resume=self._resumed)
        # refusals that can depend on the server: confirmed elsewhere; many pause it as failing
        self.confirmation = Confirmation(
            self.server_name,
            self.pins,
            OtherServers(db, self.server_name, self.pins),
            on_failing=self.pauses.failing,
        )
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
            server_state=self.server_state,
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

    # --- the claim order (workers/engine/scheduling.py) ------------------------------------

    def run_priority(self, run_id: int) -> int:
        """The run's priority now: as the claim order last read it (every few seconds, for the
        runs with items waiting), else as the run's pin was first read here."""
        work = self.claim_order.work().get(run_id)
        return work.priority if work is not None else self.pins.run_info(run_id).priority

    def request_priority(self, run_id: int) -> int | None:
        """The priority the run's requests carry when the server schedules by priority: the
        run's as last read (the claim order's, or its pin), in the server's direction."""
        return self.server_priority.request_priority(self.run_priority(run_id))

    def _server_info(self) -> dict[str, object]:
        client = self.new_client()
        try:
            return client.server_info()
        finally:
            client.close()

    def _fingerprint_read(self) -> None:
        """The server's fingerprint was read anew: its capacity and scheduling may differ."""
        self.sizer.reread()
        self.server_priority.forget()

    def claims_ahead(self, run_id: int) -> bool:
        """Whether this worker may claim the run's items from the ledger ahead of its
        message's: a fleet run it serves, not refused here (its fingerprint, or images in a
        storage this worker does not reach), whose items run one by one (not `--turns all`
        chains nor `--turns each` conversations, which keep their order)."""
        pins = self.pins
        return (
            pins.only_run is None
            and pins.serves_run(run_id)
            and not pins.refuses_run(run_id)
            and pins.run_info(run_id).generation.turns.final_only
            and (self.images.pins(run_id) is None or self.images.reaches(run_id))
        )

    # --- the window's RunPolicy -------------------------------------------------------------

    def new_client(self) -> SGLangClient:
        return client_for(self.server_url, self.settings)

    def kind_policy(self, run_id: int) -> KindPolicy:
        return policy_for(self.pins.run_info(run_id))

    def group_of(self, run_id: int, item_key: str) -> Hashable | None:
        """The conversation an item belongs to, for runs of boundary samples (`--turns
        each`): its items run on one server, one after another; None for other runs."""
        if not self.pins.run_info(run_id).generation.turns.boundary_samples:
            return None
        return (run_id, item_key)

    def paused(self) -> bool:
        return self.server_state.paused()

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

    def refused_here(self, item: claims.ClaimedItem, error: ServerRefusal) -> Verdict:
        """The server refused item for a reason that can depend on the server: the item's own
        failure, final, or given back for another server (workers.engine.confirming)."""
        sampling = self.pins.run_info(item.run_id).generation.sampling
        params = sampling.for_sample(item.sample_index, item.row_sampling_params)
        need = RequestNeed(len(item.prompt_ids), int(params.get("max_new_tokens") or 0))
        return self.confirmation.verdict(item, error, need)

    def _resumed(self) -> None:
        """The server's pause was lifted: its configuration may have changed meanwhile (a
        restart, weights, a fix), so its runs are checked again and its refusals counted
        afresh."""
        self.pins.forget_runs()
        self.confirmation.watch.reset()

    def check_result(self, item: claims.ClaimedItem, result: GenerateResult) -> Checked:
        """Whether this result may be written: not if it was made (in part) under other
        weights than the run pinned, nor, for an image item, if its served prompt is not the
        request expanded (token drift: the server is paused); its image token counts if so."""
        change = self.pins.weights_refusal(item.run_id, result)
        if change is not None:
            return Checked(refusal=f"weights changed: {change}")
        if not item.images:
            return Checked()
        try:
            counts = self.images.accept(item, result)
        except ImageDrift as exc:
            run_name = self.pins.run_info(item.run_id).name
            return Checked(
                refusal=self.pauses.image_drift(item.run_id, run_name, item.id, str(exc))
            )
        except SQLAlchemyError as exc:  # the counts could not be compared: not written yet
            log.warning(
                "could not check the image counts of item %d (%s)",
                item.id,
                exc,
                extra={"action": "image_check_failed"},
            )
            return Checked(refusal=f"image counts not checked (ledger error: {exc})")
        return Checked(image_token_counts=counts)

    def find_hedges(self, limit: int) -> list[claims.ClaimedItem]:
        """Up to limit items running on other servers, in runs with nothing left to claim,
        that this server may serve (not boundary samples); marked as hedged by this worker."""
        refused = self.pins.checked_runs()
        text_only = not self.pins.reads_images()
        with self.db.connect() as conn:
            database.limit_periodic(conn)
            candidates = claims.hedge_candidates(
                conn, server=self.server_name, limit=limit, skip_runs=refused, text_only=text_only
            )
        # checked outside the transaction: a first use pins the run's fingerprint (a write).
        # Boundary samples are not hedged: a conversation's items wait on their server on
        # purpose (its prefix cache holds their history), and a copy elsewhere finds none.
        pins = self.pins
        ids = [
            item_id
            for item_id, run_id in candidates
            if pins.serves_run(run_id)
            and not pins.run_info(run_id).generation.turns.boundary_samples
            and pins.run_matches_server(run_id)
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

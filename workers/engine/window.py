"""The in-flight window: keeps a constant number of requests in flight to one SGLang server.

Claimed items wait in a small backlog (backlog.py); each of N slot threads (slots.py, one
single-connection client each) takes the next item the moment its previous request finishes,
so there are no batch barriers and heavy-tailed output lengths never idle the server. Outcomes
go to one writer thread that commits them in small groups (writer.py); a heartbeat thread with
its own connection keeps this worker's leases alive (heartbeat.py).

At the end of a run, free slots send second copies of items still running on other servers
(hedging.py): the first result written wins, the copy that lost is aborted, and hedges give
their slots back at once when real work arrives.

Its size is set at run time (resize): fixed, or sized by the server by workers/engine/autosize.py.

The window owns the one condition; its parts (Room and InFlight, Conversations, Hedges) are plain
structures it calls under it, and its gates work on them under it too (window_parts.py): the
intake (window_intake.py: room held, items claimed into it), hedges (window_hedges.py) and
what a refusing server gives back (window_refusals.py: drains, a hung server, back-pressure).
Its threads (slots, the writer, the timer's hedge round) ask it and its gates through their
public methods; what it believes about its server is ServerState's (server_state.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import Engine

from app.core.contracts import GenerateResult
from app.core.errors import ServerRefusal
from app.ledger import claims, outcomes
from workers.engine.backlog import Backlog
from workers.engine.groups import Conversations
from workers.engine.heartbeat import renew_leases
from workers.engine.hedging import HedgeRound, Hedges
from workers.engine.room import InFlight, Room
from workers.engine.server_state import ServerState
from workers.engine.slots import Slot
from workers.engine.timer import Timer
from workers.engine.window_hedges import HedgeGate
from workers.engine.window_intake import Admission
from workers.engine.window_parts import WindowParts
from workers.engine.window_refusals import Refusals
from workers.engine.window_types import Admitted, Checked, Job, RunPolicy, Verdict

# the window's own records, named here too: callers build and read a window with them
from workers.engine.window_types import WindowConfig as WindowConfig
from workers.engine.window_types import WindowStats as WindowStats
from workers.engine.writer import ResultWriter

log = logging.getLogger(__name__)


class InflightWindow:
    """N slot threads, a writer and a heartbeat around one server; thread-safe submit()."""

    def __init__(
        self,
        config: WindowConfig,
        *,
        db: Engine,
        owner: str,
        policy: RunPolicy,
        server_state: ServerState | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.owner = owner
        self.stats = WindowStats()
        self._db = db
        # the runs' sampling and conversations, the pause flag, the result checks, the images,
        # where released and finished items go, the hedges: asked of the policy
        self.policy = policy
        self._clock = clock
        # guards the room, the in-flight map, the conversations, the hedges and the stats
        self._cond = threading.Condition()
        self._room = Room(config, clock)
        self._sending = InFlight()
        self._groups: Conversations[Job] = Conversations(
            order=lambda j: (len(j.item.prompt_ids), j.item.turn_index, j.item.sample_index)
        )
        self._backlog = Backlog()
        self._writer = ResultWriter(db, owner=owner, config=config, on_written=self._written)
        self._hedges = Hedges(stats=self.stats, clock=clock, client_factory=policy.new_client)
        # what this worker believes about its server (down, draining, back-pressure, ...)
        self._server = server_state or ServerState(
            size=config.inflight,
            retry_backoff_s=config.retry_backoff_s,
            retry_backoff_max_s=config.retry_backoff_max_s,
            unavailable_wait_s=config.unavailable_wait_s,
            registry_paused=policy.paused,
            clock=clock,
        )
        self._stopping = threading.Event()
        parts = WindowParts(
            config,
            policy,
            self._server,
            clock,
            self._cond,
            self._room,
            self._sending,
            self._groups,
            self._backlog,
            self._hedges,
            self.stats,
            self._stopping,
            self._writer,
        )
        # its gates: work in (room, claims, jobs for the slots) and hedges in and out
        self.intake = Admission(parts)
        self.hedging = HedgeGate(parts)
        self.refusals = Refusals(parts)
        self._hedge_round = HedgeRound(self.hedging, db=db, policy=policy)
        self._timer = Timer(
            config,
            self._backlog,
            clock=clock,
            stopping=self._stopping,
            release_early=self.intake.release_early,
            hedge_round=self._hedge_round.run,
            settle=self.settle,
        )
        self._threads: list[threading.Thread] = []
        self._slot_seq = 0
        self._started = False

    @property
    def server_name(self) -> str:
        return self.config.server_name

    @property
    def server_state(self) -> ServerState:
        """The server's state as this worker sees it (its own owner, with its own lock)."""
        return self._server

    @property
    def serves_conversations(self) -> bool:
        """Whether this window takes `--turns each` conversations (then it backlogs one): set
        by the window itself, when a caller admits conversations or one is submitted."""
        return self._room.serves_conversations

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        name = self.config.server_name
        self._add_slots(self.config.inflight)
        self._spawn(self._writer.loop, f"tm-writer-{name}")
        self._spawn(self._timer.loop, f"tm-timer-{name}")
        self._spawn(
            lambda: renew_leases(self._db, self.owner, self.config, self._stopping),
            f"tm-heartbeat-{name}",
        )
        if self.config.hedge_interval_s > 0:
            self._spawn(self._hedges.abort_loop, f"tm-abort-{name}")
        log.info(
            "window started server=%s inflight=%d owner=%s",
            name,
            self.config.inflight,
            self.owner,
            extra={"action": "window_started"},
        )

    def _add_slots(self, n: int) -> None:
        for _ in range(n):
            self._slot_seq += 1
            name = f"tm-slot-{self.config.server_name}-{self._slot_seq}"
            self._spawn(Slot(self, self.policy.new_client).loop, name)

    def resize(self, inflight: int, backlog: int) -> int:
        """Keep inflight requests in flight from now on (and backlog items beyond them): new
        slots start at once; surplus slots end as they finish their request (a stop mark
        each, behind the jobs already waiting). The slots' connections and the room the
        consumer reserves follow the size; returns the size before."""
        inflight = max(1, inflight)
        with self._cond:
            before = self.config.inflight
            if self._stopping.is_set() or inflight == before:
                return before
            self.config.inflight = inflight
            self.config.backlog = backlog
            self._server.resize(inflight)  # back-pressure's limit never exceeds the window
            self._threads = [t for t in self._threads if t.is_alive()]
            if self._started and inflight < before:
                self._backlog.stop_slots(before - inflight)
            self._cond.notify_all()
        if self._started and inflight > before:
            self._add_slots(inflight - before)
        log.info(
            "window of %s resized %d -> %d",
            self.config.server_name,
            before,
            inflight,
            extra={"action": "window_resized"},
        )
        return before

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking work, give back what was not sent, let in-flight requests finish for
        up to drain_timeout_s, write every outcome, then release whatever is still leased."""
        if not self._started:
            return
        with self._cond:
            self._stopping.set()
            # hedges are spare copies: abort them instead of waiting for them to finish
            self._hedges.make_room(len(self._hedges.jobs()))
            self.refusals.give_back(self._groups.drop_all(), "worker shutting down")
            self._cond.notify_all()
        self._backlog.stop_slots(self.config.inflight)
        deadline = self._clock() + drain_timeout_s
        with self._cond:
            while self._room.outstanding > 0 and self._clock() < deadline:
                self._cond.wait(timeout=0.1)
        self._writer.stop()
        for thread in self._threads:
            if thread.name.startswith("tm-writer"):
                thread.join(timeout=max(5.0, deadline - self._clock()))
        try:
            with self._db.begin() as conn:
                leftover = outcomes.release_owner(conn, self.owner)
            if leftover:
                log.info(
                    "window stop released %d unfinished items",
                    len(leftover),
                    extra={"action": "released"},
                )
                self.policy.released(leftover, 0.0)
        except Exception:
            log.exception(
                "could not release leases at shutdown; they expire on their own",
                extra={"action": "release_failed"},
            )
        self._hedges.stop_aborts()
        for thread in self._threads:
            if thread.name.startswith("tm-abort"):
                thread.join(timeout=5.0)  # the hedges' aborts go out before the process ends
        log.info(
            "window stopped server=%s", self.config.server_name, extra={"action": "window_stopped"}
        )

    def is_stopping(self) -> bool:
        return self._stopping.is_set()

    # --- intake ---------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        with self._cond:
            return self._room.outstanding

    def unavailable(self) -> bool:
        """Nothing is sent now: the server went away a moment ago, drains, or wants a key."""
        return self._server.unavailable()

    def mark_unavailable(self) -> None:
        """The server refused or dropped a request as down: nothing is sent for a while."""
        self._server.mark_unavailable()

    def paused(self) -> bool:
        return self._server.paused()

    def capacity(self) -> int:
        """Items this window takes: the in-flight slots plus the backlog."""
        return self.intake.capacity()

    def wait_for_room(self, n: int, timeout_s: float | None = None) -> bool:
        """Block until n more items fit in the window (backpressure on the message consumer)."""
        return self.intake.wait_for_room(n, timeout_s)

    def admit(
        self,
        units: int,
        claim: Callable[[int], list[claims.ClaimedItem]],
        *,
        timeout_s: float = 0.0,
        conversations: bool = False,
    ) -> Admitted:
        """The one way work enters this window (window_intake.Admission.admit)."""
        return self.intake.admit(units, claim, timeout_s=timeout_s, conversations=conversations)

    def room(self) -> int:
        return self.intake.room()

    def units(self, claimed: list[claims.ClaimedItem]) -> int:
        """The room these items take: one per conversation, one per other item."""
        return self.intake.units(claimed)

    def submit(self, claimed: list[claims.ClaimedItem]) -> None:
        """Queue items claimed without admit() (after wait_for_room) for sending."""
        self.intake.submit(claimed)

    def idle(self) -> bool:
        with self._cond:
            return self._room.idle()

    def abandon_inflight(self, reason: str) -> int:
        """Give back every item whose request is still out (a hung or dead server): other
        servers take them at once; a late answer is still written if it comes."""
        jobs = self.refusals.abandon(reason)
        # the abandoned slots may stay blocked on a hung socket until the generate timeout:
        # fresh slots keep the window whole (they hold items back while the server is paused)
        for job in jobs:
            self._spawn(
                Slot(self, self.policy.new_client).loop,
                f"tm-slot-{self.config.server_name}-r{job.item.id}",
            )
        if jobs:
            log.warning(
                "gave back %d in-flight items of %s: %s",
                len(jobs),
                self.config.server_name,
                reason,
                extra={"action": "gave_back"},
            )
        return len(jobs)

    # --- drains and auth (the probe loop and the slots call these) ------------------------

    def drain(self, reason: str) -> int:
        """The server drains: send it nothing new, let the requests out finish, and give back
        every claimed item still waiting here (others take them at once); how many."""
        return self.refusals.drain(reason)

    def needs_key(self, error: str) -> None:
        """The server answered 401/403: it stays refused until its key is accepted."""
        self._server.needs_key(error)

    # --- what the slots ask (slots.SlotHost) -------------------------------------------------

    def next_job(self) -> Job | None:
        return self._backlog.take()

    def settle(self, outcome: outcomes.Outcome, job: Job | None = None) -> None:
        """job's outcome goes to the writer; its room comes back once it is committed, or
        passes to its conversation's next item."""
        with self._cond:
            if job is not None and job.abandoned:
                # already given back; only a real result is still worth writing
                if isinstance(outcome, outcomes.Done):
                    self._writer.put(outcome, False)
                return
            self._room.handed_to_writer()
            if isinstance(outcome, outcomes.Failed) and job is not None:
                self.policy.failed(job.item.run_id, outcome.item_id, outcome.error)
            if job is not None and job.group is not None:
                successor = self._groups.settled(job.group, job)
                if successor is not None:
                    # the conversation's unit of room passes to its next item (queued under
                    # the lock: ahead of any stop marks)
                    self._room.take(1)
                    self._backlog.put(successor)
        self._writer.put(outcome, True)

    def sent(self, job: Job, rid: str) -> None:
        """job goes out as request rid."""
        with self._cond:
            self.stats.sent += 1
            self.stats.inflight += 1
            job.rid = rid
            self._sending.add(job)
            if job.group is not None:
                self._groups.sent(job.group, job, self._clock())

    def answered(self, job: Job) -> None:
        with self._cond:
            self._sending.remove(job)
            job.pushed_back = 0
            self._server.answered()

    def sending_ended(self, job: Job) -> None:
        with self._cond:
            self.stats.inflight -= 1
            self._sending.remove(job)

    def retry_later(self, job: Job, reason: str, delay_s: float) -> None:
        """The attempt failed and is recorded; job goes out again after delay_s."""
        self._writer.put(outcomes.RetryLater(job.item.id, reason), False)
        with self._cond:
            self._backlog.later(job, self._clock() + delay_s)
            self.stats.retried += 1

    def note(self, *, failed: int = 0, error: str | None = None) -> None:
        with self._cond:
            self.stats.note(failed=failed, error=error)

    def count_done(self, result: GenerateResult) -> None:
        with self._cond:
            self.stats.count_done(result.completion_tokens, at=self._clock())

    def check_result(self, item: claims.ClaimedItem, result: GenerateResult) -> Checked:
        """Whether result may be written (not if made with other weights than its run's, or
        with token drift on an image item) and, for an image item, its image token counts."""
        return self.policy.check_result(item, result)

    def image_data(self, item: claims.ClaimedItem) -> list[str]:
        """The images of an image item's request; PermanentError when they cannot be sent."""
        return self.policy.image_data(item)

    def refused_here(self, item: claims.ClaimedItem, error: ServerRefusal) -> Verdict:
        """What the server's refusal of item (a reason that can depend on the server) means."""
        return self.policy.refused_here(item, error)

    # --- writer: what a commit settles -----------------------------------------------------

    def _written(self, entries: list[tuple[outcomes.Outcome, bool]], released: list[int]) -> None:
        """Called by the writer after each commit: start what follows the finished items,
        re-queue the released ones, and give back the room of every settled one."""
        batch = [outcome for outcome, _ in entries]
        settled = sum(1 for _, settles in entries if settles)
        ended = sum(1 for o in batch if isinstance(o, outcomes.Done | outcomes.Failed))
        finished = [o.item_id for o in batch if isinstance(o, outcomes.Done | outcomes.Failed)]
        if finished:
            self.policy.finished(finished)
        if released:
            with self._cond:
                self.stats.released += len(released)
            down = self._server.gone_recently()
            wait_s = self.config.unavailable_wait_s if down else 0.0
            try:
                self.policy.released(released, wait_s)
            except Exception:
                log.exception(
                    "could not re-queue %d released items; reconcile will",
                    len(released),
                    extra={"action": "requeue_failed"},
                )
        with self._cond:
            self._room.committed(settled, ended)
            self._cond.notify_all()

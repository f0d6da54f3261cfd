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
structures it calls under it, and its threads (slots, the writer, the timer's hedge round) ask it
through its public methods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

from sqlalchemy import Engine

from app.core.contracts import GenerateResult
from app.ledger import outcomes
from app.ledger.claims import ClaimedItem
from app.ledger.outcomes import Done, Failed, Outcome, Released, RetryLater
from workers.engine.backlog import Backlog
from workers.engine.groups import Conversations
from workers.engine.heartbeat import renew_leases
from workers.engine.hedging import HedgeRound, Hedges
from workers.engine.room import InFlight, Room
from workers.engine.server_state import ServerState
from workers.engine.slots import Slot
from workers.engine.timer import Timer
from workers.engine.window_types import Admitted, Checked, Job, RunPolicy

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
        server: ServerState | None = None,
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
        self._hedge_round = HedgeRound(self, db=db, policy=policy)
        # what this worker believes about its server (down, draining, back-pressure, ...)
        self._server = server or ServerState(
            size=config.inflight,
            retry_backoff_s=config.retry_backoff_s,
            retry_backoff_max_s=config.retry_backoff_max_s,
            unavailable_wait_s=config.unavailable_wait_s,
            registry_paused=policy.paused,
            clock=clock,
        )
        self._stopping = threading.Event()
        self._timer = Timer(
            config,
            self._backlog,
            clock=clock,
            stopping=self._stopping,
            release_early=self._release_early,
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
    def server(self) -> ServerState:
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
            self._give_back(self._groups.drop_all(), "worker shutting down")
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
        with self._cond:
            return self._room.capacity()

    def wait_for_room(self, n: int, timeout_s: float | None = None) -> bool:
        """Block until n more items fit in the window (backpressure on the message consumer)."""
        n = min(n, self.capacity())
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._cond:
            while self._room.free() < n:
                if self._stopping.is_set():
                    return False
                self._hedges.make_room(n - self._room.free())
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(timeout=0.5 if remaining is None else min(0.5, remaining))
            return True

    def admit(
        self,
        units: int,
        claim: Callable[[int], list[ClaimedItem]],
        *,
        timeout_s: float = 0.0,
        conversations: bool = False,
    ) -> Admitted:
        """The one way work enters this window, for the Celery push and the embedded pull
        alike: hold room for up to `units` units (a conversation is one unit; wait up to
        timeout_s for a worthwhile share, as much as fits after it), ask `claim(held)` for the
        items to send in that room, submit them and give back the room they do not take.

        Returns the units held and the items sent. Held is 0 when there is no room, the
        server is paused or unavailable, or the window is stopping: then claim is not called.
        If claim raises, the room is given back and the error propagates (the leases it may
        have taken come back by expiry or reconcile). `conversations`: the units are
        `--turns each` conversations, so the window keeps one waiting in its backlog."""
        if conversations:
            with self._cond:
                self._room.serves_conversations = True
        held = self._reserve(units, timeout_s)
        if not held:
            return Admitted(0, [])
        if self.unavailable() or self.paused():
            self._unreserve(held)
            return Admitted(0, [])
        try:
            claimed = claim(held)
            taken = self.units(claimed)
            if taken > held:
                raise ValueError(f"claimed {taken} units of room, {held} were held")
        except BaseException:
            self._unreserve(held)
            raise
        self._unreserve(held - taken)
        self._submit(claimed, reserved=True)
        return Admitted(held, claimed)

    def _reserve(self, n: int, timeout_s: float) -> int:
        """Hold room for up to n items before claiming them: wait up to timeout_s until a
        worthwhile share fits (all n, or a full backlog's worth), then hold what fits; after
        the wait, whatever fits (maybe 0; 0 when stopping). The caller claims that many ids
        and hands the rest back unclaimed, so no claimed item waits here for a slot while
        another server could run it. admit() settles it."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while not self._stopping.is_set():
                backlog = self._room.backlog_limit()
                room = self._room.free()
                if room >= min(n, backlog) or self._clock() >= deadline:
                    break
                self._hedges.make_room(min(n, backlog) - room)
                self._cond.wait(timeout=min(0.5, max(0.0, deadline - self._clock())))
            if self._stopping.is_set():
                return 0
            held = max(0, min(n, self._room.free()))
            self._room.take(held)
            return held

    def _unreserve(self, n: int) -> None:
        """Give back room reserved for items that were not submitted after all."""
        if n <= 0:
            return
        with self._cond:
            self._room.give(n)
            self._cond.notify_all()

    def room(self) -> int:
        with self._cond:
            return max(0, self._room.free())

    def units(self, claimed: list[ClaimedItem]) -> int:
        """The room these items take: one per conversation, one per other item."""
        groups = {self.policy.group_of(c.run_id, c.item_key) for c in claimed}
        singles = sum(1 for c in claimed if self.policy.group_of(c.run_id, c.item_key) is None)
        return singles + len(groups - {None})

    def submit(self, claimed: list[ClaimedItem]) -> None:
        """Queue items claimed without admit() (after wait_for_room) for sending; each settles
        as done, failed or released."""
        self._submit(claimed, reserved=False)

    def _submit(self, claimed: list[ClaimedItem], *, reserved: bool) -> None:
        """Queue claimed items for sending. reserved=True: their room was taken by _reserve()
        (exactly units(claimed) of it).

        The items of one conversation go out one at a time, shortest first: the next when
        the one before it settles (see Conversations), so each finds its history cached."""
        if not claimed:
            return
        jobs = [
            Job(
                item=c,
                sampling=self.policy.sampling_for_run(c.run_id),
                group=self.policy.group_of(c.run_id, c.item_key),
            )
            for c in claimed
        ]
        by_group: dict[Hashable, list[Job]] = {}
        for job in jobs:
            if job.group is not None:
                by_group.setdefault(job.group, []).append(job)
        with self._cond:
            room = self._room
            room.serves_conversations = room.serves_conversations or bool(by_group)
            if not reserved:
                room.take(self.units(claimed))
            ready = [j for j in jobs if j.group is None]
            for key, members in by_group.items():
                head = self._groups.admit(key, members)
                if head is None:
                    room.give(1)  # rides on the head its conversation has out
                else:
                    ready.append(head)
            # real work never waits behind a hedge: as many hedges as items would wait for a
            # slot give theirs up (hedges already cancelled are on their way out)
            self._hedges.make_room(min(len(ready), room.waiting() - self._hedges.leaving()))
        for job in ready:
            self._backlog.put(job)

    def _give_back(self, jobs: list[Job], reason: str) -> None:
        """Release held items that will not be sent (call with _cond held)."""
        for job in jobs:
            self._room.take(1)
            self._room.handed_to_writer()
            self._writer.put(Released(job.item.id, reason), True)

    def _release_early(self) -> None:
        """Slots about to idle take the next items of conversations whose head is past its
        prefill (group_stagger_s), instead of waiting for the head to finish."""
        with self._cond:
            free = self.config.inflight - self.stats.inflight
            if free <= 0 or not self._backlog.empty() or self._stopping.is_set():
                return
            early = self._groups.early(self._clock(), self.config.group_stagger_s, free)
            self._room.take(len(early))
            for job in early:
                self._backlog.put(job)

    def idle(self) -> bool:
        with self._cond:
            return self._room.idle()

    def abandon_inflight(self, reason: str) -> int:
        """Give back every item whose request is still out (a hung or dead server): other
        servers take them at once; a late answer is still written if it comes."""
        with self._cond:
            jobs = [j for j in self._sending.jobs() if not j.abandoned]
            for job in jobs:
                self._room.handed_to_writer()
                self._writer.put(Released(job.item.id, reason), True)
                job.abandoned = True
                if job.group is not None:  # its conversation goes elsewhere with it
                    self._give_back(self._groups.drop(job.group), reason)
            # hedges on this server are dropped (the item stays with its holder)
            dropped = self._hedges.abandon()
            if dropped:
                self._room.give(len(dropped))
                self._cond.notify_all()
            jobs += dropped
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

    # --- drains, back-pressure and auth (the probe loop and the slots call these) ---------

    def drain(self, reason: str) -> int:
        """The server drains: send it nothing new, let the requests out finish, and give back
        every claimed item still waiting here (others take them at once); how many."""
        self._server.drain(reason)
        with self._cond:
            waiting = []
            for job in self._backlog.take_waiting():
                if job.hedge:  # a spare copy: dropped, its item stays with its holder
                    self._hedges.forget(job)
                    self._room.give(1)
                    continue
                waiting.append(job)
                self._room.handed_to_writer()
                self._writer.put(Released(job.item.id, f"server draining: {reason}"), True)
                if job.group is not None:
                    self._give_back(self._groups.drop(job.group), reason)
            self._cond.notify_all()
        if waiting:
            log.warning(
                "server %s drains (%s): gave back %d claimed items, %d requests still out",
                self.config.server_name,
                reason,
                len(waiting),
                self.stats.inflight,
                extra={"action": "draining"},
            )
        return len(waiting)

    def needs_key(self, error: str) -> None:
        """The server answered 401/403: it stays refused until its key is accepted."""
        self._server.needs_key(error)

    def may_send(self) -> bool:
        """Whether a slot may send now, under the server's back-pressure limit."""
        with self._cond:
            return self._server.may_send(self.stats.inflight)

    def hold_back(self, job: Job) -> None:
        """job waits a moment before it is sent: the server pushed back, fewer go out."""
        with self._cond:
            delay_s = self._server.push_back_delay_s(max(1, job.pushed_back))
            self._backlog.later(job, self._clock() + delay_s)

    def pushed_back(self, job: Job, reason: str) -> None:
        """The server refused job as full: no attempt spent; the window shrinks for this
        server and job goes out again after a backoff that grows while it is refused."""
        with self._cond:
            job.pushed_back += 1
            self._server.push_back(self.stats.inflight)
            self.stats.pushed_back += 1
            delay_s = self._server.push_back_delay_s(job.pushed_back)
            self._backlog.later(job, self._clock() + delay_s)
        if job.pushed_back == 1:
            log.info(
                "server %s is full (%s): run %d item %d waits, up to %d requests out",
                self.config.server_name,
                reason,
                job.item.run_id,
                job.item.id,
                max(1, self._server.send_limit()),
                extra={"action": "back_pressure", "server": self.config.server_name},
            )

    # --- what the slots ask (slots.SlotHost) -------------------------------------------------

    def next_job(self) -> Job | None:
        return self._backlog.take()

    def settle(self, outcome: Outcome, job: Job | None = None) -> None:
        """job's outcome goes to the writer; its room comes back once it is committed, or
        passes to its conversation's next item."""
        with self._cond:
            if job is not None and job.abandoned:
                # already given back; only a real result is still worth writing
                if isinstance(outcome, Done):
                    self._writer.put(outcome, False)
                return
            self._room.handed_to_writer()
            if isinstance(outcome, Failed) and job is not None:
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
        self._writer.put(RetryLater(job.item.id, reason), False)
        with self._cond:
            self._backlog.later(job, self._clock() + delay_s)
            self.stats.retried += 1

    def note(self, *, failed: int = 0, error: str | None = None) -> None:
        with self._cond:
            self.stats.note(failed=failed, error=error)

    def count_done(self, result: GenerateResult) -> None:
        with self._cond:
            self.stats.count_done(result.completion_tokens, at=self._clock())

    def check_result(self, item: ClaimedItem, result: GenerateResult) -> Checked:
        """Whether result may be written (not if made with other weights than its run's, or
        with token drift on an image item) and, for an image item, its image token counts."""
        return self.policy.check_result(item, result)

    def image_data(self, item: ClaimedItem) -> list[str]:
        """The images of an image item's request; PermanentError when they cannot be sent."""
        return self.policy.image_data(item)

    def hedge_sent(self, job: Job, rid: str) -> bool:
        """Whether the hedge goes out as rid (not if cancelled meanwhile, or stopping)."""
        with self._cond:
            # under the lock: a hedge cancelled from now on has a rid, so its abort is sent
            if job.cancelled or self._stopping.is_set():
                return False
            job.rid = rid
            job.sent_at = self._clock()
            self.stats.hedges += 1
            self.stats.inflight += 1
            return True

    def hedge_answered(self, job: Job) -> None:
        with self._cond:
            self.stats.hedge_results += 1
            self._hedges.forget(job)

    def hedge_dropped(self, job: Job) -> None:
        """A hedge ends without a result: give its room back, write nothing."""
        with self._cond:
            self._hedges.forget(job)
            self._room.give(1)
            self._cond.notify_all()

    def hedge_ended(self) -> None:
        with self._cond:
            self.stats.inflight -= 1

    # --- what the hedge round asks (hedging.HedgeHost) ---------------------------------------

    def copies_out(self) -> list[Job]:
        """Requests out (in flight or hedges sent) still worth their answer."""
        with self._cond:
            return self._hedges.worth_an_answer(self._sending.jobs())

    def cancel_finished(self, jobs: list[Job], item_ids: set[int]) -> None:
        """Abort those of jobs (from copies_out) whose items the ledger shows finished."""
        with self._cond:
            for job in jobs:
                if job.item.id in item_ids and not job.cancelled:
                    self._hedges.cancel(job)

    def abort_stale(self) -> None:
        with self._cond:
            self._hedges.abort_again(self._sending.jobs())

    def can_hedge(self) -> bool:
        """Hedging on, not stopping, the server up and nothing waiting for a slot."""
        if not self.config.hedge or self._stopping.is_set() or self.unavailable() or self.paused():
            return False
        return self._backlog.empty()

    def admit_hedges(self, copies: Callable[[int], list[Job]]) -> list[Job] | None:
        """The gate for hedges: hold every slot no item is meant for, ask `copies(free)` for
        the hedge jobs to run in them, queue those and give back the rest. Returns the jobs
        queued ([] when no slot is free: copies is not called), or None when the window began
        stopping meanwhile (nothing queued: the caller unmarks what it found). If copies
        raises, the slots are given back."""
        free = self._hold_free_slots()
        if free <= 0:
            return []
        try:
            jobs = copies(free)[:free]
        except BaseException:
            self._unreserve(free)
            raise
        return jobs if self._queue_hedges(jobs, held=free) else None

    def _hold_free_slots(self) -> int:
        """Hold every slot no item is meant for; how many (maybe 0: then none is held)."""
        with self._cond:
            free = self._room.free_slots()
            if free <= 0:
                return 0
            self._room.take(free)
            return free

    def _queue_hedges(self, jobs: list[Job], held: int) -> bool:
        """Queue hedge jobs in the held slots, giving back the room of the rest; False (and
        nothing queued) when the window is stopping."""
        with self._cond:
            # stop() cancels the hedges it sees and then queues the slots' stop marks: under
            # the lock, these jobs are either seen by it or queued ahead of the marks
            stopping = self._stopping.is_set()
            self._room.give(held if stopping else held - len(jobs))
            if not stopping:
                for job in jobs:
                    self._hedges.add(job)
                    self._backlog.put(job)
            self._cond.notify_all()
        return not stopping

    # --- writer: what a commit settles -----------------------------------------------------

    def _written(self, entries: list[tuple[Outcome, bool]], released: list[int]) -> None:
        """Called by the writer after each commit: start what follows the finished items,
        re-queue the released ones, and give back the room of every settled one."""
        batch = [outcome for outcome, _ in entries]
        settled = sum(1 for _, settles in entries if settles)
        ended = sum(1 for o in batch if isinstance(o, Done | Failed))
        finished = [o.item_id for o in batch if isinstance(o, Done | Failed)]
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

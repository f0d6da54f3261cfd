"""The generate pipeline behind the Celery task: claim the message's items, hand them to the
window, or put the message back when this worker's server cannot take work right now (and
its image items, when the server reads no images).

Plain functions, testable without Celery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final

from app.ledger import claims, outcomes
from workers.engine.runtime import WorkerRuntime

log = logging.getLogger(__name__)

# the countdown of messages a worker held by its own probes gives back (a drain, a refused
# key, a server that does not answer)
HELD_REQUEUE_S: Final = 0.5

Requeue = Callable[[list[int], float], None]


def _release(rt: WorkerRuntime, claimed: Sequence[claims.ClaimedItem], reason: str) -> list[int]:
    """Give claimed items back to the queue without spending an attempt."""
    if not claimed:
        return []
    with rt.db.begin() as conn:
        return outcomes.record_outcomes(
            conn,
            [outcomes.Released(c.id, reason) for c in claimed],
            owner=rt.owner,
            lease_s=rt.settings.lease_s,
        )


def _units(
    rt: WorkerRuntime, ids: list[int], keys: dict[int, tuple[int, str]]
) -> tuple[list[list[int]], bool]:
    """The message's ids in units of room: a conversation's items together (the window sends
    them one at a time), every other item on its own; in message order. And whether any unit
    is a conversation."""
    units: list[list[int]] = []
    index: dict[object, int] = {}
    for item_id in ids:
        run_and_key = keys.get(item_id)
        group = None if run_and_key is None else rt.window.policy.group_of(*run_and_key)
        if group is None:
            units.append([item_id])
        elif group in index:
            units[index[group]].append(item_id)
        else:
            index[group] = len(units)
            units.append([item_id])
    return units, bool(index)


class _Hand:
    """The message's ids not yet claimed, by run, in message order."""

    def __init__(self, ids: list[int], keys: dict[int, tuple[int, str]]) -> None:
        self._by_run: dict[int, list[int]] = {}
        for item_id in ids:
            if item_id in keys:  # an id the ledger no longer has is nobody's to claim
                self._by_run.setdefault(keys[item_id][0], []).append(item_id)

    def __bool__(self) -> bool:
        return any(self._by_run.values())

    def __contains__(self, run_id: int) -> bool:
        return bool(self._by_run.get(run_id))

    def counts(self) -> dict[int, int]:
        return {run: len(ids) for run, ids in self._by_run.items() if ids}

    def take(self, run_id: int, n: int) -> list[int]:
        ids = self._by_run.get(run_id, [])
        taken, self._by_run[run_id] = ids[:n], ids[n:]
        return taken

    def take_any(self, n: int) -> list[int]:
        taken: list[int] = []
        for run_id in list(self._by_run):
            taken += self.take(run_id, n - len(taken))
        return taken

    def ids(self) -> list[int]:
        return [i for ids in self._by_run.values() for i in ids]


class _Intake:
    """One message's claims, in the room the window holds for each share: what was taken
    (sent), skipped (taken or finished elsewhere), passed over (image items a server that
    reads no images leaves, items this server refused that wait for another's verdict) and
    refused (runs whose fingerprint differs from the server's, or whose largest request its
    limits do not admit)."""

    def __init__(self, rt: WorkerRuntime, requeue: Requeue) -> None:
        self.rt = rt
        self.requeue = requeue
        # a server that reads no images claims text items only; image items go back
        self.text_only = not rt.pins.reads_images()
        self.accepted: list[claims.ClaimedItem] = []
        self.refused: list[claims.ClaimedItem] = []
        self.skipped = 0
        self.passed = 0
        self.ahead = 0  # items claimed from the ledger ahead of the message's own
        self.elsewhere = 0  # items this server refused, sent back for another server

    def claim_first(self, units: list[list[int]], n: int) -> list[claims.ClaimedItem]:
        """Claim the first n units' items; the ones this server may run, for the window to
        send (n: the units of room the window holds)."""
        return self.claim_ids([i for unit in units[:n] for i in unit])

    def claim_ids(self, take: list[int]) -> list[claims.ClaimedItem]:
        """Claim these ids of the message; the ones this server may run, for the window."""
        rt, wait_s = self.rt, self.rt.settings.unavailable_wait_s
        with rt.db.begin() as conn:
            claimed = claims.claim_items(
                conn,
                take,
                owner=rt.owner,
                server=rt.server_name,
                lease_s=rt.settings.lease_s,
                text_only=self.text_only,
            )
            mine = {c.id for c in claimed}
            passed_over = (
                claims.claimable_image_items(conn, [i for i in take if i not in mine])
                if self.text_only
                else []
            )
            # items this server refused wait for another server's verdict
            elsewhere = claims.refused_here(
                conn, [i for i in take if i not in mine and i not in passed_over], rt.server_name
            )
        if passed_over:
            self.requeue(passed_over, wait_s)
            self.passed += len(passed_over)
        if elsewhere:
            self.requeue(elsewhere, wait_s)
            self.elsewhere += len(elsewhere)
        self.skipped += len(take) - len(claimed) - len(passed_over) - len(elsewhere)
        return self.checked(claimed)

    def claim_in_order(self, hand: _Hand, n: int) -> list[claims.ClaimedItem]:
        """Claim n units of room in this worker's claim order (workers/engine/scheduling.py):
        each run's share from the message's ids when the message holds them, else (or for
        what they lack) from the ledger; room the order leaves, from the message's ids."""
        rt = self.rt
        plan = rt.claim_order.plan(
            n, hand.counts(), priority_of=rt.run_priority, from_ledger=rt.claims_ahead
        )
        sent: list[claims.ClaimedItem] = []
        for run_id, k in plan:
            # the message's ids first; from the ledger what they lack or others took (never
            # in place of ids refused here: those went back, for another server)
            taken = hand.take(run_id, k)
            skipped = self.skipped
            got = self.claim_ids(taken) if taken else []
            short = k - len(taken) + self.skipped - skipped
            if short > 0 and rt.claims_ahead(run_id):
                got += self.claim_ahead(run_id, short)
            sent += got
        if len(sent) < n and hand:
            sent += self.claim_ids(hand.take_any(n - len(sent)))
        return sent

    def claim_ahead(self, run_id: int, n: int) -> list[claims.ClaimedItem]:
        """Claim up to n of the run's waiting items from the ledger (the claim order put the
        run ahead of the message's own); the ones this server may run."""
        rt = self.rt
        with rt.db.begin() as conn:
            claimed = claims.claim_next(
                conn,
                owner=rt.owner,
                server=rt.server_name,
                lease_s=rt.settings.lease_s,
                limit=n,
                run_id=run_id,
                text_only=self.text_only,
            )
        self.ahead += len(claimed)
        return self.checked(claimed)

    def checked(self, claimed: list[claims.ClaimedItem]) -> list[claims.ClaimedItem]:
        """The claimed items this server may run; the others are released and sent back."""
        rt, wait_s = self.rt, self.rt.settings.unavailable_wait_s
        refused = [c for c in claimed if not rt.pins.run_matches_server(c.run_id)]
        if refused:
            self.requeue(_release(rt, refused, "server fingerprint differs from the run's"), wait_s)
            self.refused += refused
        # image items of runs whose storage this worker does not reach (said once per run)
        unreached = [
            c for c in claimed if c not in refused and c.images and not rt.images.reaches(c.run_id)
        ]
        if unreached:
            self.requeue(_release(rt, unreached, "the run's storage is not reached here"), wait_s)
            self.refused += unreached
            refused = [*refused, *unreached]
        sent = [c for c in claimed if c not in refused]
        self.accepted += sent
        return sent


def _not_served(
    rt: WorkerRuntime, ids: list[int], keys: dict[int, tuple[int, str]], requeue: Requeue
) -> set[int]:
    """The ids of runs this worker does not serve, left unclaimed: a bound run's go back to
    the queue for the servers it is bound to; a run `tokenmill run` drives takes its items
    from the ledger itself, so a message of them is dropped (nothing of the ledger changes)."""
    foreign = [i for i in ids if i in keys and not rt.pins.serves_run(keys[i][0])]
    bound = [i for i in foreign if rt.pins.run_info(keys[i][0]).fleet_run]
    if bound:
        requeue(bound, rt.settings.unavailable_wait_s)
    if len(bound) < len(foreign):
        log.info(
            "message of %d items: %d of runs `tokenmill run` drives dropped",
            len(ids),
            len(foreign) - len(bound),
            extra={"action": "message_dropped"},
        )
    return set(foreign)


def handle_message(
    rt: WorkerRuntime, item_ids: Sequence[int], *, requeue: Requeue
) -> dict[str, int | str]:
    """Claim and submit item_ids; return counts and this worker's server for the task's
    result (Flower shows it)."""
    ids = [int(i) for i in item_ids]
    wait_s = rt.settings.unavailable_wait_s
    if not rt.server_state.takes_work():
        # this worker's consumer is cancelled at once (the enforcer): the messages go back at
        # once for the workers of servers that take work (a moment's countdown bounds the loop
        # should the cancel not have reached this consumer yet)
        requeue(ids, HELD_REQUEUE_S)
        return {"claimed": 0, "skipped": 0, "deferred": len(ids), "server": rt.server_name}
    if rt.window.unavailable() or rt.paused():
        requeue(ids, wait_s)
        return {"claimed": 0, "skipped": 0, "deferred": len(ids), "server": rt.server_name}
    # backpressure without hoarding: the window holds room (waiting a bounded time) BEFORE
    # anything is claimed, only what fits is claimed, a share at a time, and the rest goes
    # back to the queue unclaimed. Claimed items waiting for room would sit here while a
    # faster or idle server could run them.
    deadline = time.monotonic() + rt.settings.room_wait_s
    with rt.db.connect() as conn:
        keys = claims.item_keys(conn, ids)
    foreign = _not_served(rt, ids, keys, requeue)
    ids = [i for i in ids if i not in foreign]
    units, conversations = _units(rt, ids, keys)  # a conversation is one unit: one server
    intake = _Intake(rt, requeue)
    if conversations and _outranked(rt, ids, keys):
        # a run ahead of the message's conversations: its items take the room, and the
        # conversations go back whole (never split) for when their turn comes
        _admit_ahead(rt, intake, len(units), deadline)
        rest = ids
    elif conversations:
        rest = _admit_units(rt, intake, units, deadline)
    else:
        rest = _admit_in_order(rt, intake, _Hand(ids, keys), deadline)
        intake.skipped += len([i for i in ids if i not in keys])
    if rest:
        requeue(rest, wait_s if rt.window.unavailable() or rt.paused() else 0.0)
        log.debug("message of %d items: %d sent back unclaimed (no room)", len(ids), len(rest))
    _log_intake(rt, intake, len(ids))
    return _answer(rt, intake, ids, keys, deferred=len(rest) + len(foreign))


def _log_intake(rt: WorkerRuntime, intake: _Intake, message_items: int) -> None:
    if intake.skipped:
        log.info(
            "message of %d items: %d already taken or finished",
            message_items,
            intake.skipped,
            extra={"action": "message_skipped"},
        )
    if intake.passed:
        log.info(
            "message of %d items: %d image items sent back (%s reads no images)",
            message_items,
            intake.passed,
            rt.server_name,
            extra={"action": "images_sent_back"},
        )


def _answer(
    rt: WorkerRuntime,
    intake: _Intake,
    ids: list[int],
    keys: dict[int, tuple[int, str]],
    *,
    deferred: int,
) -> dict[str, int | str]:
    """The task's result (Flower shows it): what was claimed, skipped and left for others
    (deferred: the message's ids sent back unclaimed or not served here, beside intake's)."""
    first_run = next((keys[i][0] for i in ids if i in keys), None)
    answer: dict[str, int | str] = {
        "claimed": len(intake.accepted),
        "skipped": intake.skipped,
        "deferred": len(intake.refused) + intake.passed + intake.elsewhere + deferred,
        # of the claimed, the items of runs ahead in the claim order (the message's went back)
        "ahead": intake.ahead,
        "priority": 0 if first_run is None else rt.run_priority(first_run),
        "server": rt.server_name,
    }
    said = sorted({w for c in intake.refused if (w := rt.pins.why_refused(c.run_id)) is not None})
    if said:
        answer["not_serving"] = "; ".join(said)  # Flower shows why the items were left
    return answer


def _admit_units(
    rt: WorkerRuntime, intake: _Intake, units: list[list[int]], deadline: float
) -> list[int]:
    """Claim the message's conversations in message order as room comes (a conversation is
    one unit: one server); the ids left unclaimed."""
    while units:
        admitted = rt.window.admit(
            len(units),
            partial(intake.claim_first, units),
            timeout_s=max(0.0, deadline - time.monotonic()),
            conversations=True,
        )
        if not admitted.held:
            break
        units = units[admitted.held :]
    return [i for unit in units for i in unit]


def _outranked(rt: WorkerRuntime, ids: list[int], keys: dict[int, tuple[int, str]]) -> bool:
    """Whether every run of the message ranks below a run this worker may claim ahead."""
    ranks = [rt.run_priority(keys[i][0]) for i in ids if i in keys]
    return bool(ranks) and rt.claim_order.outranked(max(ranks), from_ledger=rt.claims_ahead)


def _admit_ahead(rt: WorkerRuntime, intake: _Intake, units: int, deadline: float) -> None:
    """The room of a message that goes back, for the runs ahead of it (one claim)."""
    rt.window.admit(
        units,
        partial(intake.claim_in_order, _Hand([], {})),
        timeout_s=max(0.0, deadline - time.monotonic()),
    )


def _admit_in_order(rt: WorkerRuntime, intake: _Intake, hand: _Hand, deadline: float) -> list[int]:
    """Claim as room comes, in the claim order: the room may go to other runs' items (the
    message's ids then go back); the ids left unclaimed. Ends when no room comes by the
    deadline or a claim finds nothing."""
    while hand:
        admitted = rt.window.admit(
            len(hand.ids()),
            partial(intake.claim_in_order, hand),
            timeout_s=max(0.0, deadline - time.monotonic()),
        )
        if not admitted.held or not admitted.items:
            break
    return hand.ids()

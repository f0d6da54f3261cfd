"""Records the in-flight window shares with its parts: its config and stats, the job of one
claimed item, what the checks of a result decide, what its gate admitted, and the interfaces
of the client a slot sends through, of a run kind's policy (what a slot sends and records),
and of the policy the window asks about its runs."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from app.core.contracts import GenerateResult
from app.core.errors import ServerRefusal
from app.ledger import claims, outcomes
from app.sglang.client import ProbeResult


class GenerateClient(Protocol):
    def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, object],
        rid: str,
        *,
        image_data: list[str] | None = None,
        priority: int | None = None,
    ) -> GenerateResult: ...

    def health(self, path: str = ...) -> ProbeResult: ...

    def abort(self, rid: str) -> bool: ...

    def close(self) -> None: ...


class KindPolicy(Protocol):
    """A run kind's part of the hot path (workers/engine/policies.py registers one per
    RunKind): the request a slot sends for an item and the outcome its result records."""

    def send(
        self,
        client: GenerateClient,
        item: claims.ClaimedItem,
        rid: str,
        images: list[str] | None,
        *,
        priority: int | None = None,
    ) -> GenerateResult: ...

    def outcome(
        self, item: claims.ClaimedItem, result: GenerateResult, checked: Checked, server: str
    ) -> outcomes.Done: ...


class RunPolicy(Protocol):
    """What a window asks about the runs it serves and tells about their items: a worker's
    WorkerRuntime answers (it knows the runs' pins, the pause flags and the server); tests
    use FakePolicy (workers/engine/fake_client.py)."""

    def new_client(self) -> GenerateClient:
        """A client of the window's server (each slot and the abort thread hold their own)."""
        ...

    def kind_policy(self, run_id: int) -> KindPolicy:
        """The policy of the run's kind, bound to the run (what its items send and record)."""
        ...

    def paused(self) -> bool:
        """Whether the server is paused (nothing is sent while it is)."""
        ...

    def group_of(self, run_id: int, item_key: str) -> Hashable | None:
        """The conversation of an item (its items go out one at a time), or None."""
        ...

    def check_result(self, item: claims.ClaimedItem, result: GenerateResult) -> Checked:
        """Whether a result may be written, and an image item's image token counts."""
        ...

    def image_data(self, item: claims.ClaimedItem) -> list[str]:
        """An image item's images as its request carries them; PermanentError if it cannot."""
        ...

    def refused_here(self, item: claims.ClaimedItem, error: ServerRefusal) -> Verdict:
        """What the server's refusal of item, for a reason that can depend on the server,
        means: final, or given back for another server's verdict."""
        ...

    def released(self, item_ids: list[int], wait_s: float) -> None:
        """Items given back to the queue, to be sent again after wait_s."""
        ...

    def finished(self, item_ids: list[int]) -> None:
        """Items whose results were just committed (a `--turns all` chain starts its next)."""
        ...

    def failed(self, run_id: int, item_id: int, error: str) -> None:
        """An item failed for good, as it is settled (the failure digest logs and counts it)."""
        ...

    def request_priority(self, run_id: int) -> int | None:
        """The priority the run's requests carry to the server (SGLang's own queue order),
        None when the server does not schedule by priority."""
        ...

    def find_hedges(self, limit: int) -> list[claims.ClaimedItem]:
        """Up to limit items running elsewhere for this window to hedge, marked as its
        hedges ([] when it does not hedge: it still aborts its copies finished elsewhere)."""
        ...

    def unmark_hedges(self, item_ids: list[int]) -> None:
        """Hedges marked but never sent (the window is stopping): others may take them."""
        ...


@dataclass(frozen=True)
class Verdict:
    """A refusal that can depend on the server, settled (workers.engine.confirming): final
    (the item fails, `why` after the server's error), or not (the item goes back, `why` as the
    reason; refused: the server is named as the item's refuser, and another server decides)."""

    final: bool
    why: str
    refused: bool = True


@dataclass(frozen=True)
class Admitted:
    """What the window's gate let in: the units of room it held for the claim, and the
    claimed items it sends in them (fewer when the claim found less)."""

    held: int
    items: list[claims.ClaimedItem]


@dataclass(frozen=True)
class Checked:
    """A result as its run's checks take it: refused, with why (other weights than the run's,
    token drift), or accepted, with an image item's counts (how many times the server
    repeated each image's placeholder)."""

    refusal: str | None = None
    image_token_counts: tuple[int, ...] | None = None


@dataclass
class WindowConfig:
    server_name: str
    inflight: int
    lease_s: float
    heartbeat_s: float
    max_attempts: int
    retry_backoff_s: float
    retry_backoff_max_s: float
    unavailable_wait_s: float
    backlog: int = 0  # extra claimed items waiting beyond the in-flight ones
    # > 0: the backlog holds at most this many seconds of the server's recent completions (at
    # least one item, at most `backlog`): enough to cover the claim round trip, and a slow
    # server does not sit on claimed items a faster one could run at the end of a run
    backlog_s: float = 0.0
    writer_batch: int = 256
    writer_linger_s: float = 0.005
    # > 0: every this many seconds, abort copies of items that finished elsewhere and (given a
    # hedge source) fill free slots with hedges
    hedge_interval_s: float = 0.0
    hedge: bool = True  # False: this window sends no hedges (it still aborts finished copies)
    # > 0: a slot that would idle takes the next item of a conversation whose last item has
    # been out this long (past its prefill: its prompt is cached); 0: only once it finished
    group_stagger_s: float = 0.0

    def capacity(self) -> int:
        return self.inflight + max(self.backlog, 1)


@dataclass
class WindowStats:
    sent: int = 0
    done: int = 0
    failed: int = 0
    retried: int = 0
    released: int = 0
    output_tokens: int = 0
    inflight: int = 0
    last_completion: float | None = None
    last_error: str | None = None
    hedges: int = 0  # second copies sent of items leased to other servers
    hedge_results: int = 0  # of those, answered (written only if no other result was first)
    cancelled: int = 0  # copies aborted: finished on another server, or a hedge making room
    pushed_back: int = 0  # requests the server refused as full (back-pressure): no attempt

    def note(self, *, failed: int = 0, error: str | None = None) -> None:
        self.failed += failed
        if error:
            self.last_error = error[:300]

    def count_done(self, tokens: int, *, at: float) -> None:
        self.done += 1
        self.output_tokens += tokens
        self.last_completion = at


@dataclass
class Job:
    item: claims.ClaimedItem
    policy: KindPolicy  # its run kind's: the request sent, the outcome recorded
    tries: int = 0  # attempts made under this lease
    abandoned: bool = False  # given back while its request was still out
    hedge: bool = False  # a second copy of an item leased to another server
    rid: str | None = None  # of the request in flight
    cancelled: bool = False  # not worth an answer any more (aborted on its server)
    sent_at: float = 0.0
    cancelled_at: float = 0.0
    group: Hashable | None = None  # its conversation (`--turns each`), sent one at a time
    pushed_back: int = 0  # refused as full in a row (back-pressure): its backoff grows
    priority: int | None = None  # sent as the request's priority (None: not sent)

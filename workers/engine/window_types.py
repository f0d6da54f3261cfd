"""Records and interfaces the in-flight window shares with its parts (slots, hedging): config,
stats, the job of one claimed item, the client a slot sends through, the window they work on."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy import Engine

from app.core.contracts import GenerateResult, SamplingParams
from app.ledger import ClaimedItem, Outcome
from app.sglang import ProbeResult
from workers.engine.groups import Conversations


class GenerateClient(Protocol):
    def generate(
        self, input_ids: list[int], sampling_params: dict[str, object], rid: str
    ) -> GenerateResult: ...

    def health(self, path: str = ...) -> ProbeResult: ...

    def abort(self, rid: str) -> bool: ...

    def close(self) -> None: ...


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


@dataclass(order=True)
class Delayed:
    due: float
    seq: int
    job: Job = field(compare=False)


@dataclass
class Job:
    item: ClaimedItem
    sampling: SamplingParams
    tries: int = 0  # attempts made under this lease
    abandoned: bool = False  # given back while its request was still out
    hedge: bool = False  # a second copy of an item leased to another server
    rid: str | None = None  # of the request in flight
    cancelled: bool = False  # not worth an answer any more (aborted on its server)
    sent_at: float = 0.0
    cancelled_at: float = 0.0
    group: Hashable | None = None  # its conversation (`--turns each`), sent one at a time


class OutcomeQueue(Protocol):
    """The window's result writer, as a slot hands it an outcome to commit."""

    def put(self, outcome: Outcome, settles: bool) -> None: ...


# the parts name the window by this protocol, not by importing it: the window imports them
class WindowHost(Protocol):
    """The InflightWindow state and steps that slots and hedging work on. Its counters,
    queues and jobs are shared with the window's other threads, guarded by _cond."""

    config: WindowConfig
    stats: WindowStats
    _cond: threading.Condition
    _stopping: threading.Event
    _db: Engine
    _clock: Callable[[], float]
    _client_factory: Callable[[], GenerateClient]
    _sampling_for_run: Callable[[int], SamplingParams]
    _is_paused: Callable[[], bool]
    # why a result must not be written (its weights are not the run's), or None
    _check_result: Callable[[ClaimedItem, GenerateResult], str | None]
    _backlog: queue.Queue[Job | object]
    _sending: dict[int, Job]
    _groups: Conversations[Job]
    _delayed: list[Delayed]
    _seq: itertools.count[int]
    _outstanding: int
    _unavailable_until: float

    @property
    def _writer(self) -> OutcomeQueue: ...

    def unavailable(self) -> bool: ...

    def unreserve(self, n: int) -> None: ...

    def _settle(self, outcome: Outcome, job: Job | None = None) -> None: ...

    def _ids(self, item: ClaimedItem) -> dict[str, object]: ...

    def _log_done(self, item: ClaimedItem, result: GenerateResult, how: str) -> None: ...

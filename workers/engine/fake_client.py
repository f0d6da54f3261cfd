"""FakeGenerateClient: the one in-process stand-in for an SGLang server's `/generate`, beside the
GenerateClient protocol it implements, for tests of the window and its parts (no HTTP, no
emulator process); and FakePolicy, the window's RunPolicy of fixed answers.

A `FakeServer` holds what the clients of one server share (each slot of a window makes its own
client): the script that decides how long each request takes or what it raises, whether the
server is up, and what it saw: calls per prompt, the rids sent and aborted, the peak
concurrency, and a log of when each request went out and came back. With `abortable`, an
abort ends a request in flight as SGLang does (HTTP 200, `finish_reason` abort, which the
client raises as a retryable error).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import PermanentError, RetryableError, ServerRefusal
from app.ledger import claims
from app.sglang.client import ProbeResult
from workers.engine.policies import GenerationPolicy
from workers.engine.window_types import Checked, GenerateClient, KindPolicy, Verdict

# (input_ids, the server's call number from 1) → seconds the request takes, or what it raises;
# a negative time runs until the request is aborted (30 s at most)
Answer = Callable[[list[int], int], float | Exception]
UNTIL_ABORTED = -1.0
KIMI_EOS = 163586
# ("sent" | "done", the prompt's first id, its image_data when sent, time.monotonic())
LogEntry = tuple[str, int, list[str] | None, float]


def _quick(input_ids: list[int], call: int) -> float:
    return 0.0


@dataclass
class FakeServer:
    """One fake SGLang server: its script and what its clients saw, under one lock."""

    answer: Answer = _quick
    eos: int = KIMI_EOS
    up: bool = True
    abortable: bool = False  # abort() ends the request in flight and says it did
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: int = 0
    in_flight: int = 0
    peak: int = 0
    calls_by_prompt: dict[int, int] = field(default_factory=dict)  # by the prompt's last id
    sent: dict[int, list[str]] = field(default_factory=dict)  # rids by the prompt's last id
    aborted: list[str] = field(default_factory=list)
    priorities: dict[str, int] = field(default_factory=dict)  # by rid, of requests that had one
    log: list[LogEntry] = field(default_factory=list)
    _ends: dict[str, threading.Event] = field(default_factory=dict)

    def client(self) -> FakeGenerateClient:
        return FakeGenerateClient(self)

    def output(self, input_ids: list[int]) -> list[int]:
        """The tokens a request generates: one that names its prompt, then EOS."""
        return [input_ids[-1] % 1000 + 300, self.eos]

    def end_of(self, rid: str) -> threading.Event:
        """Set when the request `rid` is aborted."""
        with self.lock:
            return self._ends.setdefault(rid, threading.Event())

    def abort(self, rid: str) -> bool:
        """SGLang's `/abort_request`: True when it ended a request (abortable servers only)."""
        if not self.abortable:
            return False
        with self.lock:
            self.aborted.append(rid)
        self.end_of(rid).set()
        return True


class FakeGenerateClient:
    """A GenerateClient that asks its FakeServer's script for every request."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server

    def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, object],
        rid: str,
        *,
        image_data: list[str] | None = None,
        priority: int | None = None,
    ) -> GenerateResult:
        server = self.server
        with server.lock:
            if priority is not None:
                server.priorities[rid] = priority
            server.calls += 1
            call = server.calls
            server.in_flight += 1
            server.peak = max(server.peak, server.in_flight)
            key = input_ids[-1]
            server.calls_by_prompt[key] = server.calls_by_prompt.get(key, 0) + 1
            server.sent.setdefault(key, []).append(rid)
            server.log.append(("sent", input_ids[0], image_data, time.monotonic()))
        try:
            outcome = server.answer(input_ids, call)
            if isinstance(outcome, Exception):
                raise outcome
            if server.end_of(rid).wait(30.0 if outcome < 0 else outcome):
                raise RetryableError("request aborted")  # SGLang: HTTP 200, finish_reason abort
            out = server.output(input_ids)
            with server.lock:
                server.log.append(("done", input_ids[0], None, time.monotonic()))
            return GenerateResult(
                rid, out, "stop", server.eos, len(input_ids), len(out), 0, max(outcome, 0.0)
            )
        finally:
            with server.lock:
                server.in_flight -= 1

    def health(self, path: str = "/health") -> ProbeResult:
        up = self.server.up
        return ProbeResult(ok=up, status_code=200 if up else None, latency_s=0.0)

    def abort(self, rid: str) -> bool:
        return self.server.abort(rid)

    def close(self) -> None:
        pass


def _no_images(item: claims.ClaimedItem) -> list[str]:
    raise PermanentError("this worker sends no images")


@dataclass
class FakePolicy:
    """A RunPolicy of fixed answers, each replaceable: clients of `server` (or of `clients`),
    every run sampled with `sampling`, nothing paused, no conversations, every result
    accepted, no images sent, every refusal final, no hedges found; released and finished
    items dropped."""

    server: FakeServer = field(default_factory=FakeServer)
    clients: Callable[[], GenerateClient] | None = None
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(seed=1))
    is_paused: Callable[[], bool] = lambda: False
    conversation_of: Callable[[int, str], Hashable | None] = lambda run_id, key: None
    checks: Callable[[claims.ClaimedItem, GenerateResult], Checked] = lambda item, result: Checked()
    images: Callable[[claims.ClaimedItem], list[str]] = _no_images
    # every refusal that can depend on the server is final (no other server confirms it)
    verdicts: Callable[[claims.ClaimedItem, ServerRefusal], Verdict] = lambda item, error: Verdict(
        True, ""
    )
    on_released: Callable[[list[int], float], None] = lambda ids, wait_s: None
    on_finished: Callable[[list[int]], None] = lambda ids: None
    on_failed: Callable[[int, int, str], None] = lambda run_id, item_id, error: None
    hedges: Callable[[int], list[claims.ClaimedItem]] = lambda limit: []
    unmark: Callable[[list[int]], None] = lambda ids: None
    priority_of: Callable[[int], int | None] = lambda run_id: None

    def new_client(self) -> GenerateClient:
        return (self.clients or self.server.client)()

    def kind_policy(self, run_id: int) -> KindPolicy:
        return GenerationPolicy(self.sampling)

    def request_priority(self, run_id: int) -> int | None:
        return self.priority_of(run_id)

    def paused(self) -> bool:
        return self.is_paused()

    def group_of(self, run_id: int, item_key: str) -> Hashable | None:
        return self.conversation_of(run_id, item_key)

    def check_result(self, item: claims.ClaimedItem, result: GenerateResult) -> Checked:
        return self.checks(item, result)

    def image_data(self, item: claims.ClaimedItem) -> list[str]:
        return self.images(item)

    def refused_here(self, item: claims.ClaimedItem, error: ServerRefusal) -> Verdict:
        return self.verdicts(item, error)

    def released(self, item_ids: list[int], wait_s: float) -> None:
        self.on_released(item_ids, wait_s)

    def finished(self, item_ids: list[int]) -> None:
        self.on_finished(item_ids)

    def failed(self, run_id: int, item_id: int, error: str) -> None:
        self.on_failed(run_id, item_id, error)

    def find_hedges(self, limit: int) -> list[claims.ClaimedItem]:
        return self.hedges(limit)

    def unmark_hedges(self, item_ids: list[int]) -> None:
        self.unmark(item_ids)

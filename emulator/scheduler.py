"""Continuous batching of the SGLang emulator: slots, a waiting queue and one token per step.

Each step every running request gains a token; waiting requests take free slots and pay prefill.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from emulator.config import EmulatorConfig
from emulator.model import FinishReason, generate_output
from emulator.prefix_cache import RadixCache
from emulator.protocol import ItemRequest, running_abort, waiting_abort
from emulator.tool_calls import ToolCallWriter
from emulator.weights import VersionEvent, version_spans

logger = logging.getLogger(__name__)

# A late event loop may catch up on missed steps, but never by more than this: a long stall
# should not turn into a burst of instant steps.
MAX_CATCH_UP_S = 0.05
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


@dataclass
class Counters:
    """What /emulator/stats reports; benchmarks compute utilization from it."""

    requests: int = 0
    completed: int = 0
    aborted: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    busy_steps: int = 0
    busy_time_s: float = 0.0
    vision_tokens: int = 0
    rejected_queue_full: int = 0
    rejected_invalid: int = 0
    injected_errors: int = 0
    injected_drops: int = 0
    health_checks: int = 0  # /health and /health_generate requests
    unauthorized: int = 0  # requests refused for a missing or other API key (401)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(eq=False, slots=True)
class Job:
    """One request inside the scheduler: its planned output, and how much of it exists yet."""

    item: ItemRequest
    planned_ids: list[int]
    planned_finish: FinishReason
    arrival_s: float
    done: asyncio.Future[None]
    watcher: asyncio.Event | None = None
    produced: int = 0
    cached_tokens: int = 0
    started: bool = False
    abort_requested: bool = False
    finish_reason: FinishReason | None = None
    finished_s: float | None = None
    # weight-version changes while it had output, and the version it finished under
    version_events: list[VersionEvent] = field(default_factory=list)
    final_version: str | None = None

    @property
    def weight_versions(self) -> list[dict[str, Any]]:
        """The spans of its output per weight version (once finished)."""
        return version_spans(self.version_events, self.final_version or "", self.produced)

    @property
    def output_ids(self) -> list[int]:
        return self.planned_ids[: self.produced]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def e2e_latency_s(self) -> float:
        end = self.finished_s if self.finished_s is not None else time.perf_counter()
        return end - self.arrival_s


def uncached_image_tokens(spans: tuple[tuple[int, int], ...], cached_tokens: int) -> int:
    """The image tokens of spans at or past position cached_tokens (the encoder's work)."""
    return sum(max(0, start + count - max(start, cached_tokens)) for start, count in spans)


def kv_tokens(job: Job) -> int:
    """The KV tokens a request takes at most: its prompt and its whole (planned) output."""
    return len(job.item.key_ids) + len(job.planned_ids)


def new_job(
    item: ItemRequest,
    cfg: EmulatorConfig,
    arrival_s: float,
    weight_version: str | None = None,
    tool_calls: ToolCallWriter | None = None,
) -> Job:
    output_ids, finish = generate_output(
        item.key_ids,
        item.sampling,
        cfg,
        sample_index=item.sample_index,
        weight_version=weight_version,
        tool_calls=tool_calls,
    )
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    return Job(item, output_ids, finish, arrival_s, done)


@dataclass
class _Gate:
    """Why the scheduler does not step: a pause (lifted by continue) or a hang (forever)."""

    paused: bool = False
    hung: bool = False
    waiters: list[asyncio.Future[None]] = field(default_factory=list)

    @property
    def frozen(self) -> bool:
        return self.paused or self.hung


class Scheduler:
    """SGLang-like continuous batching over `max_running` slots, one token per `step_ms` step."""

    def __init__(self, cfg: EmulatorConfig, counters: Counters | None = None) -> None:
        self.cfg = cfg
        self.counters = counters or Counters()
        self.cache = RadixCache(cfg.cache_tokens)
        self._prefilling: list[Job] = []  # admitted; their prompts enter the cache after the step
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._by_rid: dict[str, Job] = {}
        # KV tokens the running jobs reserved when admitted (their prompt and planned output)
        self._kv_reserved = 0
        self._gate = _Gate()
        # the weights' version now (moved by weight updates); jobs plan their output under it
        self.weight_version = cfg.weight_version
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None and not self.cfg.immediate:
            self._task = asyncio.create_task(self._run(), name="emulator-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # --- state --------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    @property
    def hung(self) -> bool:
        return self._gate.hung

    @property
    def paused(self) -> bool:
        return self._gate.paused

    def hang(self) -> None:
        """Freeze for good: no step ever completes again (the hung-scheduler fault)."""
        if not self._gate.hung:
            logger.warning(
                "scheduler hung (fault injected): %d running, %d waiting",
                self.running,
                self.waiting,
            )
        self._gate.hung = True

    def pause(self, mode: str) -> None:
        """SGLang's pause_generation: "abort" aborts everything; other modes freeze in place."""
        if mode == "abort":
            self.abort_all()
        else:
            self._gate.paused = True

    def resume(self) -> None:
        self._gate.paused = False
        self._wakeup.set()

    def change_version(self, new_version: str) -> int:
        """A new weight version: requests with output so far record where it changed
        (record_weight_version_change); returns how many did."""
        if new_version == self.weight_version:
            return 0
        recorded = 0
        for job in [*self._running, *self._waiting]:
            if job.produced:
                job.version_events.append(VersionEvent(self.weight_version, job.produced))
                recorded += 1
        self.weight_version = new_version
        return recorded

    # --- requests -----------------------------------------------------------------------

    def submit(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._enter_waiting(job)
            self._by_rid[job.item.rid] = job
            if not job.item.internal:
                self.counters.requests += 1
        limit = self.cfg.hang_after_requests
        if limit is not None and self.counters.requests >= limit:
            self.hang()
        self._wakeup.set()

    def _rank(self, job: Job) -> int:
        """A waiting job's place by priority (higher ranks go first)."""
        priority = job.item.priority or 0
        return -priority if self.cfg.schedule_low_priority_values_first else priority

    def _enter_waiting(self, job: Job) -> None:
        """Queue job: at the end, or with priority scheduling behind every waiting job of its
        rank or above (first come, first served within one priority)."""
        if not self.cfg.enable_priority_scheduling:
            self._waiting.append(job)
            return
        rank = self._rank(job)
        at = len(self._waiting)
        while at > 0 and self._rank(self._waiting[at - 1]) < rank:
            at -= 1
        self._waiting.insert(at, job)

    def abort(self, rid: str) -> None:
        """Abort by rid as SGLang does: the rid must be live, then every rid it prefixes goes."""
        if rid and rid in self._by_rid:
            self._abort_where(lambda job: job.item.rid.startswith(rid))

    def abort_all(self) -> None:
        self._abort_where(lambda job: True)

    def _abort_where(self, matches: Callable[[Job], bool]) -> None:
        now = time.perf_counter()
        kept: deque[Job] = deque()
        for job in self._waiting:
            if matches(job):
                self._finish(job, waiting_abort(), now)
            else:
                kept.append(job)
        self._waiting = kept
        for job in self._running:
            if matches(job):
                # SGLang lets an aborted running request take one more decode step
                job.abort_requested = True
        self._wakeup.set()

    async def probe(self, timeout_s: float) -> bool:
        """True when the scheduler makes progress within the timeout (the /health_generate test)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._gate.waiters.append(waiter)
        if self.idle:
            item = ItemRequest(
                rid=f"{HEALTH_CHECK_RID_PREFIX}_{time.monotonic_ns()}",
                input_ids=[0],
                sampling={"max_new_tokens": 1, "temperature": 0.0},
                internal=True,
            )
            self.submit([new_job(item, self.cfg, time.perf_counter(), self.weight_version)])
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            return False
        finally:
            if waiter in self._gate.waiters:
                self._gate.waiters.remove(waiter)
        return True

    def flush_cache(self) -> bool:
        """SGLang refuses to flush while anything runs or waits."""
        if not self.idle:
            return False
        self.cache.clear()
        return True

    # --- the step loop ------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        step_s = self.cfg.step_ms / 1000.0
        prefill_s_per_token = self.cfg.prefill_ms_per_1k_tokens / 1e6
        vision_s_per_token = self.cfg.vision_ms_per_1k_tokens / 1e6
        deadline = loop.time()
        while True:
            if self._gate.frozen or self.idle:
                self._wakeup.clear()
                await self._wakeup.wait()
                deadline = loop.time()
                continue
            prefill_tokens, vision_tokens = self._admit()
            duration_s = (
                step_s + prefill_tokens * prefill_s_per_token + vision_tokens * vision_s_per_token
            )
            now = loop.time()
            deadline = max(deadline + duration_s, now - MAX_CATCH_UP_S)
            await asyncio.sleep(deadline - now)
            if self._gate.frozen:
                continue  # frozen mid-step: that step's tokens never come
            self._advance()
            self.counters.busy_time_s += duration_s

    def _admit(self) -> tuple[int, int]:
        """Move waiting jobs into free slots; returns the prompt tokens to prefill and the
        image tokens the vision encoder computes (those past the cached prefix)."""
        prefill_tokens = vision_tokens = 0
        while self._waiting and len(self._running) < self.cfg.max_running:
            if not self._kv_fits(self._waiting[0]):
                break  # the KV pool binds first: the head waits (first come, first served)
            job = self._waiting.popleft()
            self._kv_reserved += kv_tokens(job)
            ids = job.item.key_ids
            # requests admitted in the same step prefill together: none sees the others' prompts
            job.cached_tokens = self.cache.match(ids)
            self._prefilling.append(job)
            job.started = True
            prefill_tokens += len(ids) - job.cached_tokens
            vision_tokens += uncached_image_tokens(job.item.image_spans, job.cached_tokens)
            self._running.append(job)
            if not job.item.internal:
                self.counters.cached_tokens += job.cached_tokens
        self.counters.prefill_tokens += prefill_tokens
        self.counters.vision_tokens += vision_tokens
        return prefill_tokens, vision_tokens

    def _advance(self) -> None:
        now = time.perf_counter()
        for job in self._prefilling:  # prefill done: the prompt is cached (cache_unfinished_req)
            self.cache.insert(job.item.key_ids)
        self._prefilling.clear()
        still_running: list[Job] = []
        produced = 0
        for job in self._running:
            if job.produced < len(job.planned_ids):
                job.produced += 1
                produced += 1
            if job.abort_requested:
                self._finish(job, running_abort(), now)
            elif job.produced >= len(job.planned_ids):
                self._finish(job, job.planned_finish, now)
            else:
                still_running.append(job)
                if job.watcher is not None:
                    job.watcher.set()
        self._running = still_running
        self.counters.generated_tokens += produced
        self.counters.busy_steps += 1
        waiters, self._gate.waiters = self._gate.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _kv_fits(self, job: Job) -> bool:
        """Whether job's prompt and output fit in the KV pool beside the running batch (a
        request alone always runs: one larger than the pool is the context check's)."""
        limit = self.cfg.max_total_tokens
        return limit is None or not self._running or self._kv_reserved + kv_tokens(job) <= limit

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens of the requests waiting to be admitted."""
        return sum(len(j.item.key_ids) for j in self._waiting)

    @property
    def kv_used(self) -> int:
        """KV tokens the running batch holds now (its prompts and output so far)."""
        return sum(len(j.item.key_ids) + j.produced for j in self._running)

    def _finish(self, job: Job, reason: FinishReason, now: float) -> None:
        if job.started and job.finish_reason is None:  # it leaves the running batch
            self._kv_reserved -= kv_tokens(job)
        job.finish_reason = reason
        job.final_version = self.weight_version
        job.finished_s = now
        if self._by_rid.get(job.item.rid) is job:
            del self._by_rid[job.item.rid]
        if job.started and job not in self._prefilling:
            # cache_finished_req: the prompt and every output token but the last
            self.cache.insert(job.item.key_ids + job.output_ids[:-1])
        if not job.item.internal:
            if reason.get("type") == "abort":
                self.counters.aborted += 1
            else:
                self.counters.completed += 1
        if not job.done.done():
            job.done.set_result(None)
        if job.watcher is not None:
            job.watcher.set()

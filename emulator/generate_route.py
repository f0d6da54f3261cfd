"""The emulator's `/generate` (a mixin of EmulatorServer): parsing, injected faults, queue
limits, whole answers and SSE streams; and the phases and JSON replies every route shares."""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import random
import time
from typing import Any

from aiohttp import web

from app.sglang.rules import QUEUE_FULL, InvalidRequest
from app.sglang.schema import SchemaViolation
from emulator.config import EmulatorConfig
from emulator.image_data import ImageInputError, ImageServerError
from emulator.image_prompt import ImageProcessor
from emulator.model import generate_output, generation_seed
from emulator.protocol import (
    GenerateCall,
    ItemRequest,
    dumps,
    error_object,
    generate_response,
    parse_generate,
    waiting_abort_response,
)
from emulator.scheduler import Counters, Job, Scheduler, new_job
from emulator.speculative import RequestLog, draw_steps, expected_step_tokens, meta_fields
from emulator.tool_calls import ToolCallWriter
from emulator.weights import Weights, version_spans

logger = logging.getLogger(__name__)


def log_prompts(path: str | None, call: GenerateCall, weight_version: str) -> None:
    """One JSON line per prompt of the call in the prompt log (when there is one): the rid,
    the ids and sampling_params exactly as received, and the weights they run under."""
    if path is None:
        return
    lines = [
        json.dumps(
            {
                "rid": item.rid,
                "input_ids": item.input_ids if item.sent_ids is None else item.sent_ids,
                "sampling_params": dict(item.sampling),
                "weight_version": weight_version,
            },
            separators=(",", ":"),
        )
        for item in call.items
    ]
    with open(path, "a", encoding="utf-8") as log:
        log.write("\n".join(lines) + "\n")


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


def json_reply(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(value), status=status, content_type="application/json")


def empty_reply(status: int) -> web.Response:
    return web.Response(status=status)


class GenerateRoute:
    """SGLang's `/generate` route, on the state EmulatorServer sets up (declared here for it)."""

    cfg: EmulatorConfig
    counters: Counters
    scheduler: Scheduler
    phase: Phase
    _faults: random.Random
    _resumed: asyncio.Event
    _inflight: int
    request_log: RequestLog
    weights: Weights
    # a multimodal server's image processor (None: text-only, image_data ignored)
    images: ImageProcessor | None
    tool_calls: ToolCallWriter | None

    # here because /generate is where a hung scheduler shows first; the server's routes use it too
    @property
    def hung(self) -> bool:
        return self.scheduler.hung

    # --- /generate ----------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrival_s = time.perf_counter()
        # SGLang serves /generate while it drains (SIGTERM); only its health routes say 503
        if self.phase is Phase.LOADING:
            return empty_reply(503)
        self._inflight += 1
        try:
            return await self._generate(request, arrival_s)
        finally:
            self._inflight -= 1

    async def _parse(self, raw: bytes) -> GenerateCall:
        body = json.loads(raw)
        if self.images is not None and isinstance(body, dict) and body.get("image_data"):
            # reading and decoding images runs off the event loop, as SGLang's loaders do
            images, cfg = self.images, self.cfg
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, lambda: parse_generate(body, cfg, images))
        return parse_generate(body, self.cfg, self.images)

    async def _generate(self, request: web.Request, arrival_s: float) -> web.StreamResponse:
        try:
            call = await self._parse(await request.read())
        except SchemaViolation as exc:
            self.counters.rejected_invalid += 1
            return json_reply({"error": str(exc)}, 400)
        except (InvalidRequest, ImageInputError) as exc:
            self.counters.rejected_invalid += 1
            return json_reply({"error": {"message": str(exc)}}, 400)
        except ImageServerError as exc:
            self.counters.rejected_invalid += 1
            return web.Response(status=500, text=str(exc))
        except ValueError as exc:  # not JSON at all
            self.counters.rejected_invalid += 1
            body = error_object(f"JSON decode error: {exc}", 400) | {"type": "Bad Request"}
            return json_reply(body, 400)

        fault = self._draw_fault()
        if fault == "error":
            self.counters.injected_errors += 1
            logger.debug("fault injected: 500 for %s", call.items[0].rid)
            return web.Response(status=500, text="Internal Server Error")
        if fault == "drop":
            self.counters.injected_drops += 1
            logger.debug("fault injected: connection dropped for %s", call.items[0].rid)
            if request.transport is not None:
                request.transport.close()
            raise asyncio.CancelledError

        await self._resumed.wait()
        # held from here to the last answer: a weight update waits for it, and new requests
        # wait for a pending update (SGLang's model_update_lock)
        async with self.weights.lock.reader():
            return await self._run_call(request, call, arrival_s)

    async def _run_call(
        self, request: web.Request, call: GenerateCall, arrival_s: float
    ) -> web.StreamResponse:
        if self.phase is Phase.LOADING:
            return empty_reply(503)
        if self.hung:
            await asyncio.get_running_loop().create_future()  # never answers
        log_prompts(self.cfg.prompt_log, call, self.weights.weight_version)
        if self.cfg.immediate:
            return self._answer_now(call, arrival_s)
        version = self.weights.weight_version
        writer = self.tool_calls
        jobs = [new_job(item, self.cfg, arrival_s, version, writer) for item in call.items]
        max_queued = self.cfg.max_queued
        if max_queued is not None and self.scheduler.waiting + len(jobs) > max_queued:
            self.counters.rejected_queue_full += 1
            return await self._queue_full(request, call, jobs)
        if call.stream:
            return await self._stream(request, call, jobs)
        self.scheduler.submit(jobs)
        try:
            await asyncio.gather(*(job.done for job in jobs))
        except asyncio.CancelledError:
            self._abort_unfinished(jobs)  # the client went away, as SGLang does
            raise
        answers = [self._final(job) for job in jobs]
        return json_reply(answers[0] if call.is_single else answers)

    def _draw_fault(self) -> str | None:
        if not (self.cfg.error_rate or self.cfg.drop_rate):
            return None
        draw = self._faults.random()
        if draw < self.cfg.error_rate:
            return "error"
        if draw < self.cfg.error_rate + self.cfg.drop_rate:
            return "drop"
        return None

    def _answer_now(self, call: GenerateCall, arrival_s: float) -> web.Response:
        """step_ms 0: the whole output at once, without the scheduler (overhead benchmarks)."""
        answers = []
        cache = self.scheduler.cache
        version = self.weights.weight_version
        for item in call.items:
            output_ids, finish = generate_output(
                item.key_ids,
                item.sampling,
                self.cfg,
                sample_index=item.sample_index,
                weight_version=version,
                tool_calls=self.tool_calls,
            )
            cached = cache.match(item.key_ids)
            cache.insert(item.key_ids)
            self.counters.requests += 1
            self.counters.completed += 1
            self.counters.generated_tokens += len(output_ids)
            self.counters.cached_tokens += cached
            latency_s = time.perf_counter() - arrival_s
            answers.append(
                generate_response(
                    item,
                    output_ids,
                    finish,
                    self.cfg,
                    cached_tokens=cached,
                    e2e_latency_s=latency_s,
                    spec_meta=self._finished(item, output_ids, finish, arrival_s),
                    weight_version=version,
                    weight_versions=version_spans([], version, len(output_ids)),
                )
            )
        if call.stream:
            return self._stream_now(call, answers)
        return json_reply(answers[0] if call.is_single else answers)

    def _stream_now(self, call: GenerateCall, answers: list[dict[str, Any]]) -> web.Response:
        chunks = []
        for index, answer in enumerate(answers):
            if not call.is_single:
                answer["index"] = index
            chunks.append(b"data: " + dumps(answer) + b"\n\n")
        chunks.append(b"data: [DONE]\n\n")
        return web.Response(body=b"".join(chunks), content_type="text/event-stream")

    def _final(self, job: Job) -> dict[str, Any]:
        if not job.started:  # aborted while it waited
            return waiting_abort_response(
                job.item, self.cfg, job.e2e_latency_s, weight_version=job.final_version
            )
        return generate_response(
            job.item,
            job.output_ids,
            job.finish_reason,
            self.cfg,
            cached_tokens=job.cached_tokens,
            e2e_latency_s=job.e2e_latency_s,
            spec_meta=self._finished(job.item, job.output_ids, job.finish_reason, job.arrival_s),
            weight_version=job.final_version,
            weight_versions=job.weight_versions,
        )

    def _finished(
        self,
        item: ItemRequest,
        output_ids: list[int],
        finish: dict[str, Any] | None,
        arrival_s: float,
    ) -> dict[str, Any]:
        """A finished request's speculative fields (none when speculation is off or it was
        aborted), and its line in the request log: what the server saw and generated, and when
        the request arrived (epoch seconds, from its perf_counter arrival_s)."""
        spec = self.cfg.speculative
        if finish is None or finish.get("type") == "abort":
            return {}
        fields: dict[str, Any] = {}
        record: dict[str, Any] = {
            "rid": item.rid,
            "received_at": time.time() - (time.perf_counter() - arrival_s),
            "input_ids": item.input_ids if item.sent_ids is None else item.sent_ids,
            "output_ids": output_ids,
            "prompt_tokens": len(item.input_ids),
            "completion_tokens": len(output_ids),
            "finish_reason": finish.get("type"),
        }
        if spec is not None:
            seed = generation_seed(item.key_ids, item.sampling, item.sample_index)
            draw = draw_steps(item.input_ids, len(output_ids), spec, seed=seed)
            fields = meta_fields(draw, len(output_ids), spec)
            record |= {
                "draft_model_path": spec.draft_model_path,
                "accept_probability": draw.probability,
                "expected_step_tokens": expected_step_tokens(draw.probability, spec.num_steps),
                **fields,
            }
        self.request_log.write(record)
        return fields

    def _abort_unfinished(self, jobs: list[Job]) -> None:
        for job in jobs:
            if not job.finished:
                self.scheduler.abort(job.item.rid)

    async def _queue_full(
        self, request: web.Request, call: GenerateCall, jobs: list[Job]
    ) -> web.StreamResponse:
        if not call.stream:
            return json_reply(error_object(QUEUE_FULL, 503), 503)
        # a stream has already "started": SGLang sends the abort as an event inside a 200
        finish = {"type": "abort", "status_code": 503, "message": QUEUE_FULL}
        response = await self._open_stream(request)
        for index, job in enumerate(jobs):
            event = waiting_abort_response(
                job.item, self.cfg, job.e2e_latency_s, finish, self.weights.weight_version
            )
            if not call.is_single:
                event["index"] = index
            await response.write(b"data: " + dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        return response

    async def _stream(
        self, request: web.Request, call: GenerateCall, jobs: list[Job]
    ) -> web.StreamResponse:
        """SSE events with cumulative output_ids, one per step per request, then [DONE]."""
        response = await self._open_stream(request)
        watcher = asyncio.Event()
        for job in jobs:
            job.watcher = watcher
        self.scheduler.submit(jobs)
        sent = [0] * len(jobs)
        pending = list(range(len(jobs)))
        try:
            while pending:
                await watcher.wait()
                watcher.clear()
                for index in tuple(pending):
                    job = jobs[index]
                    if job.finished:
                        event = self._final(job)
                        pending.remove(index)
                    elif job.produced > sent[index]:
                        event = generate_response(
                            job.item,
                            job.output_ids,
                            None,
                            self.cfg,
                            cached_tokens=job.cached_tokens,
                            weight_version=self.weights.weight_version,
                        )
                    else:
                        continue
                    sent[index] = job.produced
                    if not call.is_single:
                        event["index"] = index
                    await response.write(b"data: " + dumps(event) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            self._abort_unfinished(jobs)
            raise
        return response

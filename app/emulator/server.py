"""The emulator's HTTP server: SGLang's native routes on aiohttp, startup phases, faults, shutdown.

`serve(cfg)` runs one emulated server until SIGINT/SIGTERM; `EmulatorServer` runs it in-process.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import json
import logging
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from app.core.errors import TokenizerError
from app.emulator.config import EmulatorConfig
from app.emulator.info import model_info, models_list, server_info, stats_json
from app.emulator.model import generate_output
from app.emulator.protocol import (
    QUEUE_FULL,
    GenerateCall,
    InvalidRequest,
    dumps,
    error_object,
    generate_response,
    parse_generate,
    waiting_abort_response,
)
from app.emulator.scheduler import Counters, Job, Scheduler, new_job
from app.emulator.schema import SchemaViolation
from app.emulator.tokenize import TokenizeAnswer, answer_raw
from app.prompts.tokenization import ChatTokenizer, load_tokenizer

logger = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

READY_LOG_LINE = "The server is fired up and ready to roll!"
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_FAILED = "Flush cache failed.\n"
PAUSE_MODES = ("abort", "retract", "in_place")
DRAIN_POLL_S = 0.01


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(value), status=status, content_type="application/json")


def _empty(status: int) -> web.Response:
    return web.Response(status=status)


class EmulatorServer:
    """One emulated SGLang server: routes, phases (loading → ready → draining) and faults."""

    def __init__(self, cfg: EmulatorConfig) -> None:
        self.cfg = cfg
        self.counters = Counters()
        self.scheduler = Scheduler(cfg, self.counters)
        self.phase = Phase.LOADING
        self.port: int | None = None
        self.unhealthy = False
        self.startup_time = time.time()
        self._faults = random.Random(cfg.fault_seed)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._inflight = 0
        self._bound_at = 0.0
        self._runner: web.AppRunner | None = None
        self._lifecycle: asyncio.Task[None] | None = None
        self.tokenizer: ChatTokenizer | None = None

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    @property
    def hung(self) -> bool:
        return self.scheduler.hung

    def build_app(self) -> web.Application:
        middlewares = [self.require_api_key] if self.cfg.api_key else []
        app = web.Application(client_max_size=256 * 1024**2, middlewares=middlewares)
        add = app.router.add_route
        add("POST", "/generate", self.generate)
        add("PUT", "/generate", self.generate)
        add("GET", "/health", self.health)
        add("GET", "/health_generate", self.health_generate)
        add("GET", "/ready", self.ready)
        for path in ("/model_info", "/get_model_info"):
            add("GET", path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            add("GET", path, self.server_info)
        add("GET", "/v1/models", self.models)
        for path in ("/v1/tokenize", "/tokenize"):
            add("POST", path, self.tokenize)
        for path in ("/v1/detokenize", "/detokenize"):
            add("POST", path, self.detokenize)
        add("POST", "/abort_request", self.abort_request)
        add("GET", "/flush_cache", self.flush_cache)
        add("POST", "/flush_cache", self.flush_cache)
        add("POST", "/pause_generation", self.pause_generation)
        add("POST", "/continue_generation", self.continue_generation)
        add("GET", "/emulator/stats", self.stats)
        return app

    @web.middleware
    async def require_api_key(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """SGLang's --api-key check: health probes, /metrics and OPTIONS pass without it."""
        path = request.path
        if request.method == "OPTIONS" or path.startswith(("/health", "/metrics")):
            return await handler(request)
        expected = f"Bearer {self.cfg.api_key}".encode()
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def start(self) -> None:
        """Bind the port (the weights are "loaded"), then warm up for loading_s, then serve."""
        if self.cfg.tokenizer is not None and self.tokenizer is None:
            folder, remote = self.cfg.tokenizer, self.cfg.trust_remote_code
            self.tokenizer = await asyncio.get_running_loop().run_in_executor(
                None, lambda: load_tokenizer(folder, trust_remote_code=remote)
            )
        self.scheduler.start()
        runner = web.AppRunner(
            self.build_app(), access_log=None, handle_signals=False, handler_cancellation=True
        )
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.host, self.cfg.port, backlog=4096)
        await site.start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        self._bound_at = time.monotonic()
        print(f"listening on {self.base_url}", flush=True)
        logger.info(
            "emulator listening on %s (model %s, step %.1f ms, %d slots)",
            self.base_url,
            self.cfg.model_path,
            self.cfg.step_ms,
            self.cfg.max_running,
        )
        if self.cfg.loading_s == 0:
            self._mark_ready()  # ready when start() returns: in-process users may call at once
        self._lifecycle = asyncio.create_task(self._warm_up(), name="emulator-lifecycle")

    def _mark_ready(self) -> None:
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY
            logger.info(READY_LOG_LINE)

    async def _warm_up(self) -> None:
        if self.cfg.loading_s > 0:
            logger.info("warming up for %.1f s: health routes answer 503", self.cfg.loading_s)
            await asyncio.sleep(self.cfg.loading_s)
            self._mark_ready()
        if self.cfg.hang_after_s is not None:
            await asyncio.sleep(self.cfg.hang_after_s)
            self.scheduler.hang()

    def begin_drain(self) -> None:
        """SIGTERM: health turns 503 and new requests are refused; in-flight ones finish."""
        if self.phase is not Phase.DRAINING:
            logger.info(
                "draining: %d running, %d waiting, %d in flight",
                self.scheduler.running,
                self.scheduler.waiting,
                self._inflight,
            )
        self.phase = Phase.DRAINING

    async def drain(self, force: asyncio.Event | None = None) -> None:
        """Wait until every request in flight has been answered (not when hung: it never will)."""
        self.begin_drain()
        while not self.hung and (self._inflight or not self.scheduler.idle):
            if force is not None and force.is_set():
                logger.warning("exiting without draining: %d requests in flight", self._inflight)
                return
            await asyncio.sleep(DRAIN_POLL_S)

    async def stop(self) -> None:
        if self._lifecycle is not None:
            self._lifecycle.cancel()
            await asyncio.gather(self._lifecycle, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.scheduler.stop()

    async def __aenter__(self) -> EmulatorServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # --- /generate ----------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrival_s = time.perf_counter()
        if self.phase is not Phase.READY:
            return _empty(503)
        self._inflight += 1
        try:
            return await self._generate(request, arrival_s)
        finally:
            self._inflight -= 1

    async def _generate(self, request: web.Request, arrival_s: float) -> web.StreamResponse:
        try:
            call = parse_generate(json.loads(await request.read()), self.cfg)
        except SchemaViolation as exc:
            self.counters.rejected_invalid += 1
            return _json({"error": str(exc)}, 400)
        except InvalidRequest as exc:
            self.counters.rejected_invalid += 1
            return _json({"error": {"message": str(exc)}}, 400)
        except ValueError as exc:  # not JSON at all
            self.counters.rejected_invalid += 1
            body = error_object(f"JSON decode error: {exc}", 400) | {"type": "Bad Request"}
            return _json(body, 400)

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
        if self.phase is not Phase.READY:
            return _empty(503)
        if self.hung:
            await asyncio.get_running_loop().create_future()  # never answers
        if self.cfg.immediate:
            return self._answer_now(call, arrival_s)
        jobs = [new_job(item, self.cfg, arrival_s) for item in call.items]
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
        return _json(answers[0] if call.is_single else answers)

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
        for item in call.items:
            output_ids, finish = generate_output(
                item.input_ids, item.sampling, self.cfg, sample_index=item.sample_index
            )
            cached = cache.match(item.input_ids)
            cache.insert(item.input_ids)
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
                )
            )
        if call.stream:
            return self._stream_now(call, answers)
        return _json(answers[0] if call.is_single else answers)

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
            return waiting_abort_response(job.item, self.cfg, job.e2e_latency_s)
        return generate_response(
            job.item,
            job.output_ids,
            job.finish_reason,
            self.cfg,
            cached_tokens=job.cached_tokens,
            e2e_latency_s=job.e2e_latency_s,
        )

    def _abort_unfinished(self, jobs: list[Job]) -> None:
        for job in jobs:
            if not job.finished:
                self.scheduler.abort(job.item.rid)

    async def _queue_full(
        self, request: web.Request, call: GenerateCall, jobs: list[Job]
    ) -> web.StreamResponse:
        if not call.stream:
            return _json(error_object(QUEUE_FULL, 503), 503)
        # a stream has already "started": SGLang sends the abort as an event inside a 200
        finish = {"type": "abort", "status_code": 503, "message": QUEUE_FULL}
        response = await self._open_stream(request)
        for index, job in enumerate(jobs):
            event = waiting_abort_response(job.item, self.cfg, job.e2e_latency_s, finish)
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

    # --- health -------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """Plain 200 unless loading or draining (as with health-endpoint generation off)."""
        if self.phase is not Phase.READY:
            return _empty(503)
        if self.cfg.health_endpoint_generation:
            return await self.health_generate(request)
        return _empty(200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 when the scheduler produces anything within health_timeout_s, else 503."""
        if self.phase is not Phase.READY:
            return _empty(503)
        timeout_s = self.cfg.health_timeout_s
        if self.cfg.immediate:
            healthy = not self.hung
            if not healthy:
                await asyncio.sleep(timeout_s)
        else:
            healthy = await self.scheduler.probe(timeout_s)
        if not healthy:
            logger.error(
                "Health check failed: no progress from the scheduler for %.1f s", timeout_s
            )
        self.unhealthy = not healthy
        return _empty(200 if healthy else 503)

    async def ready(self, request: web.Request) -> web.Response:
        ok = self.phase is Phase.READY and not self.unhealthy and self._resumed.is_set()
        return _empty(200 if ok else 503)

    # --- information --------------------------------------------------------------------

    # --- /v1/tokenize, /v1/detokenize ---------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, tokenize_body=True)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, tokenize_body=False)

    async def _tokenizer_route(self, request: web.Request, *, tokenize_body: bool) -> web.Response:
        if self.phase is Phase.DRAINING:
            return _empty(503)
        content_type, raw = request.headers.get("content-type", ""), await request.read()
        tokenizer, context = self.tokenizer, self.cfg.context_length

        def answer() -> TokenizeAnswer:
            return answer_raw(content_type, raw, tokenizer, context, tokenize_body=tokenize_body)

        # rendering and encoding run off the event loop, as SGLang runs them
        result = await asyncio.get_running_loop().run_in_executor(None, answer)
        return _json(result.body, result.status)

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(model_info(self.cfg))

    async def server_info(self, request: web.Request) -> web.Response:
        if self.hung:  # internal_states asks the scheduler, which never answers
            await asyncio.get_running_loop().create_future()
        return _json(server_info(self.cfg, self.port, self.startup_time))

    async def models(self, request: web.Request) -> web.Response:
        return _json(models_list(self.cfg, int(self.startup_time)))

    async def stats(self, request: web.Request) -> web.Response:
        uptime_s = time.monotonic() - self._bound_at
        return _json(
            stats_json(self.cfg, self.counters, self.scheduler, uptime_s, self.phase.value)
        )

    # --- control ------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        value = json.loads(raw) if raw.strip() else {}
        if not isinstance(value, dict):
            raise ValueError("the body must be a JSON object")
        return value

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
        except ValueError as exc:
            return _json(error_object(str(exc), 400) | {"type": "Bad Request"}, 400)
        if body.get("abort_all"):
            logger.info("abort_all requested")
            self.scheduler.abort_all()
        elif body.get("rid"):
            self.scheduler.abort(str(body["rid"]))
        return _empty(200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.scheduler.flush_cache():
            return web.Response(text=FLUSH_OK)
        return web.Response(text=FLUSH_FAILED, status=400)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
        except ValueError as exc:
            return _json(error_object(str(exc), 400) | {"type": "Bad Request"}, 400)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            message = f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}"
            return _json(error_object(message, 400) | {"type": "Bad Request"}, 400)
        logger.info("generation paused (mode %s)", mode)
        self._resumed.clear()
        self.scheduler.pause(mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        logger.info("generation continued")
        self._resumed.set()
        self.scheduler.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})


async def serve(cfg: EmulatorConfig) -> None:
    """Run one emulated server until SIGINT/SIGTERM; a second signal skips the drain."""
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()
    server = EmulatorServer(cfg)

    def on_signal(signum: int) -> None:
        if stop.is_set():
            force.set()
            return
        logger.info(
            "%s received. Draining requests and shutting down...", signal.Signals(signum).name
        )
        if server.port is not None:
            server.begin_drain()
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        if cfg.startup_delay_s > 0:
            logger.info("loading weights (emulated): port closed for %.1f s", cfg.startup_delay_s)
            try:
                await asyncio.wait_for(stop.wait(), cfg.startup_delay_s)
                return  # stopped while "loading": nothing was bound
            except TimeoutError:
                pass
        await server.start()
        try:
            await stop.wait()
            await server.drain(force)
        finally:
            await server.stop()
        logger.info("emulator stopped")
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def run(cfg: EmulatorConfig) -> int:
    """Blocking entry point of the CLI: serve, then the process exit code (0 after a drain)."""
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:  # the port is taken, the host is wrong
        print(f"emulator: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        return 1
    except TokenizerError as exc:  # --tokenizer cannot be loaded (custom code not allowed, ...)
        print(f"emulator: --tokenizer: {exc}", file=sys.stderr)
        return 1
    return 0

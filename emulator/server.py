"""The emulator's HTTP server: SGLang's native routes on aiohttp, startup phases, faults, shutdown.

`serve(cfg)` runs one emulated server until SIGINT/SIGTERM; `EmulatorServer` runs it in-process.
Its `/generate` route is `emulator.generate_route`.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from emulator.config import EmulatorConfig
from emulator.generate_route import GenerateRoute, Phase, empty_reply, json_reply
from emulator.image_prompt import ImageProcessor, TextCodec
from emulator.info import (
    loads_body,
    loads_prometheus,
    model_info,
    models_list,
    server_info,
    stats_json,
)
from emulator.protocol import error_object
from emulator.scheduler import Counters, Scheduler
from emulator.speculative import RequestLog
from emulator.tokenize import TokenizeAnswer, answer_raw
from emulator.tool_calls import ToolCallWriter
from emulator.vision import VisionConfigError, vision_settings
from emulator.weights import (
    DISK_FIELDS,
    FLUSH_REFUSED,
    UPDATED,
    VERSION_FIELDS,
    Weights,
    check_body,
    load_error,
)

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


# /generate, the route with the most to it, is its own mixin (emulator.generate_route)
class EmulatorServer(GenerateRoute):
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
        self.images: ImageProcessor | None = None
        self.tool_calls: ToolCallWriter | None = None
        self.request_log = RequestLog(cfg.request_log)
        self.weights = Weights(cfg.model_path, cfg.weight_version)

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

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
        add("GET", "/v1/loads", self.loads)
        for path in ("/v1/tokenize", "/tokenize"):
            add("POST", path, self.tokenize)
        for path in ("/v1/detokenize", "/detokenize"):
            add("POST", path, self.detokenize)
        add("POST", "/abort_request", self.abort_request)
        add("GET", "/flush_cache", self.flush_cache)
        add("POST", "/flush_cache", self.flush_cache)
        add("POST", "/update_weights_from_disk", self.update_weights_from_disk)
        add("POST", "/update_weight_version", self.update_weight_version)
        add("POST", "/pause_generation", self.pause_generation)
        add("POST", "/continue_generation", self.continue_generation)
        add("GET", "/emulator/stats", self.stats)
        return app

    @web.middleware
    async def require_api_key(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """SGLang's --api-key check (`utils/auth.py`): health and readiness probes, /metrics and
        OPTIONS pass without it."""
        path = request.path
        if request.method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
            return await handler(request)
        expected = f"Bearer {self.cfg.api_key}".encode()
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            self.counters.unauthorized += 1
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def start(self) -> None:
        """Bind the port (the weights are "loaded"), then warm up for loading_s, then serve."""
        if self.cfg.tokenizer is not None and self.tokenizer is None:
            folder, remote = self.cfg.tokenizer, self.cfg.trust_remote_code
            self.tokenizer = await asyncio.get_running_loop().run_in_executor(
                None, lambda: load_tokenizer(folder, trust_remote_code=remote)
            )
            logger.info(
                "/v1/tokenize renders chat requests with tokenmill's own chat path "
                "(app.prompts), not SGLang's: it checks tokenmill against itself"
            )
        if self.cfg.tool_calls is not None and self.tokenizer is not None:
            tokenizer = self.tokenizer
            self.tool_calls = ToolCallWriter(
                self.cfg.tool_calls,
                decode=tokenizer.decode,
                encode=lambda text: list(
                    tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)
                ),
                eos_id=self.cfg.eos_id,
                think_end_id=self.cfg.think_end_id,
            )
        if self.cfg.mm is not None and self.images is None:
            self.images = image_processor(self.cfg, self.tokenizer)
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
        """SIGTERM, as SGLang's `sigterm_watchdog`: the health routes answer 503 while /generate
        still serves whatever it is sent; the process exits once no request is left."""
        if self.phase is not Phase.DRAINING:
            logger.info(
                "draining: %d running, %d waiting, %d in flight",
                self.scheduler.running,
                self.scheduler.waiting,
                self._inflight,
            )
        self.phase = Phase.DRAINING

    async def drain(self, force: asyncio.Event | None = None) -> None:
        """Wait until no request is left, those that arrived during the drain included (not
        when hung: it never will). SGLang looks every 5 s; this looks every DRAIN_POLL_S."""
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
        self.request_log.close()

    async def __aenter__(self) -> EmulatorServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # --- health -------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """Plain 200 unless loading or draining (as with health-endpoint generation off)."""
        self.counters.health_checks += 1
        if self.phase is not Phase.READY:
            return empty_reply(503)
        if self.cfg.health_endpoint_generation:
            return await self.health_generate(request)
        return empty_reply(200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 when the scheduler produces anything within health_timeout_s, else 503."""
        if request.path == "/health_generate":
            self.counters.health_checks += 1
        if self.phase is not Phase.READY:
            return empty_reply(503)
        timeout_s = self.cfg.health_timeout_s
        if self.cfg.immediate:
            healthy = not self.hung
            if not healthy:
                await asyncio.sleep(timeout_s)
        else:
            healthy = await self._probe_generation(timeout_s)
        if not healthy:
            logger.error(
                "Health check failed: no progress from the scheduler for %.1f s", timeout_s
            )
        self.unhealthy = not healthy
        return empty_reply(200 if healthy else 503)

    async def _probe_generation(self, timeout_s: float) -> bool:
        """The health check's 1-token generation: like any request it waits for a weight
        update in progress, so a load longer than the timeout answers 503."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                async with self.weights.lock.reader():
                    remaining_s = max(0.001, timeout_s - (time.monotonic() - started))
                    return await self.scheduler.probe(remaining_s)
        except TimeoutError:
            return False

    async def ready(self, request: web.Request) -> web.Response:
        ok = self.phase is Phase.READY and not self.unhealthy and self._resumed.is_set()
        return empty_reply(200 if ok else 503)

    # --- information --------------------------------------------------------------------

    # --- /v1/tokenize, /v1/detokenize ---------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, tokenize_body=True)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, tokenize_body=False)

    async def _tokenizer_route(self, request: web.Request, *, tokenize_body: bool) -> web.Response:
        content_type, raw = request.headers.get("content-type", ""), await request.read()
        tokenizer, context = self.tokenizer, self.cfg.context_length

        def answer() -> TokenizeAnswer:
            return answer_raw(content_type, raw, tokenizer, context, tokenize_body=tokenize_body)

        # rendering and encoding run off the event loop, as SGLang runs them
        result = await asyncio.get_running_loop().run_in_executor(None, answer)
        return json_reply(result.body, result.status)

    async def model_info(self, request: web.Request) -> web.Response:
        return json_reply(model_info(self.cfg, self.weights))

    async def server_info(self, request: web.Request) -> web.Response:
        if self.hung:  # internal_states asks the scheduler, which never answers
            await asyncio.get_running_loop().create_future()
        return json_reply(server_info(self.cfg, self.port, self.startup_time))

    async def loads(self, request: web.Request) -> web.Response:
        """`/v1/loads` (entrypoints/v1_loads.py): per DP rank the running and waiting requests
        and KV use; `?include=core,memory,queues`, `?dp_rank=N`, `?format=prometheus`."""
        query = request.query
        include = query.get("include")
        sections = {s.strip() for s in include.split(",")} if include else None
        try:
            rank = int(query["dp_rank"]) if "dp_rank" in query else None
            body = loads_body(self.cfg, self.scheduler, sections, rank)
        except ValueError as exc:
            return json_reply({"detail": str(exc)}, 400)
        if query.get("format") == "prometheus":
            return web.Response(
                text=loads_prometheus(body["loads"]),
                content_type="text/plain",
                charset="utf-8",
            )
        return json_reply(body)

    async def models(self, request: web.Request) -> web.Response:
        return json_reply(models_list(self.cfg, int(self.startup_time)))

    async def stats(self, request: web.Request) -> web.Response:
        uptime_s = time.monotonic() - self._bound_at
        return json_reply(
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
            return json_reply(error_object(str(exc), 400) | {"type": "Bad Request"}, 400)
        if body.get("abort_all"):
            logger.info("abort_all requested")
            self.scheduler.abort_all()
        elif body.get("rid"):
            self.scheduler.abort(str(body["rid"]))
        return empty_reply(200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.scheduler.flush_cache():
            return web.Response(text=FLUSH_OK)
        return web.Response(text=FLUSH_FAILED, status=400)

    # --- weight updates (emulator.weights) -------------------------------------------

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Load new weights in place: wait for the requests in flight (or abort them), hold
        new ones back while loading, flush the prefix cache, then serve the new version."""
        try:
            body = check_body(
                await self._body(request), DISK_FIELDS, "model_path", "UpdateWeightFromDiskReqInput"
            )
        except ValueError as exc:
            return json_reply(error_object(str(exc), 400) | {"type": "Bad Request"}, 400)
        weights = self.weights
        if body.get("abort_all_requests"):
            self.scheduler.abort_all()
        lock = weights.lock.writer() if self._resumed.is_set() else contextlib.nullcontext()
        async with lock:
            success, message = await self._load_weights(body)
        if success and body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        logger.info("update_weights_from_disk: %s", message)
        reply = {"success": success, "message": message, "num_paused_requests": 0}
        return json_reply(reply, 200 if success else 400)

    async def _load_weights(self, body: dict[str, Any]) -> tuple[bool, str]:
        weights, model_path = self.weights, str(body["model_path"])
        if self.cfg.weight_load_s > 0:
            await asyncio.sleep(self.cfg.weight_load_s)  # the scheduler runs nothing meanwhile
        error = load_error(model_path)
        if error is not None:
            return False, error
        if body.get("weight_version") is not None:
            self.scheduler.change_version(str(body["weight_version"]))
            weights.weight_version = str(body["weight_version"])
        weights.model_path = model_path
        weights.load_format = str(body.get("load_format") or weights.load_format)
        weights.updates += 1
        if body.get("flush_cache", True) and not self.scheduler.flush_cache():
            return False, FLUSH_REFUSED
        return True, UPDATED

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """A new weight_version without new weights: no lock; aborts what is in flight
        unless abort_all_requests is false (then their spans record the change)."""
        try:
            body = check_body(
                await self._body(request),
                VERSION_FIELDS,
                "new_version",
                "UpdateWeightVersionReqInput",
            )
        except ValueError as exc:
            return json_reply(error_object(str(exc), 400) | {"type": "Bad Request"}, 400)
        if body.get("abort_all_requests", True) is not False:
            self.scheduler.abort_all()
        new_version = str(body["new_version"])
        self.scheduler.change_version(new_version)
        self.weights.weight_version = new_version
        logger.info("weight version updated to %s", new_version)
        return json_reply(
            {
                "success": True,
                "message": f"Weight version updated to {new_version}",
                "new_version": new_version,
            }
        )

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
        except ValueError as exc:
            return json_reply(error_object(str(exc), 400) | {"type": "Bad Request"}, 400)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            message = f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}"
            return json_reply(error_object(message, 400) | {"type": "Bad Request"}, 400)
        logger.info("generation paused (mode %s)", mode)
        self._resumed.clear()
        self.scheduler.pause(mode)
        return json_reply({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        logger.info("generation continued")
        self._resumed.set()
        self.scheduler.resume()
        return json_reply({"message": "Generation continued successfully.", "status": "ok"})


def image_processor(cfg: EmulatorConfig, tokenizer: ChatTokenizer | None) -> ImageProcessor:
    """The --mm family's processor: its settings from the tokenizer folder and
    --mm-process-config; Qwen decodes and tokenizes with the server's tokenizer."""
    assert cfg.mm is not None
    settings = vision_settings(cfg.mm, cfg.tokenizer, cfg.process_config, cfg.mm_retokenize)
    codec = None
    if tokenizer is not None:
        hf = tokenizer.hf_tokenizer
        codec = TextCodec(
            decode=lambda ids: tokenizer.decode(ids),
            encode=lambda text: list(hf.encode(text, add_special_tokens=True)),
        )
    logger.info(
        "images on /generate: %s, placeholder id %d, %s%s",
        settings.family,
        settings.placeholder_id,
        settings.limits,
        " (decode + re-tokenize fallback on)" if settings.retokenize else "",
    )
    return ImageProcessor(settings, codec)


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
    except VisionConfigError as exc:  # --mm: the tokenizer folder does not name the placeholder
        print(f"emulator: {exc}", file=sys.stderr)
        return 1
    return 0

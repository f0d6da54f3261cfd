"""SGLangClient, over one httpx client: the request bodies of /generate and /abort_request, health
probes, /model_info and /server_info, the fingerprint a run pins, the capacity and load a window
is sized by, and one shared TLS context; client_for makes one from the settings."""

from __future__ import annotations

import base64
import json
import logging
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Final

import httpx

from app.core.contracts import GenerateResult, ServerFingerprint
from app.core.errors import GenerationError, PermanentError, RetryableError
from app.core.images import image_settings
from app.core.settings import Settings
from app.sglang.capacity import Capacity, Load, capacity_of, load_of
from app.sglang.errors import map_http_error, server_message
from app.sglang.limits import limits_of
from app.sglang.responses import parse_generate_response

logger = logging.getLogger(__name__)

# Below uvicorn's default keep-alive (5 s), so the client drops an idle connection before the
# server closes it under a request (that race surfaces as a RemoteProtocolError).
KEEPALIVE_EXPIRY_S: Final = 4.0

# Server args recorded beside the fingerprint (not compared): the flags that change outputs.
_SERVER_ARGS_KEPT: Final = (
    "served_model_name",
    "revision",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "context_length",
    "tp_size",
    "dp_size",
    "ep_size",
    "speculative_algorithm",
    "attention_backend",
    "sampling_backend",
    "random_seed",
    "enable_deterministic_inference",
    "chat_template",
)
_MODEL_INFO_KEPT: Final = (
    "tokenizer_path",
    "is_generation",
    "model_type",
    "architectures",
    "tool_call_parser",
    "preferred_sampling_params",
)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One health probe: whether it answered 200, what it answered, and how long it took."""

    ok: bool
    status_code: int | None
    latency_s: float
    error: str | None = None


# --- the client --------------------------------------------------------------------------


_ssl_context: ssl.SSLContext | None = None
_ssl_lock = threading.Lock()


def shared_ssl_context() -> ssl.SSLContext:
    """One verifying TLS context per process: httpx would otherwise build one (and load the CA
    bundle, ~18 ms of CPU under the GIL) for every client, and a worker makes one per slot."""
    global _ssl_context
    with _ssl_lock:
        if _ssl_context is None:
            _ssl_context = ssl.create_default_context()
        return _ssl_context


def http_client(
    base_url: str,
    timeout: httpx.Timeout,
    *,
    max_connections: int,
    api_key: str | None,
    transport: httpx.BaseTransport | None = None,
) -> httpx.Client:
    """The one way tokenmill opens HTTP to an SGLang server (/generate, probes, /v1/tokenize):
    a pool of max_connections kept alive, no proxies or certificates from the environment, no
    redirects, the process's TLS context, and SGLang's --api-key as a bearer token."""
    return httpx.Client(
        base_url=base_url,
        timeout=timeout,
        limits=httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        ),
        transport=transport,
        trust_env=False,
        follow_redirects=False,
        verify=shared_ssl_context(),
        # httpx keeps the key out of repr() and our logs never print headers
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
    )


class SGLangClient:
    """A client of one SGLang server over ONE `httpx.Client`, meant for one thread.

    A worker keeps N requests in flight with N threads, each owning a client with
    `max_connections=1` (measured cheapest in client CPU, see `bench/client_cpu.py`). A client
    with a larger pool may be shared by threads; httpx's sync client is thread-safe.
    Nothing connects until the first call. No call is retried here: the caller owns retries.
    `trust_env` is off: proxies and certificates never come from the environment.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float,
        generate_timeout_s: float,
        info_timeout_s: float,
        probe_timeout_s: float,
        max_connections: int = 1,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        for name, value in (
            ("connect_timeout_s", connect_timeout_s),
            ("generate_timeout_s", generate_timeout_s),
            ("info_timeout_s", info_timeout_s),
            ("probe_timeout_s", probe_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
        self.base_url = base_url.rstrip("/")
        # A non-streaming /generate sends nothing until the whole answer is ready, so the read
        # timeout bounds the generation; only connecting is expected to be quick.
        self._generate_timeout = httpx.Timeout(generate_timeout_s, connect=connect_timeout_s)
        self._info_timeout = httpx.Timeout(info_timeout_s, connect=connect_timeout_s)
        self._probe_timeout = httpx.Timeout(probe_timeout_s, connect=connect_timeout_s)
        self._client = http_client(
            self.base_url,
            self._info_timeout,
            max_connections=max_connections,
            api_key=api_key,
            transport=transport,
        )
        # Absolute URLs built once: httpx would otherwise parse and join base + path per call.
        self._urls: dict[str, httpx.URL] = {}
        self._version_logged = False

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r})"

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection(s); the client cannot be used afterwards."""
        self._client.close()

    # -- generation -------------------------------------------------------------------

    @staticmethod
    def build_generate_body(
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        rid: str,
        *,
        return_prompt_token_ids: bool = False,
        image_data: Sequence[str] | None = None,
        priority: int | None = None,
    ) -> dict[str, Any]:
        """The exact JSON body `generate` sends (one prompt, non-streaming). With image_data
        (one `data:` URI per image, in prompt order; input_ids hold one placeholder each) the
        served prompt ids are asked back, so the caller can check how the images expanded."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": dict(sampling_params),
            "rid": rid,
            "stream": False,
        }
        if image_data:
            # a list even for one image: one request's list is its images, in prompt order
            body["image_data"] = list(image_data)
        if return_prompt_token_ids or image_data:
            body["return_prompt_token_ids"] = True
        if priority is not None:
            # the server's own queue order (`--enable-priority-scheduling`): only for a server
            # that says it schedules by priority (another may abort a request that names one)
            body["priority"] = priority
        return body

    def generate(
        self,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        rid: str,
        *,
        return_prompt_token_ids: bool = False,
        image_data: Sequence[str] | None = None,
        priority: int | None = None,
    ) -> GenerateResult:
        """Generate for one prompt; return only a finished (stop or length) result.

        image_data: the prompt's images as `data:` URIs (see `image_data_uri`), in the order
        of its placeholders; the result then carries the served `prompt_token_ids`.
        priority: SGLang's request priority, in the server's own direction (None: not sent).

        Raises PermanentError (bad request: fix the item, not the server), RetryableError
        (timeouts, resets, 5xx, a full queue, a plain abort, a malformed answer) or
        ServerUnavailable (refused, loading, shutting down), as `map_http_error` decides.
        """
        if not input_ids:
            raise PermanentError("input_ids cannot be empty")
        if not rid:
            raise PermanentError("rid cannot be empty")
        body = self.build_generate_body(
            input_ids,
            sampling_params,
            rid,
            return_prompt_token_ids=return_prompt_token_ids,
            image_data=image_data,
            priority=priority,
        )
        content = json.dumps(body, separators=(",", ":")).encode()
        started_s = time.monotonic()
        response = self._send(
            "POST",
            "/generate",
            timeout=self._generate_timeout,
            content=content,
            headers={"content-type": "application/json"},
        )
        elapsed_s = time.monotonic() - started_s
        if response.status_code != 200:
            raise map_http_error(response.status_code, response.content)
        result = parse_generate_response(
            response.content, rid, prompt_tokens_sent=len(input_ids), elapsed_s=elapsed_s
        )
        logger.debug(
            "rid %s: %s after %.3f s, %d prompt + %d completion tokens",
            rid,
            result.finish_reason,
            elapsed_s,
            result.prompt_tokens,
            result.completion_tokens,
        )
        # what the server received, kept with the result as its provenance
        return replace(result, sampling_params=dict(body["sampling_params"]))

    def abort(self, rid: str) -> bool:
        """Ask the server to abort request `rid` (`POST /abort_request`); best effort.

        Returns whether the server accepted the call; failures are logged, never raised,
        because an abort is sent on a path that is already handling another error.
        """
        try:
            response = self._send(
                "POST", "/abort_request", timeout=self._info_timeout, json={"rid": rid}
            )
        except GenerationError as exc:
            logger.warning(
                "abort of rid %s at %s failed: %s",
                rid,
                self.base_url,
                exc,
                extra={"action": "abort_failed"},
            )
            return False
        if response.status_code != 200:
            error = map_http_error(response.status_code, response.content)
            logger.warning(
                "abort of rid %s at %s refused: %s",
                rid,
                self.base_url,
                error,
                extra={"action": "abort_refused"},
            )
            return False
        return True

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str]:
        """`POST /update_weights_from_disk`: load new weights in place (the server waits for
        its requests in flight unless abort_all_requests); (success, the server's message).
        A load can take minutes, so it is bounded by the generate timeout."""
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        response = self._send(
            "POST", "/update_weights_from_disk", timeout=self._generate_timeout, json=body
        )
        try:
            answer = json.loads(response.content)
        except ValueError:
            answer = None
        if isinstance(answer, dict) and "success" in answer:
            return bool(answer["success"]), str(answer.get("message") or "")
        raise map_http_error(response.status_code, response.content)

    # -- health -----------------------------------------------------------------------

    def health(self, path: str = "/health_generate") -> ProbeResult:
        """Probe a health route once with the probe timeout; never raises.

        SGLang's own generation check gives up after 20 s, so the caller passes a probe
        timeout above that, and must not overlap probes to one server (they pile up inside).
        """
        started_s = time.monotonic()
        try:
            response = self._send("GET", path, timeout=self._probe_timeout)
        except GenerationError as error:
            return ProbeResult(False, None, time.monotonic() - started_s, error.message)
        latency_s = time.monotonic() - started_s
        if response.status_code == 200:
            return ProbeResult(True, 200, latency_s)
        message = server_message(response.content)
        where = f"HTTP {response.status_code}"
        return ProbeResult(
            False, response.status_code, latency_s, f"{where}: {message}" if message else where
        )

    def ready(self) -> bool:
        """`GET /ready` answered 200: the server finished loading and warmup."""
        return self.health("/ready").ok

    # -- configuration ----------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        """`GET /model_info` (falls back to `/get_model_info` on older servers)."""
        return self._info("/model_info", "/get_model_info")

    def server_info(self) -> dict[str, Any]:
        """`GET /server_info` (falls back to `/get_server_info`); it can hang with the scheduler,
        so it is bounded by the info timeout."""
        return self._info("/server_info", "/get_server_info")

    def capacity(self) -> Capacity | None:
        """What the server runs at once, from `/server_info` (None: it does not say)."""
        return capacity_of(self.server_info())

    def loads(self) -> Load | None:
        """The server's load now, `GET /v1/loads?include=core` (one small read, bounded by the
        probe timeout); None when the server has no such route (before 0.5.23)."""
        response = self._send("GET", "/v1/loads?include=core", timeout=self._probe_timeout)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise map_http_error(response.status_code, response.content)
        try:
            body = json.loads(response.content)
            return load_of(body if isinstance(body, dict) else {})
        except ValueError as exc:
            raise RetryableError(f"/v1/loads answered no loads ({exc})", status_code=200) from exc

    def fingerprint(self) -> ServerFingerprint:
        """The configuration a run pins: model_path, weight_version, reasoning_parser from
        `/model_info`, version and the request limits from `/server_info`; outputs-changing
        server args in `extra`;
        the image settings of a server whose `/model_info` says it understands images."""
        model = self.model_info()
        server = self.server_info()
        self._log_version(server)
        extra: dict[str, Any] = {k: model[k] for k in _MODEL_INFO_KEPT if k in model}
        extra["server_args"] = {k: server[k] for k in _SERVER_ARGS_KEPT if k in server}
        return ServerFingerprint(
            model_path=_opt_str(model.get("model_path")),
            weight_version=_opt_str(model.get("weight_version")),
            reasoning_parser=_opt_str(model.get("reasoning_parser")),
            version=_opt_str(server.get("version")),
            extra=extra,
            speculative=speculative_settings(server),
            images=image_settings(server) if model.get("has_image_understanding") is True else None,
            limits=limits_of(server),
        )

    def _log_version(self, server: Mapping[str, Any]) -> None:
        if not self._version_logged:
            logger.info(
                "sglang server %s runs version %s",
                self.base_url,
                server.get("version"),
                extra={"action": "server_version"},
            )
            self._version_logged = True

    def _info(self, path: str, legacy_path: str) -> dict[str, Any]:
        response = self._send("GET", path, timeout=self._info_timeout)
        if response.status_code == 404:
            response = self._send("GET", legacy_path, timeout=self._info_timeout)
            path = legacy_path
        if response.status_code != 200:
            raise map_http_error(response.status_code, response.content)
        try:
            data = json.loads(response.content)
        except ValueError as exc:
            raise RetryableError(f"{path} answered non-JSON", status_code=200) from exc
        if not isinstance(data, dict):
            raise RetryableError(f"{path} answered {type(data).__name__}", status_code=200)
        return data

    def _send(
        self, method: str, path: str, *, timeout: httpx.Timeout, **kwargs: Any
    ) -> httpx.Response:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.base_url + path)
        try:
            return self._client.request(method, url, timeout=timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise map_http_error(None, None, exc) from exc


def speculative_settings(server_info: Mapping[str, Any]) -> dict[str, Any] | None:
    """The speculative-decoding settings a run pins, from `/server_info`'s server args; None
    when the server does not speculate (no `speculative_algorithm`)."""
    algorithm = server_info.get("speculative_algorithm")
    if not algorithm:
        return None
    return {
        "algorithm": str(algorithm),
        "draft_model_path": _opt_str(server_info.get("speculative_draft_model_path")),
        "num_draft_tokens": server_info.get("speculative_num_draft_tokens"),
        "num_steps": server_info.get("speculative_num_steps"),
        "eagle_topk": server_info.get("speculative_eagle_topk"),
    }


# the MIME subtype of each format tokenmill stores (app.core.images.FORMAT_EXTENSIONS)
_IMAGE_MIME: Final = {
    "PNG": "png",
    "JPEG": "jpeg",
    "WEBP": "webp",
    "GIF": "gif",
    "BMP": "bmp",
    "TIFF": "tiff",
}


def image_data_uri(image_format: str, data: bytes) -> str:
    """An image's bytes as the `data:image/<type>;base64,...` string SGLang's image loader
    takes in `image_data` (the servers of a fleet cannot read the client's paths)."""
    subtype = _IMAGE_MIME.get(image_format.upper(), image_format.lower())
    return f"data:image/{subtype};base64,{base64.b64encode(data).decode('ascii')}"


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def client_for(url: str, settings: Settings) -> SGLangClient:
    """A single-connection client of url with every timeout from settings."""
    return SGLangClient(
        url,
        connect_timeout_s=settings.connect_timeout_s,
        generate_timeout_s=settings.generate_timeout_s,
        info_timeout_s=settings.info_timeout_s,
        probe_timeout_s=settings.probe_timeout_s,
        api_key=settings.sglang_api_key.get_secret_value() if settings.sglang_api_key else None,
    )

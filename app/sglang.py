"""The HTTP client of one SGLang server: native `POST /generate` with pre-tokenized input_ids.

Owns the request bodies, response parsing and the one mapping of HTTP/transport failures to
`app.core.errors` (`map_http_error`); everything the server says is checked before it is trusted.
"""

from __future__ import annotations

import json
import logging
import re
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import httpx

from app.core.contracts import GenerateResult, ServerFingerprint
from app.core.errors import GenerationError, PermanentError, RetryableError, ServerUnavailable

logger = logging.getLogger(__name__)

__all__ = [
    "ERROR_MESSAGE_MAX_CHARS",
    "ProbeResult",
    "SGLangClient",
    "map_abort",
    "map_http_error",
    "parse_generate_response",
    "server_message",
]

# Error text kept from a server body: enough for the ledger's last_error, never a page.
ERROR_MESSAGE_MAX_CHARS: Final = 500

# Below uvicorn's default keep-alive (5 s), so the client drops an idle connection before the
# server closes it under a request (that race surfaces as a RemoteProtocolError).
KEEPALIVE_EXPIRY_S: Final = 4.0

# A 503 whose message says this is a server that is up but full: back off and retry.
_QUEUE_FULL = re.compile(r"queue is full|queue full|too many requests|overload", re.IGNORECASE)
# Without a status (a plain abort), these words mean the server is going away or not up yet.
_GOING_AWAY = re.compile(
    r"shut ?down|shutting down|loading|not ready|starting up|draining|unavailable", re.IGNORECASE
)
# Eight or more comma-separated integers: a token array echoed into an error, never logged.
_INT_RUN = re.compile(r"-?\d+(?:\s*,\s*-?\d+){7,}")
_SPACES = re.compile(r"\s+")

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


# --- the one place where failures are classified ---------------------------------------


def server_message(body: bytes | str | None) -> str:
    """The server's error text from any body SGLang sends, trimmed and without token arrays.

    Understands `{"error": "<text>"}`, `{"error": {"message": ...}}`, `{"message": ...}`,
    FastAPI's `{"detail": ...}` and plain text.
    """
    if body is None:
        return ""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    text = text.strip()
    if text[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except ValueError:
            pass
        else:
            text = _message_from_json(data) or text
    return _trim(text)


def _message_from_json(data: Any) -> str | None:
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, str):
        return error
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    for key in ("message", "detail"):
        if isinstance(data.get(key), str):
            return str(data[key])
    return None


def _trim(text: str) -> str:
    text = _INT_RUN.sub(lambda m: f"<{m.group(0).count(',') + 1} ints>", text)
    text = _SPACES.sub(" ", text).strip()
    if len(text) > ERROR_MESSAGE_MAX_CHARS:
        text = text[: ERROR_MESSAGE_MAX_CHARS - 1] + "…"
    return text


def map_http_error(
    status_code: int | None, body: bytes | str | None, exc: Exception | None = None
) -> GenerationError:
    """Decide what a failed exchange with the server means; every case is decided here.

    With `exc` (an httpx exception, no response):
      ConnectError, ConnectTimeout -> ServerUnavailable (refused or unreachable: down/loading);
      ReadTimeout, WriteTimeout, PoolTimeout, RemoteProtocolError, ReadError, WriteError and
      any other httpx or unexpected exception -> RetryableError.
    With a status:
      400 and other 4xx -> PermanentError with the server's message, except 408, 429 ->
      RetryableError, and 401, 403 -> ServerUnavailable (a wrong or missing API key is the
      deployment's fault, not the item's: the server's items wait instead of failing);
      503 -> ServerUnavailable (loading, shutting down, empty body), except a
      "request queue is full" message -> RetryableError: the server is up but full, so the
      item backs off instead of pausing the whole server; other 5xx -> RetryableError;
      any other status (1xx-3xx where a 200 was expected) -> RetryableError.
    Without either (a plain abort): RetryableError, or ServerUnavailable when the message
    says the server is shutting down or loading.
    """
    if exc is not None:
        return _map_exception(exc)
    message = server_message(body)
    where = "no status" if status_code is None else f"HTTP {status_code}"
    text = f"{where}: {message}" if message else where
    if status_code is None:
        if _GOING_AWAY.search(message):
            return ServerUnavailable(text)
        return RetryableError(text)
    if status_code == 503:
        if _QUEUE_FULL.search(message):
            return RetryableError(text, status_code=status_code)
        return ServerUnavailable(text, status_code=status_code)
    if status_code in (408, 429):
        return RetryableError(text, status_code=status_code)
    if status_code in (401, 403):
        return ServerUnavailable(
            f"{text} (the server wants an API key: check TOKENMILL_SGLANG_API_KEY)",
            status_code=status_code,
        )
    if 400 <= status_code < 500:
        return PermanentError(text, status_code=status_code)
    if status_code >= 500:
        return RetryableError(text, status_code=status_code)
    return RetryableError(f"unexpected {text}", status_code=status_code)


def _map_exception(exc: Exception) -> GenerationError:
    name = type(exc).__name__
    detail = _trim(str(exc))
    text = f"{name}: {detail}" if detail else name
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return ServerUnavailable(f"cannot connect: {text}")
    if isinstance(exc, httpx.TimeoutException):
        return RetryableError(f"timed out: {text}")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return RetryableError(f"connection lost: {text}")
    return RetryableError(text)


def map_abort(finish_reason: Mapping[str, Any]) -> GenerationError:
    """The error for an HTTP 200 whose `finish_reason.type` is `abort`: never a success.

    The abort's own `status_code` (SGLang sets 400/500/503 on scheduler aborts) is classified
    like an HTTP status by `map_http_error`; a plain abort (no status, e.g. `/abort_request`)
    is RetryableError unless its message says the server is shutting down or loading.
    """
    status = finish_reason.get("status_code")
    raw_message = finish_reason.get("message")
    message = raw_message if isinstance(raw_message, str) else ""
    body = f"request aborted: {message}" if message else "request aborted"
    status_code = status if isinstance(status, int) and status >= 400 else None
    return map_http_error(status_code, body)


# --- response parsing --------------------------------------------------------------------


def _malformed(why: str) -> RetryableError:
    return RetryableError(f"malformed /generate response: {why}", status_code=200)


def _is_int_list(value: Any) -> bool:
    # set(map(type, ...)) runs in C: ~20 ns an id, so checking 8K ids costs ~0.15 ms; bool is
    # its own type, so true/false never pass as ids.
    return type(value) is list and set(map(type, value)) <= {int}


def _int_list(value: Any, name: str) -> list[int]:
    if not _is_int_list(value):
        raise _malformed(f"{name} is not a list of ints")
    ids: list[int] = value
    return ids


def _int_field(meta: Mapping[str, Any], key: str, default: int) -> int:
    value = meta.get(key)
    if value is None:
        return default
    if type(value) is not int or value < 0:
        raise _malformed(f"meta_info.{key} is not a count")
    return value


def _matched(value: Any) -> int | str | None:
    # SGLang reports the matched stop as a token id, a stop string, or a list of token ids
    # (a multi-token stop); one id is kept as an int, a longer list as its JSON text.
    if value is None or isinstance(value, str) or type(value) is int:
        return value
    if _is_int_list(value):
        return value[0] if len(value) == 1 else json.dumps(value)
    raise _malformed("finish_reason.matched has an unknown shape")


def parse_generate_response(
    content: bytes,
    rid: str,
    *,
    prompt_tokens_sent: int,
    elapsed_s: float,
) -> GenerateResult:
    """Decode and check the body of an HTTP 200 from `POST /generate` (non-streaming).

    Raises the error of `map_abort` for an aborted request and RetryableError for a body that
    is not a complete single response for `rid` (bad JSON, wrong shapes, another rid).
    `elapsed_s` stands in for the server's `e2e_latency` when the server does not send one.
    """
    try:
        data = json.loads(content)
    except ValueError as exc:
        raise _malformed(f"not JSON ({_trim(content[:200].decode('utf-8', 'replace'))})") from exc
    if not isinstance(data, dict):
        raise _malformed(f"expected an object, got {type(data).__name__}")
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        raise _malformed("no meta_info object")
    echoed_rid = meta.get("id")
    if echoed_rid is not None and echoed_rid != rid:
        raise _malformed(f"meta_info.id {str(echoed_rid)[:80]!r} is not the rid sent {rid!r}")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict):
        raise _malformed("no meta_info.finish_reason object")
    finish_type = finish.get("type")
    if finish_type == "abort":
        raise map_abort(finish)
    if finish_type not in ("stop", "length"):
        raise _malformed(f"unknown finish_reason.type {str(finish_type)[:40]!r}")

    output_ids = _int_list(data.get("output_ids"), "output_ids")
    echoed_prompt = data.get("prompt_token_ids")
    prompt_token_ids = (
        None if echoed_prompt is None else _int_list(echoed_prompt, "prompt_token_ids")
    )
    completion_tokens = _int_field(meta, "completion_tokens", len(output_ids))
    if completion_tokens != len(output_ids):
        # output_ids is what gets stored; the count is only reported, so say it and go on.
        logger.warning(
            "rid %s: completion_tokens %d but %d output_ids",
            rid,
            completion_tokens,
            len(output_ids),
        )
    e2e_latency = meta.get("e2e_latency")
    weight_version = meta.get("weight_version")
    text = data.get("text")
    return GenerateResult(
        rid=rid,
        output_ids=output_ids,
        finish_reason="stop" if finish_type == "stop" else "length",
        matched_stop=_matched(finish.get("matched")) if finish_type == "stop" else None,
        prompt_tokens=_int_field(meta, "prompt_tokens", prompt_tokens_sent),
        completion_tokens=completion_tokens,
        cached_tokens=_int_field(meta, "cached_tokens", 0),
        e2e_latency_s=(
            float(e2e_latency)
            if isinstance(e2e_latency, int | float) and not isinstance(e2e_latency, bool)
            else elapsed_s
        ),
        weight_version=weight_version if isinstance(weight_version, str) else None,
        prompt_token_ids=prompt_token_ids,
        text=text if isinstance(text, str) else "",
    )


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
        self._client = httpx.Client(
            base_url=self.base_url,
            timeout=self._info_timeout,
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
            transport=transport,
            trust_env=False,
            follow_redirects=False,
            verify=shared_ssl_context(),
            # SGLang's --api-key; httpx keeps it out of repr() and our logs never print headers
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
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
    ) -> dict[str, Any]:
        """The exact JSON body `generate` sends (one prompt, non-streaming)."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": dict(sampling_params),
            "rid": rid,
            "stream": False,
        }
        if return_prompt_token_ids:
            body["return_prompt_token_ids"] = True
        return body

    def generate(
        self,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        rid: str,
        *,
        return_prompt_token_ids: bool = False,
    ) -> GenerateResult:
        """Generate for one prompt; return only a finished (stop or length) result.

        Raises PermanentError (bad request: fix the item, not the server), RetryableError
        (timeouts, resets, 5xx, a full queue, a plain abort, a malformed answer) or
        ServerUnavailable (refused, loading, shutting down), as `map_http_error` decides.
        """
        if not input_ids:
            raise PermanentError("input_ids cannot be empty")
        if not rid:
            raise PermanentError("rid cannot be empty")
        body = self.build_generate_body(
            input_ids, sampling_params, rid, return_prompt_token_ids=return_prompt_token_ids
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
        return result

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
            logger.warning("abort of rid %s at %s failed: %s", rid, self.base_url, exc)
            return False
        if response.status_code != 200:
            error = map_http_error(response.status_code, response.content)
            logger.warning("abort of rid %s at %s refused: %s", rid, self.base_url, error)
            return False
        return True

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

    def fingerprint(self) -> ServerFingerprint:
        """The configuration a run pins: model_path, weight_version, reasoning_parser from
        `/model_info`, version from `/server_info`; outputs-changing server args in `extra`."""
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
        )

    def log_version(self) -> str | None:
        """Fetch `/server_info` and return its version, logged at INFO once per client."""
        server = self.server_info()
        self._log_version(server)
        return _opt_str(server.get("version"))

    def _log_version(self, server: Mapping[str, Any]) -> None:
        if not self._version_logged:
            logger.info("sglang server %s runs version %s", self.base_url, server.get("version"))
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


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)

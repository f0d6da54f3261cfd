"""The one place where a failed exchange with an SGLang server is classified: HTTP statuses,
transport exceptions and aborts to `app.core.errors`, and the server's error text trimmed."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx

from app.core.errors import (
    AuthRequired,
    BackPressure,
    GenerationError,
    PermanentError,
    RetryableError,
    ServerRefusal,
    ServerUnavailable,
)

# Error text kept from a server body: enough for the ledger's last_error, never a page.
ERROR_MESSAGE_MAX_CHARS: Final = 500

# A 503 whose message says this is a server that is up but full: back off and retry.
_QUEUE_FULL = re.compile(r"queue is full|queue full|too many requests|overload", re.IGNORECASE)
# Without a status (a plain abort), these words mean the server is going away or not up yet.
_GOING_AWAY = re.compile(
    r"shut ?down|shutting down|loading|not ready|starting up|draining|unavailable", re.IGNORECASE
)
# A 400 whose message is about the server's limits (its context length, largest input, KV
# pool) or its tokenizer and vocabulary: another server of the run may serve the request. Every
# other 400 (an empty input, a sampling parameter out of range, a bad image) is the item's own.
_SERVER_DEPENDENT = re.compile(
    r"context length|maximum allowed length|max_req_input_len|max_total_num_tokens|kv cache|"
    r"token count exceeds|tokeniz|vocab",
    re.IGNORECASE,
)
# Eight or more comma-separated integers: a token array echoed into an error, never logged.
_INT_RUN = re.compile(r"-?\d+(?:\s*,\s*-?\d+){7,}")
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class SGLangAnswer:
    """One way SGLang 0.5.23 answers a request it does not serve: the status and body it
    sends, the wheel file and the text of its raise site, and what tokenmill makes of it."""

    case: str
    status: int | None  # None: an HTTP 200 whose finish_reason is an abort without a status
    body: str
    raised_in: str | None  # a member of the wheel; None: not SGLang's (a gateway in front)
    raise_site: str  # text at the raise site that makes this answer
    means: type[GenerationError]
    # whether the answer spends one of the item's attempts (a ServerRefusal does not while
    # another server of the run may serve the item: app.core.errors.ServerRefusal)
    spends_attempt: bool


# Every answer of SGLang that tokenmill tells apart; tests/unit/test_sglang_answers.py holds
# each row against the wheel's raise site and against map_http_error.
SGLANG_ANSWERS: Final[tuple[SGLangAnswer, ...]] = (
    SGLangAnswer(
        "waiting queue full (--max-queued-requests): back-pressure",
        503,
        '{"object":"error","message":"The request queue is full.","type":"503","code":503}',
        "sglang/srt/managers/scheduler.py",
        'message = "The request queue is full."',
        BackPressure,
        False,
    ),
    SGLangAnswer(
        "a gateway in front is rate limiting: back-pressure",
        429,
        '{"error": "Too Many Requests"}',
        None,
        "",
        BackPressure,
        False,
    ),
    SGLangAnswer(
        "health route while starting or draining (SIGTERM)",
        503,
        "",
        "sglang/srt/entrypoints/http_server.py",
        "if _global_state.tokenizer_manager.gracefully_exit:",
        ServerUnavailable,
        False,
    ),
    SGLangAnswer(
        "--api-key set and the request has no or another key",
        401,
        '{"error": "Unauthorized"}',
        "sglang/srt/utils/auth.py",
        '"Unauthorized"',
        AuthRequired,
        False,
    ),
    SGLangAnswer(
        "input as long as the server's context length",
        400,
        '{"error": {"message": "The input (40 tokens) is longer than the model\'s context '
        'length (32 tokens)."}}',
        "sglang/srt/managers/tokenizer_manager.py",
        'f"model\'s context length ({self.context_len} tokens)."',
        ServerRefusal,
        False,
    ),
    SGLangAnswer(
        "input + max_new_tokens beyond the server's context length",
        400,
        '{"error": {"message": "Requested token count exceeds the model\'s maximum context '
        "length of 32 tokens. You requested a total of 40 tokens: 8 tokens from the input "
        'messages and 32 tokens for the completion."}}',
        "sglang/srt/managers/tokenizer_manager.py",
        "Requested token count exceeds the model's maximum context length",
        ServerRefusal,
        False,
    ),
    SGLangAnswer(
        "input past the scheduler's largest (max_req_input_len: the KV pool, the context)",
        400,
        '{"error": {"message": "Input length (40 tokens) exceeds the maximum allowed length '
        '(26 tokens). Use a shorter input or enable --allow-auto-truncate."}}',
        "sglang/srt/managers/utils.py",
        'f"the maximum allowed length ({max_req_input_len} tokens). "',
        ServerRefusal,
        False,
    ),
    SGLangAnswer(
        "a ValueError of the request (schema, images): its message",
        400,
        '{"error": {"message": "input_ids cannot be empty."}}',
        "sglang/srt/entrypoints/http_server.py",
        'status_code=getattr(e, "status_code", HTTPStatus.BAD_REQUEST)',
        PermanentError,
        True,
    ),
    SGLangAnswer(
        "a scheduler abort with a server status",
        500,
        '{"object":"error","message":"Internal server error","type":"500","code":500}',
        "sglang/srt/managers/tokenizer_manager.py",
        'status_code=status_code, detail=finish_reason["message"]',
        RetryableError,
        True,
    ),
)


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
    return trim_message(text)


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


def trim_message(text: str) -> str:
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
      400 and other 4xx -> PermanentError with the server's message (ServerRefusal when
      the message is about the server's limits, tokenizer or vocabulary), except 408 ->
      RetryableError, 429 -> BackPressure, and 401, 403 -> AuthRequired (a wrong or missing
      API key is the deployment's fault, not the item's: the server's items wait instead of
      failing); 503 -> ServerUnavailable (loading, shutting down, empty body), except a
      "request queue is full" message -> BackPressure: the server is up but full, so the
      item backs off without spending an attempt; other 5xx -> RetryableError;
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
            return BackPressure(text, status_code=status_code)
        return ServerUnavailable(text, status_code=status_code)
    if status_code == 429:
        return BackPressure(text, status_code=status_code)
    if status_code == 408:
        return RetryableError(text, status_code=status_code)
    if status_code in (401, 403):
        return AuthRequired(
            f"{text} (the server wants an API key: check TOKENMILL_SGLANG_API_KEY)",
            status_code=status_code,
        )
    if 400 <= status_code < 500:
        if _SERVER_DEPENDENT.search(message):
            return ServerRefusal(text, status_code=status_code)
        return PermanentError(text, status_code=status_code)
    if status_code >= 500:
        return RetryableError(text, status_code=status_code)
    return RetryableError(f"unexpected {text}", status_code=status_code)


def _map_exception(exc: Exception) -> GenerationError:
    name = type(exc).__name__
    detail = trim_message(str(exc))
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

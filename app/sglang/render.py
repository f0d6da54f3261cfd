"""Rendering on the server: the `/v1/tokenize` client that builds prompts exactly as the serving
engine's chat path does, many at once in a bounded window, waiting out outages like /generate.

Requests omit `add_generation_prompt`, so SGLang renders the messages as for a chat completion.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from app.core.backoff import Backoff
from app.core.contracts import Message
from app.core.errors import GenerationError, PermanentError, RetryableError, ServerUnavailable
from app.core.settings import Settings
from app.sglang.client import http_client
from app.sglang.errors import map_http_error

logger = logging.getLogger(__name__)

Sleep = Callable[[float], None]


class RenderServerUnavailable(ServerUnavailable):
    """The render server stayed unavailable longer than the enqueue waits for it."""


@dataclass(frozen=True)
class RenderRequest:
    """What the server renders: a row's messages, its tools and its template kwargs, and the
    final assistant turn's text it continues (continue_final_message), if any."""

    messages: Sequence[Message]
    tools: Sequence[Mapping[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    assistant_prefix: str | None = None

    def body(self) -> dict[str, Any]:
        """The /v1/tokenize body (no add_generation_prompt: rendered as for a chat completion);
        a continued turn goes last, with continue_final_message."""
        body: dict[str, Any] = {"messages": [dict(m) for m in self.messages]}
        if self.assistant_prefix is not None:
            body["messages"].append({"role": "assistant", "content": self.assistant_prefix})
            body["continue_final_message"] = True
        if self.tools:
            body["tools"] = [dict(t) for t in self.tools]
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        return body


def prompt_request(
    messages: Sequence[Message],
    chat_template_kwargs: Mapping[str, Any] | None,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    assistant_prefix: str | None = None,
) -> RenderRequest:
    """The one way a prompt becomes a render request, at enqueue, for later turns and parity."""
    return RenderRequest(
        list(messages), tools or None, dict(chat_template_kwargs or {}) or None, assistant_prefix
    )


# conversations whose rendering pins a server's render: a run rendered by the server keeps
# the sha256 of the answers (`RenderClient.probe_sha256`), so a later enqueue through a server
# that renders otherwise (another template, encoder or tokenizer) is refused
RENDER_PROBE: tuple[RenderRequest, ...] = (
    RenderRequest([{"role": "user", "content": "Hello"}]),
    RenderRequest(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ]
    ),
)


@dataclass(frozen=True)
class RenderPolicy:
    """How long to wait out a server that is down, and how to back off meanwhile."""

    wait_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0


def parse_tokenize_response(content: bytes) -> list[int]:
    """The prompt ids of a /v1/tokenize answer to one messages request; checked before use."""
    try:
        data = json.loads(content)
    except ValueError as exc:
        raise RetryableError("/v1/tokenize answered non-JSON", status_code=200) from exc
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise RetryableError("/v1/tokenize answered without a token list", status_code=200)
    if data.get("count") not in (None, len(tokens)):
        raise RetryableError("/v1/tokenize answered a count that is not its length")
    return [int(t) for t in tokens]


class RenderClient:
    """A client of one server's /v1/tokenize and /v1/detokenize, shared by `window` threads.

    `render_many` keeps up to `window` requests in flight. Timeouts, resets, 5xx and an
    unavailable server are retried with backoff for up to `policy.wait_s` of unavailability,
    one clock for the whole client (the server is down, not each request); then
    RenderServerUnavailable. A 400 (the template refuses the row) is that row's error.
    """

    def __init__(
        self,
        base_url: str,
        *,
        window: int,
        connect_timeout_s: float,
        timeout_s: float,
        api_key: str | None = None,
        policy: RenderPolicy | None = None,
        sleep: Sleep = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        self.base_url = base_url.rstrip("/")
        self.window = window
        self.policy = policy or RenderPolicy()
        self._sleep, self._clock = sleep, clock
        self._client = http_client(
            self.base_url,
            httpx.Timeout(timeout_s, connect=connect_timeout_s),
            max_connections=window,
            api_key=api_key,
            transport=transport,
        )
        self._pool = ThreadPoolExecutor(max_workers=window, thread_name_prefix="tm-render")
        self._outage_lock = threading.Lock()
        self._in_outage = False
        # when the server last stopped answering (None: it answers); shared by every request
        self._down_since: float | None = None

    def __enter__(self) -> RenderClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    def _post(self, path: str, body: dict[str, Any]) -> bytes:
        content = json.dumps(body, separators=(",", ":")).encode()
        try:
            response = self._client.post(
                path, content=content, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            raise map_http_error(None, None, exc) from exc
        if response.status_code != 200:
            raise map_http_error(response.status_code, response.content)
        return response.content

    def render(self, request: RenderRequest) -> list[int]:
        """One prompt, one attempt: PermanentError, RetryableError or ServerUnavailable."""
        return parse_tokenize_response(self._post("/v1/tokenize", request.body()))

    def render_patiently(self, request: RenderRequest) -> list[int]:
        """One prompt, retried through outages (see the class); PermanentError is returned
        to the caller at once."""
        delays = Backoff(self.policy.backoff_s, self.policy.backoff_max_s).delays()
        while True:
            try:
                ids = self.render(request)
            except PermanentError:
                raise
            except GenerationError as exc:
                down_s = self._down_for(self._clock())
                if self.policy.wait_s <= 0:  # one attempt (the watchdog's preflight)
                    raise RenderServerUnavailable(
                        f"{self.base_url} did not answer /v1/tokenize: {exc}"
                    ) from exc
                if down_s >= self.policy.wait_s:
                    raise RenderServerUnavailable(
                        f"the render server {self.base_url} has not answered /v1/tokenize "
                        f"for {down_s:.0f}s (last error: {exc})"
                    ) from exc
                self._outage(exc)
                self._sleep(next(delays))
            else:
                self._outage(None)
                return ids

    def _down_for(self, now: float) -> float:
        """Seconds since the server stopped answering, its outage starting now if it answered."""
        with self._outage_lock:
            if self._down_since is None:
                self._down_since = now
            return now - self._down_since

    def _outage(self, exc: GenerationError | None) -> None:
        """One log line when an outage begins and one when it ends, whatever the window."""
        with self._outage_lock:
            began = exc is not None and not self._in_outage
            ended = exc is None and self._in_outage
            self._in_outage = exc is not None
            if exc is None:
                self._down_since = None
        if began:
            logger.warning(
                "render server %s: %s; retrying for up to %.0fs",
                self.base_url,
                exc,
                self.policy.wait_s,
                extra={"action": "render_server_down"},
            )
        elif ended:
            logger.info(
                "render server %s answers again",
                self.base_url,
                extra={"action": "render_server_up"},
            )

    def render_many(self, requests: Sequence[RenderRequest]) -> list[list[int] | PermanentError]:
        """Every prompt (in order) or the PermanentError of the one the server refused.

        At most `window` requests are in flight. RenderServerUnavailable if the server stays
        down too long: then nothing is returned, so nothing half-rendered is stored, and the
        requests not yet sent are not sent.
        """
        given_up: list[RenderServerUnavailable] = []

        def one(request: RenderRequest) -> list[int] | PermanentError:
            if given_up:
                raise given_up[0]
            try:
                return self.render_patiently(request)
            except PermanentError as exc:
                return exc
            except RenderServerUnavailable as exc:
                given_up.append(exc)
                raise

        return list(self._pool.map(one, requests))

    def probe_sha256(self) -> str:
        """sha256 of the server's prompt ids for RENDER_PROBE (refused ones by their error):
        what a run rendered by this server pins of its render."""
        answers: list[Any] = []
        for ids in self.render_many(RENDER_PROBE):
            answers.append(ids if isinstance(ids, list) else f"refused: {ids}")
        encoded = json.dumps(answers, separators=(",", ":")).encode()
        return hashlib.sha256(encoded).hexdigest()

    def server_version(self) -> str | None:
        """The SGLang version `/server_info` reports (None when it does not answer with one)."""
        for path in ("/server_info", "/get_server_info"):
            try:
                response = self._client.get(path)
                data = response.json() if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                continue
            if isinstance(data, dict) and isinstance(data.get("version"), str):
                return str(data["version"])
        return None

    def detokenize(self, rows: Sequence[Sequence[int]]) -> list[str]:
        """The text of each id list, special tokens kept (one request)."""
        if not rows:
            return []
        body = {"tokens": [list(r) for r in rows], "skip_special_tokens": False}
        data = json.loads(self._post("/v1/detokenize", body))
        texts = data.get("text") if isinstance(data, dict) else None
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or len(texts) != len(rows):
            raise RetryableError("/v1/detokenize answered an unexpected shape", status_code=200)
        return [str(t) for t in texts]


def render_client(url: str, settings: Settings, *, wait_s: float | None = None) -> RenderClient:
    """A render client of url with the window, timeouts, API key and patience of settings."""
    key = settings.sglang_api_key
    return RenderClient(
        url,
        window=settings.render_window,
        connect_timeout_s=settings.connect_timeout_s,
        timeout_s=settings.render_timeout_s,
        api_key=key.get_secret_value() if key else None,
        policy=RenderPolicy(
            wait_s=settings.render_wait_s if wait_s is None else wait_s,
            backoff_s=max(settings.retry_backoff_s, 0.1),
            backoff_max_s=max(settings.retry_backoff_max_s, 0.1),
        ),
    )

"""Unit tests of app.sglang: request bodies, response parsing and every error mapping.

Servers are faked with httpx.MockTransport; refused, stalled and reset connections use real
loopback sockets so the real httpx exceptions are the ones mapped.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from app.core.contracts import SamplingParams
from app.core.errors import (
    AuthRequired,
    BackPressure,
    GenerationError,
    PermanentError,
    RetryableError,
    ServerRefusal,
    ServerUnavailable,
)
from app.sglang.client import ProbeResult, SGLangClient
from app.sglang.errors import ERROR_MESSAGE_MAX_CHARS, map_abort, map_http_error, server_message

BASE_URL = "http://sglang.test:30000"
RID = "run1-item7-s0-a1"
PROMPT = [163587, 872, 163601, 3, 4, 5, 163586, 163588, 163601, 163606]
EOS, IM_END = 163585, 163586
TIMEOUTS: dict[str, Any] = {
    "connect_timeout_s": 2.0,
    "generate_timeout_s": 600.0,
    "info_timeout_s": 15.0,
    "probe_timeout_s": 25.0,
}

Handler = Callable[[httpx.Request], httpx.Response]


def make_client(handler: Handler, **overrides: Any) -> SGLangClient:
    kwargs: dict[str, Any] = {**TIMEOUTS, **overrides}
    return SGLangClient(BASE_URL, transport=httpx.MockTransport(handler), **kwargs)


def reply(status: int, body: Any = None, *, raw: bytes | None = None) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        if raw is not None:
            return httpx.Response(status, content=raw)
        if body is None:
            return httpx.Response(status)
        return httpx.Response(status, json=body)

    return handler


def generate_body(
    output_ids: list[int] | None = None,
    finish: dict[str, Any] | None = None,
    **meta: Any,
) -> dict[str, Any]:
    ids = [11, 12, 163607, 13, IM_END] if output_ids is None else output_ids
    meta_info: dict[str, Any] = {
        "id": RID,
        "finish_reason": finish or {"type": "stop", "matched": IM_END},
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(ids),
        "cached_tokens": 4,
        "e2e_latency": 1.25,
        "weight_version": "default",
        "reasoning_tokens": 2,
    }
    meta_info.update(meta)
    return {"text": "x", "output_ids": ids, "meta_info": meta_info}


def run_generate(handler: Handler, **kwargs: Any) -> Any:
    with make_client(handler) as client:
        return client.generate(PROMPT, SamplingParams().for_sample(0), RID, **kwargs)


# --- request bodies ----------------------------------------------------------------------


def test_generate_sends_the_native_body_with_explicit_timeouts() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=generate_body())

    params = SamplingParams(seed=7, stop_token_ids=(EOS, IM_END)).for_sample(2)
    with make_client(handler) as client:
        client.generate(PROMPT, params, RID)
        client.generate(PROMPT, params, RID, return_prompt_token_ids=True)

    plain, echoed = (json.loads(r.content) for r in seen)
    assert seen[0].method == "POST"
    assert seen[0].url == httpx.URL(BASE_URL + "/generate")
    assert seen[0].headers["content-type"] == "application/json"
    assert plain == {"input_ids": PROMPT, "sampling_params": params, "rid": RID, "stream": False}
    assert plain["sampling_params"]["sampling_seed"] == 9
    assert echoed == {**plain, "return_prompt_token_ids": True}
    assert seen[0].extensions["timeout"] == {
        "connect": 2.0,
        "read": 600.0,
        "write": 600.0,
        "pool": 600.0,
    }


def test_empty_input_is_refused_without_a_request() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("nothing may be sent")

    with make_client(handler) as client, pytest.raises(PermanentError, match="empty"):
        client.generate([], {}, RID)


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="generate_timeout_s"):
        SGLangClient(BASE_URL, **{**TIMEOUTS, "generate_timeout_s": 0})
    with pytest.raises(ValueError, match="max_connections"):
        SGLangClient(BASE_URL, **TIMEOUTS, max_connections=0)


def test_closed_client_cannot_send() -> None:
    client = make_client(reply(200, generate_body()))
    with client:
        pass
    with pytest.raises(RuntimeError):
        client.generate(PROMPT, {}, RID)


# --- successful answers ------------------------------------------------------------------


def test_stop_on_eos_keeps_the_matched_token_as_last_output_id() -> None:
    result = run_generate(reply(200, generate_body()))
    assert result.rid == RID
    assert result.output_ids == [11, 12, 163607, 13, IM_END]
    assert result.output_ids[-1] == IM_END
    assert result.finish_reason == "stop"
    assert result.matched_stop == IM_END
    assert not result.truncated
    assert result.prompt_tokens == len(PROMPT)
    assert result.completion_tokens == 5
    assert result.cached_tokens == 4
    assert result.e2e_latency_s == 1.25
    assert result.weight_version == "default"
    assert result.prompt_token_ids is None
    assert result.text == "x"


def test_length_is_a_truncated_success() -> None:
    body = generate_body(output_ids=[1, 2, 3], finish={"type": "length", "length": 3})
    result = run_generate(reply(200, body))
    assert result.finish_reason == "length"
    assert result.truncated
    assert result.matched_stop is None
    assert result.output_ids == [1, 2, 3]


@pytest.mark.parametrize(
    ("matched", "expected"),
    [
        (IM_END, IM_END),
        ("</answer>", "</answer>"),
        (None, None),
        ([EOS], EOS),
        ([7, 8], "[7, 8]"),
    ],
)
def test_matched_stop_shapes(matched: Any, expected: int | str | None) -> None:
    body = generate_body(finish={"type": "stop", "matched": matched})
    assert run_generate(reply(200, body)).matched_stop == expected


def test_prompt_token_ids_echo_is_returned() -> None:
    body = {**generate_body(), "prompt_token_ids": PROMPT}
    result = run_generate(reply(200, body), return_prompt_token_ids=True)
    assert result.prompt_token_ids == PROMPT


def test_minimal_answer_uses_defaults() -> None:
    body = {"output_ids": [5, EOS], "meta_info": {"finish_reason": {"type": "stop"}}}
    result = run_generate(reply(200, body))
    assert result.prompt_tokens == len(PROMPT)
    assert result.completion_tokens == 2
    assert result.cached_tokens == 0
    assert result.weight_version is None
    assert result.e2e_latency_s >= 0.0
    assert result.text == ""


def test_completion_count_mismatch_is_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="app.sglang"):
        result = run_generate(reply(200, generate_body(completion_tokens=9)))
    assert result.output_ids[-1] == IM_END
    assert "completion_tokens 9 but 5 output_ids" in caplog.text


# --- HTTP 200 that is not a success ------------------------------------------------------

ABORT = {"type": "abort", "err_type": None}

BAD_200: list[tuple[str, bytes | Any, type[GenerationError], str, int | None]] = [
    # (case, body, error, message part, status_code on the error)
    ("plain abort", generate_body(finish={**ABORT, "message": "Abort in waiting queue"}),
     RetryableError, "request aborted: Abort in waiting queue", None),
    ("abort without message", generate_body(finish={"type": "abort"}),
     RetryableError, "request aborted", None),
    ("abort queue full 503",
     generate_body(finish={**ABORT, "message": "The request queue is full.", "status_code": 503}),
     BackPressure, "queue is full", 503),
    ("abort 503 no message", generate_body(finish={**ABORT, "status_code": 503}),
     ServerUnavailable, "HTTP 503", 503),
    ("abort shutting down", generate_body(finish={**ABORT, "message": "Server is shutting down"}),
     ServerUnavailable, "shutting down", None),
    ("abort 400 too long",
     generate_body(finish={**ABORT, "message": "The input (9 tokens) is longer than the model's "
                           "context length (8 tokens).", "status_code": 400,
                           "err_type": "BadRequestError"}),
     ServerRefusal, "longer than the model's context length", 400),
    ("abort 500", generate_body(finish={**ABORT, "message": "boom", "status_code": 500}),
     RetryableError, "HTTP 500: request aborted: boom", 500),
    ("not JSON", b'{"text": "x", "output_ids": [1, 2', RetryableError, "not JSON", 200),
    ("JSON list (batch answer)", [generate_body()], RetryableError, "expected an object", 200),
    ("no meta_info", {"output_ids": [1]}, RetryableError, "no meta_info", 200),
    ("no finish_reason", generate_body(finish_reason=None), RetryableError,
     "no meta_info.finish_reason", 200),
    ("unknown finish type", generate_body(finish={"type": "paused"}), RetryableError,
     "unknown finish_reason.type", 200),
    ("output_ids of strings", generate_body(output_ids=["a"]), RetryableError,  # type: ignore[list-item]
     "output_ids is not a list of ints", 200),
    ("output_ids of bools", generate_body(output_ids=[True]), RetryableError,
     "output_ids is not a list of ints", 200),
    ("output_ids missing", {"meta_info": generate_body()["meta_info"]}, RetryableError,
     "output_ids", 200),
    ("rid echo mismatch", generate_body(id="someone-else"), RetryableError,
     "is not the rid sent", 200),
    ("bad prompt echo", {**generate_body(), "prompt_token_ids": "1 2 3"}, RetryableError,
     "prompt_token_ids", 200),
    ("negative count", generate_body(cached_tokens=-1), RetryableError, "cached_tokens", 200),
    ("bad matched", generate_body(finish={"type": "stop", "matched": {"x": 1}}), RetryableError,
     "matched", 200),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "error", "part", "status"), [c[1:] for c in BAD_200], ids=[c[0] for c in BAD_200]
)
def test_http_200_failures(
    body: Any, error: type[GenerationError], part: str, status: int | None
) -> None:
    handler = reply(200, raw=body) if isinstance(body, bytes) else reply(200, body)
    with pytest.raises(error) as caught:
        run_generate(handler)
    assert type(caught.value) is error
    assert part in caught.value.message
    assert getattr(caught.value, "status_code", None) == status


# --- HTTP error statuses -----------------------------------------------------------------

QUEUE_FULL = {"object": "error", "message": "The request queue is full.", "type": "503",
              "code": 503}  # fmt: skip
TOO_LONG = "The input (9000 tokens) is longer than the model's context length (8192 tokens)."

STATUSES: list[tuple[str, int, Any, type[GenerationError], str]] = [
    ("400 schema error", 400, {"error": "unknown field `foo`, expected one of `max_new_tokens`"},
     PermanentError, "HTTP 400: unknown field `foo`"),
    ("400 too long", 400, {"error": {"message": TOO_LONG}}, ServerRefusal, TOO_LONG),
    ("400 message", 400, {"message": "input_ids cannot be empty."}, PermanentError,
     "HTTP 400: input_ids cannot be empty."),
    ("400 plain text", 400, b"bad request", PermanentError, "HTTP 400: bad request"),
    ("400 fastapi detail", 400, {"detail": "nope"}, PermanentError, "HTTP 400: nope"),
    ("401 no or wrong API key", 401, {"error": "Unauthorized"}, AuthRequired,
     "TOKENMILL_SGLANG_API_KEY"),
    ("403", 403, b"Forbidden", AuthRequired, "HTTP 403: Forbidden"),
    ("404", 404, {"detail": "Not Found"}, PermanentError, "HTTP 404: Not Found"),
    ("405", 405, {"detail": "Method Not Allowed"}, PermanentError, "HTTP 405"),
    ("422", 422, {"detail": [{"loc": ["body"], "msg": "x"}]}, PermanentError, "HTTP 422"),
    ("413", 413, b"", PermanentError, "HTTP 413"),
    ("408", 408, b"", RetryableError, "HTTP 408"),
    ("429", 429, {"error": "slow down"}, BackPressure, "HTTP 429: slow down"),
    ("503 empty (loading/shutting down)", 503, b"", ServerUnavailable, "HTTP 503"),
    ("503 queue full", 503, QUEUE_FULL, BackPressure, "HTTP 503: The request queue is full."),
    ("503 loading", 503, {"message": "Server is loading"}, ServerUnavailable, "loading"),
    ("500 plain text", 500, b"Internal Server Error", RetryableError,
     "HTTP 500: Internal Server Error"),
    ("500 error object", 500, {"object": "error", "message": "scheduler died", "code": 500},
     RetryableError, "scheduler died"),
    ("502", 502, b"<html>Bad Gateway</html>", RetryableError, "HTTP 502"),
    ("504", 504, b"", RetryableError, "HTTP 504"),
    ("507", 507, b"", RetryableError, "HTTP 507"),
    ("302 redirect", 302, b"", RetryableError, "unexpected HTTP 302"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("status", "body", "error", "part"), [c[1:] for c in STATUSES], ids=[c[0] for c in STATUSES]
)
def test_http_statuses(status: int, body: Any, error: type[GenerationError], part: str) -> None:
    handler = reply(status, raw=body) if isinstance(body, bytes) else reply(status, body)
    with pytest.raises(error) as caught:
        run_generate(handler)
    assert type(caught.value) is error
    assert part in caught.value.message
    assert getattr(caught.value, "status_code", None) == status
    # the same decision straight from the mapping function
    raw = body if isinstance(body, bytes) else json.dumps(body)
    assert type(map_http_error(status, raw)) is error


def test_error_messages_are_short_and_carry_no_token_arrays() -> None:
    echo = {"error": f"bad input_ids {list(range(100_000, 102_000))} " + "x" * 3000}
    with pytest.raises(PermanentError) as caught:
        run_generate(reply(400, echo))
    message = caught.value.message
    assert len(message) <= len("HTTP 400: ") + ERROR_MESSAGE_MAX_CHARS
    assert "100000, 100001" not in message
    assert "<2000 ints>" in message


def test_server_message_shapes() -> None:
    assert server_message(None) == ""
    assert server_message(b"") == ""
    assert server_message('{"error": "a"}') == "a"
    assert server_message(b'{"error": {"message": "b", "code": 400}}') == "b"
    assert server_message(b'{"message": "c"}') == "c"
    assert server_message(b'{"other": 1}') == '{"other": 1}'
    assert server_message(b"{not json") == "{not json"
    assert server_message(b"line one\n  line two\n") == "line one line two"
    assert server_message(b"\xff\xfe oops") == "\ufffd\ufffd oops"


@pytest.mark.parametrize(
    ("finish", "error"),
    [
        ({"type": "abort"}, RetryableError),
        ({"type": "abort", "message": "Abort before prefill"}, RetryableError),
        ({"type": "abort", "message": "server shutdown"}, ServerUnavailable),
        ({"type": "abort", "status_code": 503, "message": "The request queue is full."},
         BackPressure),
        ({"type": "abort", "status_code": 503}, ServerUnavailable),
        ({"type": "abort", "status_code": 400, "message": "bad"}, PermanentError),
        ({"type": "abort", "status_code": 429}, BackPressure),
        ({"type": "abort", "status_code": 500}, RetryableError),
        ({"type": "abort", "status_code": 200, "message": "ok?"}, RetryableError),
        ({"type": "abort", "status_code": "503"}, RetryableError),
    ],
)  # fmt: skip
def test_map_abort(finish: dict[str, Any], error: type[GenerationError]) -> None:
    assert type(map_abort(finish)) is error


def test_status_none_without_exception() -> None:
    assert type(map_http_error(None, None)) is RetryableError
    assert type(map_http_error(None, "Server is loading")) is ServerUnavailable


# --- transport failures ------------------------------------------------------------------

TRANSPORT: list[tuple[type[Exception], type[GenerationError]]] = [
    (httpx.ConnectError, ServerUnavailable),
    (httpx.ConnectTimeout, ServerUnavailable),
    (httpx.ReadTimeout, RetryableError),
    (httpx.WriteTimeout, RetryableError),
    (httpx.PoolTimeout, RetryableError),
    (httpx.RemoteProtocolError, RetryableError),
    (httpx.ReadError, RetryableError),
    (httpx.WriteError, RetryableError),
    (httpx.CloseError, RetryableError),
    (httpx.LocalProtocolError, RetryableError),
    (httpx.ProxyError, RetryableError),
    (httpx.UnsupportedProtocol, RetryableError),
]


@pytest.mark.parametrize(("exc_type", "error"), TRANSPORT, ids=[t.__name__ for t, _ in TRANSPORT])
def test_transport_errors(exc_type: type[Exception], error: type[GenerationError]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc_type("simulated", request=request)  # type: ignore[call-arg]

    with pytest.raises(error) as caught:
        run_generate(handler)
    assert type(caught.value) is error
    assert isinstance(caught.value.__cause__, exc_type)
    assert exc_type.__name__ in caught.value.message
    assert getattr(caught.value, "status_code", 0) is None
    assert type(map_http_error(None, None, exc_type("x"))) is error


def test_unknown_exception_is_retryable() -> None:
    assert type(map_http_error(None, None, OSError("odd"))) is RetryableError


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def real_client(port: int, **overrides: Any) -> SGLangClient:
    return SGLangClient(f"http://127.0.0.1:{port}", **{**TIMEOUTS, **overrides})


def test_refused_connection_is_server_unavailable() -> None:
    with real_client(closed_port()) as client:
        with pytest.raises(ServerUnavailable, match="cannot connect") as caught:
            client.generate(PROMPT, {}, RID)
        assert isinstance(caught.value.__cause__, httpx.ConnectError)
        probe = client.health()
        assert not probe.ok
        assert probe.status_code is None
        assert probe.error is not None and "ConnectError" in probe.error
        assert not client.ready()
        with pytest.raises(ServerUnavailable):
            client.fingerprint()
        assert client.abort(RID) is False


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A listening socket that never answers: connects succeed, reads time out."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def test_stalled_server_read_timeout_is_retryable(silent_server: int) -> None:
    with real_client(silent_server, generate_timeout_s=0.2) as client:
        with pytest.raises(RetryableError, match="timed out") as caught:
            client.generate(PROMPT, {}, RID)
        assert isinstance(caught.value.__cause__, httpx.ReadTimeout)


def test_stalled_probe_times_out_with_probe_timeout(silent_server: int) -> None:
    with real_client(silent_server, probe_timeout_s=0.2) as client:
        probe = client.health()
    assert probe == ProbeResult(False, None, probe.latency_s, probe.error)
    assert 0.15 < probe.latency_s < 5
    assert probe.error is not None and "ReadTimeout" in probe.error


@pytest.fixture
def hangup_server() -> Iterator[int]:
    """Accepts one connection, reads the request, and closes it without answering."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(5)

    def serve() -> None:
        try:
            conn, _addr = sock.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    sock.close()
    thread.join(timeout=5)


def test_connection_closed_mid_request_is_retryable(hangup_server: int) -> None:
    with (
        real_client(hangup_server) as client,
        pytest.raises(RetryableError, match="connection lost") as caught,
    ):
        client.generate(PROMPT, {}, RID)
    assert isinstance(caught.value.__cause__, httpx.RemoteProtocolError | httpx.ReadError)


# --- health, info, fingerprint, abort ----------------------------------------------------


def test_health_probe_results() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/health_generate":
            return httpx.Response(200)
        return httpx.Response(503)

    with make_client(handler) as client:
        good = client.health()
        bad = client.health("/health")
    assert good.ok and good.status_code == 200 and good.error is None and good.latency_s >= 0
    assert not bad.ok and bad.status_code == 503 and bad.error == "HTTP 503"
    assert seen[0].method == "GET"
    assert seen[0].extensions["timeout"]["read"] == 25.0
    assert seen[0].extensions["timeout"]["connect"] == 2.0


def test_ready() -> None:
    with make_client(reply(200, {})) as client:
        assert client.ready() is True
    with make_client(reply(503)) as client:
        assert client.ready() is False


MODEL_INFO = {
    "model_path": "moonshotai/Kimi-K2.5",
    "tokenizer_path": "moonshotai/Kimi-K2.5",
    "is_generation": True,
    "preferred_sampling_params": None,
    "weight_version": "default",
    "reasoning_parser": "kimi_k2",
    "tool_call_parser": None,
    "model_type": "kimi_k25",
    "architectures": ["KimiK25ForConditionalGeneration"],
}
SERVER_INFO = {
    "model_path": "moonshotai/Kimi-K2.5",
    "tp_size": 8,
    "dtype": "auto",
    "context_length": None,
    "internal_states": [{"whatever": 1}],
    "version": "0.5.23",
}


def info_handler(paths: dict[str, Any], seen: list[str] | None = None) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request.url.path)
        if request.url.path in paths:
            return httpx.Response(200, json=paths[request.url.path])
        return httpx.Response(404, json={"detail": "Not Found"})

    return handler


def test_fingerprint_and_version_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    handler = info_handler({"/model_info": MODEL_INFO, "/server_info": SERVER_INFO})
    with caplog.at_level(logging.INFO, logger="app.sglang"), make_client(handler) as client:
        first = client.fingerprint()
        second = client.fingerprint()
    assert first == second
    assert first.model_path == "moonshotai/Kimi-K2.5"
    assert first.weight_version == "default"
    assert first.reasoning_parser == "kimi_k2"
    assert first.version == "0.5.23"
    assert first.extra["model_type"] == "kimi_k25"
    assert first.extra["server_args"] == {"tp_size": 8, "dtype": "auto", "context_length": None}
    assert "internal_states" not in json.dumps(first.extra)
    version_lines = [r for r in caplog.records if "runs version 0.5.23" in r.getMessage()]
    assert len(version_lines) == 1
    assert version_lines[0].levelno == logging.INFO


def test_info_falls_back_to_legacy_routes_on_404() -> None:
    seen: list[str] = []
    handler = info_handler({"/get_model_info": MODEL_INFO, "/get_server_info": SERVER_INFO}, seen)
    with make_client(handler) as client:
        assert client.fingerprint().version == "0.5.23"
    assert seen == ["/model_info", "/get_model_info", "/server_info", "/get_server_info"]


def test_info_uses_info_timeout() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=SERVER_INFO)

    with make_client(handler) as client:
        client.server_info()
    assert seen[0].extensions["timeout"] == {
        "connect": 2.0,
        "read": 15.0,
        "write": 15.0,
        "pool": 15.0,
    }


@pytest.mark.parametrize(
    ("handler", "error"),
    [
        (reply(500, raw=b"scheduler hung"), RetryableError),
        (reply(503), ServerUnavailable),
        (reply(404, {"detail": "Not Found"}), PermanentError),
        (reply(200, raw=b"<html>"), RetryableError),
        (reply(200, ["not", "a", "dict"]), RetryableError),
    ],
    ids=["500", "503", "404 on both routes", "not JSON", "not an object"],
)
def test_info_failures(handler: Handler, error: type[GenerationError]) -> None:
    with make_client(handler) as client, pytest.raises(error):
        client.model_info()


def test_abort_posts_the_rid() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    with make_client(handler) as client:
        assert client.abort(RID) is True
    assert seen[0].method == "POST"
    assert seen[0].url.path == "/abort_request"
    assert json.loads(seen[0].content) == {"rid": RID}


def test_abort_failures_are_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="app.sglang"),
        make_client(reply(500, raw=b"nope")) as client,
    ):
        assert client.abort(RID) is False
    assert "refused: HTTP 500: nope" in caplog.text

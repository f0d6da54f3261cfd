"""The render client's logic over a scripted transport: bodies, order, per-prompt refusals,
waiting out an outage, giving up after the wait; and parity's comparison and sampling."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from app.core.errors import PermanentError, RetryableError
from app.sglang.render import (
    RenderClient,
    RenderPolicy,
    RenderServerUnavailable,
    parse_tokenize_response,
    prompt_request,
)
from workers.control.parity import Mismatch, ParityReport, first_difference


class Script:
    """Answers /v1/tokenize with the prompt's first content's length as ids; a prompt whose
    content is "bad" gets a 400; the first `down` requests are refused (connection errors)."""

    def __init__(self, down: int = 0) -> None:
        self.down = down
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            if self.down > 0:
                self.down -= 1
                raise httpx.ConnectError("refused", request=request)
            body = json.loads(request.content)
            self.bodies.append(body)
        if request.url.path == "/v1/detokenize":
            return httpx.Response(200, json={"text": [str(t) for t in body["tokens"]]})
        text = body["messages"][0]["content"]
        if text == "bad":
            error = {"object": "error", "message": "template says no", "type": "x", "code": 400}
            return httpx.Response(400, json=error)
        ids = list(range(len(text)))
        return httpx.Response(200, json={"tokens": ids, "count": len(ids), "max_model_len": 99})


def make(script: Script, wait_s: float = 60.0) -> RenderClient:
    return RenderClient(
        "http://render",
        window=4,
        connect_timeout_s=1,
        timeout_s=1,
        policy=RenderPolicy(wait_s=wait_s, backoff_s=0.001, backoff_max_s=0.002),
        sleep=lambda s: None,
        transport=httpx.MockTransport(script),
    )


def test_bodies_omit_the_generation_prompt_and_carry_tools_and_kwargs() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = prompt_request([{"role": "user", "content": "hi"}], {"thinking": False}, tools=tools)
    assert body.body() == {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": tools,
        "chat_template_kwargs": {"thinking": False},
    }
    assert prompt_request([{"role": "user", "content": "hi"}], {}).body() == {
        "messages": [{"role": "user", "content": "hi"}]
    }


def test_render_many_keeps_order_and_returns_refusals_per_prompt() -> None:
    script = Script()
    texts = ["a", "bbb", "bad", "cc"] * 5
    with make(script) as client:
        out = client.render_many(
            [prompt_request([{"role": "user", "content": t}], {}) for t in texts]
        )
    for text, ids in zip(texts, out, strict=True):
        if text == "bad":
            assert isinstance(ids, PermanentError) and "template says no" in str(ids)
        else:
            assert ids == list(range(len(text)))


class Slow(Script):
    """A Script whose answers take a while, recording how many requests were in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = self.peak = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            threading.Event().wait(0.02)
            return super().__call__(request)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_render_many_keeps_the_window_full_and_never_past_it() -> None:
    script = Slow()
    requests = [prompt_request([{"role": "user", "content": "x" * i}], {}) for i in range(40)]
    with make(script) as client:
        assert client.render_many(requests) == [list(range(i)) for i in range(40)]
    assert script.peak == client.window == 4


def test_an_outage_shorter_than_the_wait_is_waited_out() -> None:
    script = Script(down=7)
    with make(script) as client:
        out = client.render_many([prompt_request([{"role": "user", "content": "xy"}], {})] * 3)
    assert out == [[0, 1]] * 3


def test_an_outage_longer_than_the_wait_raises() -> None:
    script = Script(down=10**6)
    with (
        make(script, wait_s=0.0) as client,
        pytest.raises(RenderServerUnavailable, match="http://render"),
    ):
        client.render_many([prompt_request([{"role": "user", "content": "xy"}], {})])


def test_an_outage_is_waited_out_once_for_all_requests_then_the_rest_are_not_sent() -> None:
    """The wait is the server's, not each request's: 64 prompts through a window of 4 give up
    after one wait, the prompts not yet sent never sent (64 waits of their own took minutes)."""
    script = Script(down=10**6)
    now = [0.0]
    lock = threading.Lock()

    def sleep(s: float) -> None:
        with lock:
            now[0] += s

    client = RenderClient(
        "http://render",
        window=4,
        connect_timeout_s=1,
        timeout_s=1,
        policy=RenderPolicy(wait_s=30.0, backoff_s=1.0, backoff_max_s=4.0),
        sleep=sleep,
        clock=lambda: now[0],
        transport=httpx.MockTransport(script),
    )
    requests = [prompt_request([{"role": "user", "content": "xy"}], {})] * 64
    with client, pytest.raises(RenderServerUnavailable, match="has not answered /v1/tokenize for"):
        client.render_many(requests)
    attempts = 10**6 - script.down
    assert now[0] < 30.0 + 4 * 4.0  # one wait (and the backoffs in flight when it ended)
    assert attempts < len(requests), attempts


def test_a_malformed_answer_is_retryable() -> None:
    with pytest.raises(RetryableError):
        parse_tokenize_response(b'{"tokens": [1, "x"], "count": 2}')
    with pytest.raises(RetryableError):
        parse_tokenize_response(b'{"tokens": [1, 2], "count": 3}')
    assert parse_tokenize_response(b'{"tokens": [1, 2], "count": 2, "max_model_len": 9}') == [1, 2]


def test_detokenize_sends_rows_with_special_tokens_kept() -> None:
    script = Script()
    with make(script) as client:
        assert client.detokenize([[1, 2], [3]]) == ["[1, 2]", "[3]"]
    assert script.bodies[-1] == {"tokens": [[1, 2], [3]], "skip_special_tokens": False}


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([1, 2, 3], [1]) == 1
    assert first_difference([], []) is None


def test_a_report_is_unchecked_when_the_server_refused_every_prompt() -> None:
    def mismatch(position: int | None) -> Mismatch:
        return Mismatch(1, "k", 0, 0, position, 10, 0 if position is None else 11, error="x")

    assert ParityReport("r", "s", checked=2, equal=2).status == "equal"
    refused = ParityReport("r", "s", checked=2, mismatches=[mismatch(None), mismatch(None)])
    assert refused.status == "unchecked"
    assert ParityReport("r", "s", 2, 0, [mismatch(None), mismatch(4)]).status == "differs"
    assert ParityReport("r", "s", 2, 1, [mismatch(None)]).status == "differs"

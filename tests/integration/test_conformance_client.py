"""Conformance of app.sglang with SGLang's published JSON contract (sglang/api/v1/api_types.py).

Every body the client really sends is decoded by the contract's GenerateRequest (the server's
400 gate); sample server answers are decoded by GenerateResponse and by the client, which agree.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from app.core.contracts import SamplingParams
from app.core.errors import (
    BackPressure,
    GenerationError,
    RetryableError,
    ServerRefusal,
    ServerUnavailable,
)
from app.sglang.client import SGLangClient
from app.sglang.errors import server_message
from tests.support.sglang_contract import load_contract

PROMPT = [163587, 872, 163601, 3, 4, 5, 163586, 163588, 163601, 163606]
EOS, IM_END, THINK_END = 163585, 163586, 163607
TIMEOUTS: dict[str, Any] = {
    "connect_timeout_s": 2.0,
    "generate_timeout_s": 60.0,
    "info_timeout_s": 10.0,
    "probe_timeout_s": 25.0,
}


@pytest.fixture(scope="module")
def contract() -> Any:
    return load_contract()


def captured_body(
    sampling: SamplingParams, sample_index: int, rid: str, **kwargs: Any
) -> dict[str, Any]:
    """The JSON body the client puts on the wire for one generate call."""
    sent: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        answer = {
            "output_ids": [IM_END],
            "meta_info": {"id": rid, "finish_reason": {"type": "stop", "matched": IM_END}},
        }
        return httpx.Response(200, json=answer)

    transport = httpx.MockTransport(handler)
    with SGLangClient("http://sglang.test", transport=transport, **TIMEOUTS) as client:
        client.generate(PROMPT, sampling.for_sample(sample_index), rid, **kwargs)
    assert len(sent) == 1
    body: dict[str, Any] = json.loads(sent[0])
    return body


REQUESTS: list[tuple[str, SamplingParams, int, dict[str, Any]]] = [
    ("single, defaults", SamplingParams(), 0, {}),
    ("with seed", SamplingParams(seed=1234), 3, {}),
    ("with stop_token_ids", SamplingParams(stop_token_ids=(EOS, IM_END)), 0, {}),
    ("with return_prompt_token_ids", SamplingParams(), 0, {"return_prompt_token_ids": True}),
    (
        "greedy, every option",
        SamplingParams(
            max_new_tokens=32768,
            temperature=0.0,
            top_p=0.95,
            top_k=20,
            min_p=0.05,
            seed=0,
            repetition_penalty=1.05,
            frequency_penalty=0.1,
            presence_penalty=0.2,
            stop_token_ids=(IM_END,),
            ignore_eos=True,
        ),
        1,
        {"return_prompt_token_ids": True},
    ),
]


@pytest.mark.parametrize(
    ("sampling", "sample_index", "kwargs"), [r[1:] for r in REQUESTS], ids=[r[0] for r in REQUESTS]
)
def test_every_request_body_passes_the_server_schema(
    contract: Any, sampling: SamplingParams, sample_index: int, kwargs: dict[str, Any]
) -> None:
    rid = f"run-item-s{sample_index}-a1"
    body = captured_body(sampling, sample_index, rid, **kwargs)
    decoded = contract.GenerateRequest.from_json_value(body)

    assert decoded.input_ids == PROMPT
    assert decoded.rid == rid
    assert decoded.stream is False
    assert decoded.text is None
    assert decoded.return_prompt_token_ids is bool(kwargs.get("return_prompt_token_ids"))
    params = decoded.sampling_params
    expected = sampling.for_sample(sample_index)
    for key, value in expected.items():
        assert getattr(params, key) == value, key
    assert params.n == 1
    if sampling.seed is None:
        assert params.sampling_seed is None
    else:
        assert params.sampling_seed == sampling.seed + sample_index
    # the contract's own encoding of what it decoded carries every value the client sent
    reencoded = decoded.to_json_value()
    for key, value in expected.items():
        assert reencoded["sampling_params"][key] == value, key


def test_the_gate_is_live(contract: Any) -> None:
    """A body the server would reject with HTTP 400 is rejected here too."""
    body = captured_body(SamplingParams(), 0, "r")
    body["sampling_params"]["seed"] = 1
    with pytest.raises(contract.JsonContractError, match="unknown field `seed`"):
        contract.GenerateRequest.from_json_value(body)
    body = captured_body(SamplingParams(), 0, "r")
    body["input_ids"] = ["1"]
    with pytest.raises(contract.JsonContractError):
        contract.GenerateRequest.from_json_value(body)


# --- responses: the contract and the client read the same thing ---------------------------

RID = "run-item-s0-a1"
META = {
    "id": RID,
    "prompt_tokens": len(PROMPT),
    "cached_tokens": 7,
    "e2e_latency": 12.5,
    "weight_version": "default",
    "reasoning_tokens": 3,
}
STOP_IDS = [101, 102, 103, THINK_END, 104, IM_END]
SUCCESSES: list[tuple[str, dict[str, Any]]] = [
    (
        "stop on <|im_end|>",
        {
            "text": "abc",
            "output_ids": STOP_IDS,
            "meta_info": {
                **META,
                "finish_reason": {"type": "stop", "matched": IM_END},
                "completion_tokens": len(STOP_IDS),
            },
        },
    ),
    (
        "stop on a string",
        {
            "text": "abc",
            "output_ids": [101, 102],
            "meta_info": {
                **META,
                "finish_reason": {"type": "stop", "matched": "</answer>"},
                "completion_tokens": 2,
            },
        },
    ),
    (
        "length",
        {
            "text": "abc",
            "output_ids": [101, 102, 103, 104],
            "meta_info": {
                **META,
                "finish_reason": {"type": "length", "length": 4},
                "completion_tokens": 4,
            },
        },
    ),
    (
        "stop with prompt echo",
        {
            "text": "",
            "output_ids": [EOS],
            "prompt_token_ids": PROMPT,
            "meta_info": {
                **META,
                "finish_reason": {"type": "stop", "matched": EOS},
                "completion_tokens": 1,
            },
        },
    ),
]


def client_reading(answer: Any, status: int = 200) -> SGLangClient:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=answer))
    return SGLangClient("http://sglang.test", transport=transport, **TIMEOUTS)


@pytest.mark.parametrize("answer", [s[1] for s in SUCCESSES], ids=[s[0] for s in SUCCESSES])
def test_successful_answers_agree(contract: Any, answer: dict[str, Any]) -> None:
    decoded = contract.GenerateResponse.from_json_value(answer)
    with client_reading(answer) as client:
        result = client.generate(PROMPT, SamplingParams().for_sample(0), RID)

    meta = decoded.meta_info
    assert result.rid == meta.id
    assert result.output_ids == decoded.output_ids
    assert result.completion_tokens == meta.completion_tokens == len(decoded.output_ids)
    assert result.prompt_tokens == meta.prompt_tokens
    assert result.cached_tokens == meta.cached_tokens
    assert result.e2e_latency_s == meta.e2e_latency
    assert result.weight_version == meta.weight_version
    assert result.prompt_token_ids == decoded.prompt_token_ids
    assert result.text == decoded.text
    if isinstance(meta.finish_reason, contract.FinishStop):
        assert result.finish_reason == "stop" and not result.truncated
        assert result.matched_stop == meta.finish_reason.matched
    else:
        assert isinstance(meta.finish_reason, contract.FinishLength)
        assert result.finish_reason == "length" and result.truncated
        assert meta.finish_reason.length == len(result.output_ids)


ABORTS: list[tuple[str, dict[str, Any], type[GenerationError]]] = [
    (
        "abort by /abort_request",
        {"type": "abort", "message": "Abort in waiting queue", "status_code": None},
        RetryableError,
    ),
    (
        "abort, queue full",
        {"type": "abort", "message": "The request queue is full.", "status_code": 503},
        BackPressure,
    ),
    ("abort, unavailable", {"type": "abort", "message": "", "status_code": 503}, ServerUnavailable),
    (
        "abort, input too long",
        {
            "type": "abort",
            "message": "The input (9 tokens) is longer than the model's context length (8 tokens).",
            "status_code": 400,
            "err_type": "BadRequestError",
        },
        # the server's context decides it: final once a second server of the run agrees
        ServerRefusal,
    ),
]


@pytest.mark.parametrize(("finish", "error"), [a[1:] for a in ABORTS], ids=[a[0] for a in ABORTS])
def test_abort_answers_agree(
    contract: Any, finish: dict[str, Any], error: type[GenerationError]
) -> None:
    answer = {
        "text": "",
        "output_ids": [],
        "meta_info": {**META, "finish_reason": finish, "completion_tokens": 0},
    }
    decoded = contract.GenerateResponse.from_json_value(answer)
    abort = decoded.meta_info.finish_reason
    assert isinstance(abort, contract.FinishAbort)

    with client_reading(answer) as client, pytest.raises(error) as caught:
        client.generate(PROMPT, SamplingParams().for_sample(0), RID)
    assert type(caught.value) is error
    assert getattr(caught.value, "status_code", None) == abort.status_code
    if abort.message:
        assert abort.message in caught.value.message


@pytest.mark.parametrize(
    "body",
    [
        {"object": "error", "message": "The request queue is full.", "type": "503", "code": 503},
        {"message": "scheduler abort", "code": 500},
    ],
)
def test_error_bodies_agree(contract: Any, body: dict[str, Any]) -> None:
    decoded = contract.ErrorBody.from_json_value(body)
    assert server_message(json.dumps(body)) == decoded.message

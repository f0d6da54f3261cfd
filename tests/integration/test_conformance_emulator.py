"""The emulator against SGLang's published contract (sglang/api/v1/api_types.py, sglang 0.5.23).

Every body the emulator is sent is judged by the contract's GenerateRequest exactly as the emulator
judges it (same verdict, same 400 text); every shape it answers decodes as the contract's types.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import httpx
import pytest

from app.sglang.schema import SAMPLING_FIELDS, SchemaViolation, check_generate_request
from emulator.config import KIMI_IM_END_ID, EmulatorConfig
from tests.support.emulator import EmulatorProcess, running_emulator
from tests.support.sglang_contract import decode_response, load_contract, validate_request

Json = dict[str, Any]
CFG = EmulatorConfig(port=0, step_ms=2, max_running=2, max_queued=3, median_tokens=20)

# what tokenmill's client sends: every sampling value explicit, a unique rid, prompt ids echoed
CLIENT_BODY: Json = {
    "rid": "run1-item7-s0-a1",
    "input_ids": [163587, 1200, 1300, 163601, 163586, 163588, 1400, 163601, 163606],
    "sampling_params": {
        "max_new_tokens": 64,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "stop_token_ids": [163586],
        "sampling_seed": 1234,
    },
    "return_prompt_token_ids": True,
}
STOP_BODY: Json = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4000}}
LENGTH_BODY: Json = {
    "input_ids": [1, 2, 3],
    "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
}
BATCH_BODY: Json = {
    "rid": "b",
    "input_ids": [[1], [2, 3]],
    "sampling_params": [{"max_new_tokens": 5}, {"max_new_tokens": 6, "temperature": 0}],
}
STREAM_BODY: Json = {"input_ids": [4, 5], "stream": True, "sampling_params": {"max_new_tokens": 6}}
LONG_BATCH_BODY: Json = {
    "rid": "w",
    "input_ids": [[7], [8], [9]],
    "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True},
}
QUEUE_BODY: Json = {"input_ids": [[1], [2], [3]]}
QUEUE_STREAM_BODY: Json = {**STREAM_BODY, "input_ids": [[4], [5], [6]]}
# passes the schema gate; SGLang's normalization rejects it afterwards
EMPTY_BODY: Json = {"input_ids": []}
VALID_BODIES = [
    CLIENT_BODY, STOP_BODY, LENGTH_BODY, BATCH_BODY, STREAM_BODY, LONG_BATCH_BODY, QUEUE_BODY,
    QUEUE_STREAM_BODY, EMPTY_BODY,
]  # fmt: skip

# shapes the emulator does not model (media, kv hints): it lets them through unchecked
UNCHECKED_FIELDS = {
    "image_data",
    "video_data",
    "audio_data",
    "kv_hints",
    "images_config",
    "session_params",
}
TOP_LEVEL_FIELDS = [
    "rid", "text", "input_ids", "stream", "sampling_params", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_hidden_states",
    "return_text_in_logprobs", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "disagg_prefill_dp_rank",
    "mm_hashes", "extra_key", "priority", "cache_salt", "require_reasoning", "lora_path",
    "routing_key", "max_thinking_tokens", "session_id", "custom_logit_processor",
    "custom_labels", "return_prompt_token_ids", "routed_experts_start_len",
    "return_sampling_mask", "modalities", "not_a_field",
]  # fmt: skip
ODD_VALUES: list[Any] = [
    None, True, 0, -1, 1.5, "s", [], {}, [1, 2], [1.5], ["a"], [None], [[1]], [["a"]],
    [True], {"k": "v"}, {"k": 1}, [{}],
]  # fmt: skip


@pytest.fixture(scope="module")
def contract() -> ModuleType:
    return load_contract()


def verdicts(body: Any, contract: ModuleType) -> tuple[str | None, str | None]:
    """(contract's error, emulator's error) for one body; None means accepted."""
    try:
        contract.GenerateRequest.from_json_value(copy.deepcopy(body))
        theirs = None
    except contract.JsonContractError as exc:
        theirs = str(exc)
    try:
        check_generate_request(body)
        ours = None
    except SchemaViolation as exc:
        ours = str(exc)
    return theirs, ours


# --- requests: the schema gate --------------------------------------------------------


@pytest.mark.parametrize("body", VALID_BODIES)
def test_every_request_body_the_tests_send_passes_the_contract(body: Json) -> None:
    validate_request(body)
    check_generate_request(body)


@pytest.mark.parametrize("field", TOP_LEVEL_FIELDS)
def test_top_level_fields_are_judged_like_the_contract(field: str, contract: ModuleType) -> None:
    for value in ODD_VALUES:
        theirs, ours = verdicts({**STOP_BODY, field: value}, contract)
        assert ours == theirs, (field, value)


@pytest.mark.parametrize("field", [*SAMPLING_FIELDS, "max_tokens"])
def test_sampling_fields_are_judged_like_the_contract(field: str, contract: ModuleType) -> None:
    for value in [*ODD_VALUES, {"enabled": True}, {"enabled": True, "salt": 1}]:
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 3, field: value}}
        theirs, ours = verdicts(body, contract)
        assert ours == theirs, (field, value)
        theirs, ours = verdicts({"input_ids": [[1]], "sampling_params": [{field: value}]}, contract)
        assert ours == theirs, (field, value)


@pytest.mark.parametrize("body", [[1], "x", 3, None, {"sampling_params": [1]}])
def test_bodies_of_the_wrong_shape_are_judged_like_the_contract(
    body: Any, contract: ModuleType
) -> None:
    theirs, ours = verdicts(body, contract)
    assert theirs is not None
    assert ours == theirs


def test_unchecked_fields_are_only_the_unmodelled_ones() -> None:
    generated = set(load_contract().GenerateRequest.__struct_fields__)
    assert generated == set(TOP_LEVEL_FIELDS[:-1]) | UNCHECKED_FIELDS


# --- the emulator over HTTP -----------------------------------------------------------


@pytest.fixture(scope="module")
def emu() -> Iterator[EmulatorProcess]:
    with running_emulator(CFG) as process:
        yield process


def post(emu: EmulatorProcess, body: Any) -> httpx.Response:
    return httpx.post(f"{emu.url}/generate", json=body, timeout=20)


def answer(emu: EmulatorProcess, body: Json) -> Any:
    response = post(emu, body)
    assert response.status_code == 200, response.text
    return decode_response(response.json())


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [1], "sampling_params": {"max_new_tokenz": 1}},
        {"input_ids": [1], "sampling_params": {"watermark": {"enabled": True, "salt": 1}}},
        {"input_ids": [1], "sampling_params": {"top_k": 1.5}},
        {"input_ids": [[1], [2.5]]},
        {"input_ids": [1], "return_prompt_token_ids": None},
        {"input_ids": [1], "max_thinking_tokens": -3},
        {"input_ids": [1], "rid": 7},
    ],
)
def test_the_400_text_is_the_contracts(emu: EmulatorProcess, body: Json) -> None:
    with pytest.raises(load_contract().JsonContractError) as raised:
        validate_request(body)
    response = post(emu, body)
    assert response.status_code == 400
    assert response.json() == {"error": str(raised.value)}


def test_success_shapes_decode(emu: EmulatorProcess) -> None:
    contract = load_contract()
    client = answer(emu, CLIENT_BODY)
    assert client.meta_info.id == CLIENT_BODY["rid"]
    assert client.prompt_token_ids == CLIENT_BODY["input_ids"]
    assert client.meta_info.completion_tokens == len(client.output_ids)
    assert isinstance(client.meta_info.finish_reason, contract.FinishStop | contract.FinishLength)

    stop = answer(emu, STOP_BODY)
    assert stop.meta_info.finish_reason == contract.FinishStop(matched=KIMI_IM_END_ID)
    assert stop.output_ids[-1] == KIMI_IM_END_ID
    assert stop.meta_info.weight_version == "default"
    assert stop.meta_info.e2e_latency > 0

    length = answer(emu, LENGTH_BODY)
    assert length.meta_info.finish_reason == contract.FinishLength(length=8)
    assert len(length.output_ids) == length.meta_info.completion_tokens == 8
    assert length.meta_info.prompt_tokens == 3

    batch = answer(emu, BATCH_BODY)
    assert [r.meta_info.id for r in batch] == ["b_0", "b_1"]
    assert [r.meta_info.prompt_tokens for r in batch] == [1, 2]


def test_stream_events_decode(emu: EmulatorProcess) -> None:
    contract = load_contract()
    with httpx.stream("POST", f"{emu.url}/generate", json=STREAM_BODY, timeout=20) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [decode_response(json.loads(line[len("data: ") :])) for line in lines[:-1]]
    assert all(e.meta_info.finish_reason is None for e in events[:-1])
    final = events[-1].meta_info.finish_reason
    assert isinstance(final, contract.FinishStop | contract.FinishLength)


def test_abort_and_queue_full_shapes_decode(emu: EmulatorProcess) -> None:
    contract = load_contract()
    with ThreadPoolExecutor(max_workers=2) as pool:
        pending = pool.submit(post, emu, LONG_BATCH_BODY)
        deadline = time.monotonic() + 10
        while httpx.get(f"{emu.url}/emulator/stats").json()["waiting"] != 1:
            assert time.monotonic() < deadline and not pending.done()
            time.sleep(0.01)

        # one waits; three more would make four
        full = post(emu, QUEUE_BODY)
        assert full.status_code == 503
        body = contract.ErrorBody.from_json_value(full.json())
        assert (body.message, body.code) == ("The request queue is full.", 503)
        streamed = post(emu, QUEUE_STREAM_BODY)
        assert streamed.status_code == 200
        event = decode_response(json.loads(streamed.text.split("\n\n")[0][len("data: ") :]))
        assert event.meta_info.finish_reason == contract.FinishAbort(
            message="The request queue is full.", status_code=503
        )

        httpx.post(f"{emu.url}/abort_request", json={"rid": "w_2"})
        httpx.post(f"{emu.url}/abort_request", json={"abort_all": True})
        finished = pending.result(timeout=10)
        assert finished.status_code == 200
        answers = decode_response(finished.json())
    running_aborted = [a.meta_info.finish_reason for a in answers[:2]]
    assert running_aborted == [contract.FinishAbort(message="Aborted")] * 2
    waiting = answers[2]
    assert waiting.meta_info.finish_reason == contract.FinishAbort(message="Abort in waiting queue")
    assert waiting.output_ids == [] and waiting.meta_info.completion_tokens == 0


def test_error_bodies_decode(emu: EmulatorProcess) -> None:
    contract = load_contract()
    error = post(emu, EMPTY_BODY).json()["error"]
    assert contract.ErrorBody.from_json_value(error).message == "input_ids cannot be empty."


def test_information_shapes_decode(emu: EmulatorProcess) -> None:
    contract = load_contract()
    model = contract.GetModelInfoResponse.from_json_value(httpx.get(f"{emu.url}/model_info").json())
    assert model.model_path == "moonshotai/Kimi-K2.5"
    assert model.weight_version == "default"
    assert model.is_generation
    server = contract.GetServerInfoResponse.from_json_value(
        httpx.get(f"{emu.url}/server_info").json()
    )
    assert server.version == "0.5.23"
    assert server.port == emu.port
    assert server.internal_states and server.internal_states[0]["max_running_requests"] == 2
    card = httpx.get(f"{emu.url}/v1/models").json()["data"][0]
    assert contract.ModelCard.from_json_value(card).max_model_len == CFG.context_length

"""The emulator's /v1/tokenize and /v1/detokenize against SGLang 0.5.23's published protocol
models (sglang/srt/entrypoints/openai/protocol.py, loaded from the wheel with stand-ins for
its other imports).

Every body gets the same verdict from the emulator as from TokenizeRequest / DetokenizeRequest;
every answer decodes as TokenizeResponse, DetokenizeResponse or ErrorResponse; a chat body is
rendered from exactly the fields SGLang's request models keep; and every body tokenmill's
render client sends is a valid TokenizeRequest rendered as a chat completion.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from app.sglang.render import prompt_request
from emulator.config import EmulatorConfig
from tests.support.emulator import REPO_ROOT, EmulatorProcess, running_emulator
from tests.support.sglang_contract import load_protocol
from tests.support.sglang_server import tokenize_as_deployed

Json = dict[str, Any]
USER: Json = {"role": "user", "content": "What is the weather in Paris?"}
TOOLS: list[Json] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
AGENTIC: list[Json] = [
    {"role": "system", "content": "You are helpful."},
    USER,
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "I should call the tool.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": [{"type": "text", "text": "18 C"}, {"type": "text", "text": "sunny"}],
    },
]
# SGLang's models drop turn fields they do not declare (here "source" and "thinking")
EXTRA_FIELDS: list[Json] = [
    USER | {"source": "web"},
    {"role": "assistant", "content": "Hi", "thinking": "x"},
]

VALID: list[Json] = [
    {"messages": [USER]},
    {"messages": AGENTIC, "tools": TOOLS},
    {"messages": AGENTIC, "tools": TOOLS, "chat_template_kwargs": {"thinking": False}},
    {"messages": [USER], "reasoning_effort": "low"},
    {"messages": [*EXTRA_FIELDS, USER]},
    {"messages": [{"role": "SYSTEM", "content": "Be brief."}, USER]},
    {"messages": [USER], "add_generation_prompt": False},
    {"messages": [USER], "add_generation_prompt": True, "add_special_tokens": True},
    {"messages": [USER], "model": "default", "some_extra_key": 1},
    {"prompt": "hello world"},
    {"prompt": "hello world", "add_special_tokens": False},
    {"prompt": ["one", "two three"]},
    {"messages": [USER], "tools": TOOLS, "tool_choice": {"function": {"name": "now"}}},
    {"messages": [USER], "tools": TOOLS, "tool_choice": "none"},
    {"messages": [USER], "reasoning_effort": 0.5},
    # valid shapes the handler refuses
    {"messages": []},
    {"messages": [USER], "tool_choice": "required"},
    {"messages": [USER], "tools": TOOLS, "tool_choice": {"function": {"name": "nope"}}},
]
HANDLER_ERRORS = {
    0: "Messages cannot be empty.",
    1: "Tools cannot be empty if tool choice is set to required.",
    2: "Tool 'nope' not found in tools list.",
}
INVALID: list[Json] = [
    {},
    {"prompt": "x", "messages": [USER]},
    {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "USER", "content": "x"}]},
    {"messages": [{"role": "user"}]},
    {"messages": "hello"},
    {"prompt": 5},
    {"prompt": "x", "add_special_tokens": "maybe"},
    {"messages": [USER], "tools": [{"type": "function", "function": {"description": "no name"}}]},
    {"messages": [USER], "chat_template_kwargs": ["thinking"]},
    {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
    {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]}]},
    {"messages": [USER], "tool_choice": "sometimes"},
    {"messages": [USER], "reasoning_effort": "extreme"},
    {"messages": [USER], "reasoning_effort": 1.5},
]
DETOKENIZE_VALID: list[Json] = [
    {"tokens": [163587, 100, 163601]},
    {"tokens": [163587, 100, 163601], "skip_special_tokens": False},
    {"tokens": [[163587, 100], [101, 102]], "skip_special_tokens": False},
    {"tokens": []},
]
DETOKENIZE_INVALID: list[Json] = [{}, {"tokens": "abc"}, {"tokens": [1, "x"]}]


@pytest.fixture(scope="module")
def protocol() -> ModuleType:
    return load_protocol()


@pytest.fixture(scope="module")
def emulator(kimi_tokenizer_dir: Path) -> Iterator[EmulatorProcess]:
    cfg = EmulatorConfig(port=0, tokenizer=str(kimi_tokenizer_dir))
    with running_emulator(cfg) as process:
        yield process


@pytest.fixture(scope="module")
def tokenizer(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


def post(emulator: EmulatorProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(emulator.url + path, json=body, timeout=30)


def protocol_accepts(model: Any, body: Json) -> bool:
    try:
        model.model_validate(copy.deepcopy(body))
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("body", VALID + INVALID)
def test_tokenize_verdicts_and_answers_follow_the_protocol(
    protocol: ModuleType, emulator: EmulatorProcess, body: Json
) -> None:
    accepted = protocol_accepts(protocol.TokenizeRequest, body)
    assert accepted == (body in VALID)
    for path in ("/v1/tokenize", "/tokenize"):
        response = post(emulator, path, body)
        if not accepted:
            assert response.status_code == 400, response.text
            error = protocol.ErrorResponse.model_validate(response.json())
            assert (error.object, error.type, error.code) == ("error", "Bad Request", 400)
            continue
        refusals = [HANDLER_ERRORS[i] for i, b in enumerate(VALID[-3:]) if b == body]
        if refusals:
            assert response.status_code == 400
            assert response.json()["message"] == refusals[0]
            protocol.ErrorResponse.model_validate(response.json())
            continue
        assert response.status_code == 200, response.text
        answer = protocol.TokenizeResponse.model_validate(response.json())
        if isinstance(body.get("prompt"), list):
            assert isinstance(answer.count, list) and len(answer.tokens) == len(body["prompt"])
        else:
            assert answer.count == len(answer.tokens) > 0


@pytest.mark.parametrize(
    "body", [b for b in VALID[:-3] if b.get("messages") and len(b) <= 3 and "tool_choice" not in b]
)
def test_chat_bodies_render_from_the_fields_sglang_keeps(
    protocol: ModuleType, emulator: EmulatorProcess, tokenizer: ChatTokenizer, body: Json
) -> None:
    """The protocol's own dump of the request (what SGLang's chat path starts from) through
    tokenmill's chat path gives the emulator's tokens."""
    if "add_generation_prompt" in body:
        pytest.skip("rendered with the template's own add_generation_prompt")
    request = protocol.TokenizeRequest.model_validate(copy.deepcopy(body))
    chat = request.to_chat_completion_request()
    messages = [m.model_dump() for m in chat.messages]
    kwargs = dict(chat.chat_template_kwargs or {})
    if chat.reasoning_effort is not None:
        kwargs = {"reasoning_effort": chat.reasoning_effort, **kwargs}
    expected = tokenizer.apply(messages, kwargs, tools=body.get("tools"))
    assert post(emulator, "/v1/tokenize", body).json()["tokens"] == expected


def test_undeclared_turn_fields_do_not_reach_the_template(
    emulator: EmulatorProcess, tokenizer: ChatTokenizer
) -> None:
    with_extra = post(emulator, "/v1/tokenize", {"messages": [*EXTRA_FIELDS, USER]}).json()
    plain = [USER, {"role": "assistant", "content": "Hi"}, USER]
    assert with_extra["tokens"] == tokenizer.apply(plain)


def test_generation_prompt_and_special_tokens_when_asked(emulator: EmulatorProcess) -> None:
    chat = post(emulator, "/v1/tokenize", {"messages": [USER]}).json()["tokens"]
    without = post(emulator, "/v1/tokenize", {"messages": [USER], "add_generation_prompt": False})
    assert chat[: len(without.json()["tokens"])] == without.json()["tokens"]
    assert len(without.json()["tokens"]) < len(chat)
    prompt = post(emulator, "/v1/tokenize", {"prompt": "hello"}).json()["tokens"]
    bare = post(emulator, "/v1/tokenize", {"prompt": "hello", "add_special_tokens": False})
    assert prompt[-len(bare.json()["tokens"]) :] == bare.json()["tokens"]


def test_a_body_that_is_not_json_content_is_refused(
    protocol: ModuleType, emulator: EmulatorProcess
) -> None:
    response = httpx.post(
        emulator.url + "/v1/tokenize",
        content=b'{"prompt": "x"}',
        headers={"content-type": "text/plain"},
        timeout=30,
    )
    assert response.status_code == 400
    assert "application/json" in protocol.ErrorResponse.model_validate(response.json()).message


@pytest.mark.parametrize("body", DETOKENIZE_VALID + DETOKENIZE_INVALID)
def test_detokenize_follows_the_protocol(
    protocol: ModuleType, emulator: EmulatorProcess, tokenizer: ChatTokenizer, body: Json
) -> None:
    accepted = protocol_accepts(protocol.DetokenizeRequest, body)
    assert accepted == (body in DETOKENIZE_VALID)
    response = post(emulator, "/v1/detokenize", body)
    if not accepted:
        assert response.status_code == 400
        protocol.ErrorResponse.model_validate(response.json())
        return
    assert response.status_code == 200, response.text
    text = protocol.DetokenizeResponse.model_validate(response.json()).text
    skip = body.get("skip_special_tokens", True)
    tokens = body["tokens"]
    if tokens and isinstance(tokens[0], list):
        assert text == [tokenizer.decode(row, skip_special_tokens=skip) for row in tokens]
    else:
        assert text == (tokenizer.decode(tokens, skip_special_tokens=skip) if tokens else "")


def test_the_render_client_sends_valid_chat_completion_renderings(
    protocol: ModuleType, emulator: EmulatorProcess, tokenizer: ChatTokenizer
) -> None:
    """What `--render-with` and `parity` send: valid TokenizeRequests with messages, no
    add_generation_prompt (rendered as a chat completion), equal to local templating."""
    requests = [
        prompt_request([USER], {}),
        prompt_request(AGENTIC, {"thinking": False}, tools=TOOLS),
        prompt_request(AGENTIC, None, tools=TOOLS),
    ]
    for request in requests:
        body = request.body()
        parsed = protocol.TokenizeRequest.model_validate(copy.deepcopy(body))
        assert parsed.messages is not None and parsed.prompt is None
        assert parsed.add_generation_prompt is None
        ids = post(emulator, "/v1/tokenize", body).json()["tokens"]
        tools = [dict(t) for t in request.tools] if request.tools else None
        local = tokenizer.apply(request.messages, request.chat_template_kwargs, tools=tools)
        assert ids == local


def test_a_final_assistant_turn_is_sent_as_a_user_turn_or_continued(
    emulator: EmulatorProcess, tokenizer: ChatTokenizer
) -> None:
    """As SGLang's chat completion: a final assistant turn with text becomes a user turn; with
    continue_final_message its text follows the generation prompt."""
    ending = [USER, {"role": "assistant", "content": "It is sunny"}]
    as_user = post(emulator, "/v1/tokenize", {"messages": ending}).json()["tokens"]
    assert as_user == tokenizer.apply([USER, {"role": "user", "content": "It is sunny"}])
    body = {"messages": ending, "continue_final_message": True}
    continued = post(emulator, "/v1/tokenize", body).json()["tokens"]
    text = tokenizer.hf_tokenizer.encode("It is sunny", add_special_tokens=False)
    assert continued == tokenizer.apply([USER]) + text


def test_continued_turns_are_sglangs(emulator: EmulatorProcess, kimi_tokenizer_dir: Path) -> None:
    """The emulator's continue_final_message renderings are SGLang's own code's: an answer
    right before the continued turn stays an answer, an empty turn appends nothing."""
    answer = {"role": "assistant", "content": "Hello."}
    bodies = [
        {"messages": [USER, answer, {"role": "assistant", "content": " And"}]},
        {"messages": [USER, {"role": "assistant", "content": ""}]},
        {"messages": [USER, answer]},
    ]
    bodies = [{**body, "continue_final_message": True} for body in bodies]
    expected = tokenize_as_deployed(kimi_tokenizer_dir, bodies)
    got = [post(emulator, "/v1/tokenize", body).json()["tokens"] for body in bodies]
    assert got == expected


def test_a_chosen_tool_is_the_only_one_rendered(
    emulator: EmulatorProcess, tokenizer: ChatTokenizer
) -> None:
    body = {"messages": [USER], "tools": TOOLS, "tool_choice": {"function": {"name": "now"}}}
    chosen = post(emulator, "/v1/tokenize", body).json()["tokens"]
    assert chosen == tokenizer.apply([USER], tools=[TOOLS[1]])
    none = {"messages": [USER], "tools": TOOLS, "tool_choice": "none"}
    assert post(emulator, "/v1/tokenize", none).json()["tokens"] == tokenizer.apply([USER])


def custom_code_folder(src: Path, dst: Path) -> Path:
    """The fixture folder as a custom-code tokenizer (its own class, loaded by auto_map)."""
    shutil.copytree(src, dst)
    (dst / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n",
        encoding="utf-8",
    )
    config_file = dst / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    config["tokenizer_class"] = "CustomTokenizer"
    config_file.write_text(json.dumps(config), encoding="utf-8")
    return dst


def test_a_custom_code_tokenizer_needs_trust_remote_code(
    kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    folder = custom_code_folder(kimi_tokenizer_dir, tmp_path / "custom")
    command = [sys.executable, "-m", "emulator", "--port", "0", "--tokenizer", str(folder)]
    refused = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert refused.returncode == 1
    assert "emulator: --tokenizer:" in refused.stderr and "custom code" in refused.stderr
    local = load_tokenizer(folder, trust_remote_code=True)
    cfg = EmulatorConfig(port=0, tokenizer=str(folder), trust_remote_code=True)
    with running_emulator(cfg) as emulator:
        ids = post(emulator, "/v1/tokenize", {"messages": [USER]}).json()["tokens"]
    assert ids == local.apply([USER])

"""ChatTokenizer renders as SGLang's chat path does: tools passed as `tools=` (retried as bare
functions when the template fails with them), normalized turns, per-entry kwargs, text
encoded without special tokens; compared with the template run directly on SGLang's turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.core.errors import InputError, TokenizerError
from app.prompts.chat_path import ChatInputs, parse_tools
from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from app.prompts.transformers_pin import as_server_renders
from tests.support import sglang_chat_path as sglang
from tests.support.chat_templates import (
    AGENT_TEMPLATE,
    BARE_TOOLS_TEMPLATE,
    tokenizer_with_template,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# the tool as SGLang's Tool.model_dump() hands it to the template
WEATHER_DUMPED = {**WEATHER, "defer_loading": None}
CALL = {
    "id": "c1",
    "index": None,
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
AGENTIC = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "Use it."},
    {
        "role": "tool",
        "content": [{"type": "text", "text": "18C"}, {"type": "text", "text": "sunny"}],
    },
    {"role": "user", "content": "Thanks. And tomorrow?", "source": "web"},
]


@pytest.fixture(scope="module")
def agent(kimi_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    folder = tmp_path_factory.mktemp("agent") / "tok"
    return load_tokenizer(tokenizer_with_template(kimi_tokenizer_dir, folder, AGENT_TEMPLATE))


@pytest.fixture(scope="module")
def bare(kimi_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    folder = tmp_path_factory.mktemp("bare") / "tok"
    return load_tokenizer(tokenizer_with_template(kimi_tokenizer_dir, folder, BARE_TOOLS_TEMPLATE))


def reference_text(
    tok: ChatTokenizer, turns: list[dict[str, Any]], tools: Any, **kwargs: Any
) -> str:
    """The template run directly on SGLang's own normalized turns."""
    messages = sglang.reference_messages(turns, tok.content_format)
    with (
        as_server_renders()
    ):  # transformers 5.19's rendering (tests/integration/test_sglang_oracle)
        text = tok.hf_tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
    return str(text)


def test_content_format_of_the_template(agent: ChatTokenizer, kimi_tokenizer_dir: Path) -> None:
    assert agent.content_format == "string"
    # the K2.5-shaped fixture loops over a turn's content parts
    assert load_tokenizer(kimi_tokenizer_dir).content_format == "openai"


def test_tools_and_turns_reach_the_template_as_sglang_gives_them(agent: ChatTokenizer) -> None:
    text = agent.render(AGENTIC, {"thinking": True}, parse_tools([WEATHER]))
    assert text == reference_text(agent, AGENTIC, [WEATHER_DUMPED], thinking=True)
    # the tool declarations, the parsed arguments, the joined tool result, the extra field
    assert json.dumps([WEATHER_DUMPED], ensure_ascii=False) in text
    assert '"arguments": {"city": "Paris"}' in text
    assert "18C sunny" in text
    assert "source=" not in text  # a user turn keeps role and content only, as at SGLang
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")


def test_ids_are_the_text_encoded_without_special_tokens(agent: ChatTokenizer) -> None:
    tools = parse_tools(json.dumps([WEATHER]))
    text = agent.render(AGENTIC, None, tools)
    ids = agent.apply(AGENTIC, None, tools)
    assert ids == agent.hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids != agent.apply(AGENTIC)  # without the tools the prompt is another one


def test_failing_template_is_retried_with_bare_functions(bare: ChatTokenizer) -> None:
    turns = [{"role": "user", "content": "Weather?"}]
    text = bare.render(turns, None, parse_tools([WEATHER]))
    assert text.startswith("<|im_system|>get_weather<|im_middle|>{")
    assert (
        bare.hf_tokenizer.apply_chat_template(
            turns, tools=[WEATHER["function"]], add_generation_prompt=True, tokenize=False
        )
        == text
    )
    with pytest.raises(Exception, match="tools must be bare"):  # what the retry fixes
        bare.hf_tokenizer.apply_chat_template(turns, tools=[WEATHER])


def test_apply_each_renders_each_entry_with_its_own_inputs(agent: ChatTokenizer) -> None:
    user = [{"role": "user", "content": "Hi"}]
    entries = [
        ChatInputs(user, None, {"thinking": False}),
        ChatInputs(AGENTIC, parse_tools([WEATHER]), {"thinking": True, "reasoning_effort": "low"}),
        ChatInputs(user, None, {"tokenize": True}),  # a kwarg tokenmill sets itself
        ChatInputs(
            [{"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{"}}]}]
        ),
    ]
    first, second, reserved, bad_arguments = agent.apply_each(entries)
    assert first == agent.apply(user, {"thinking": False})
    assert agent.decode(first).endswith("<think></think>")
    assert second == agent.apply(AGENTIC, {"thinking": True, "reasoning_effort": "low"}, [WEATHER])
    assert "effort=low" in agent.decode(second)
    assert isinstance(reserved, InputError) and "'tokenize' is not allowed" in reserved.reason
    assert isinstance(bad_arguments, InputError)
    assert "messages[0].tool_calls[0].function.arguments" in bad_arguments.reason


def test_apply_batch_equals_apply(agent: ChatTokenizer) -> None:
    conversations = [AGENTIC, [{"role": "user", "content": "Hi"}]]
    tools = parse_tools([WEATHER])
    assert agent.apply_batch(conversations, {}, tools) == [
        agent.apply(c, {}, tools) for c in conversations
    ]
    with pytest.raises(TokenizerError, match="must be a JSON object"):
        agent.apply_batch(conversations, "thinking")  # type: ignore[arg-type]

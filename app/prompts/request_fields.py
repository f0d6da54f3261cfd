"""A row's request-level fields applied as SGLang 0.5.23's chat path applies them: `tool_choice`
picks which of the row's tools the template sees (`OpenAIServingChat._process_messages`), and the
combinations its request validation refuses (`_validate_request`) are refused with its message;
`continue_final_message` makes the final assistant turn the start of the answer
(`_handle_last_assistant_message`, `_append_assistant_prefix_to_prompt_ids`).

`"none"` renders no tools; a named choice (`{"type": "function", "function": {"name": N}}`) only
the tool named N (on the DeepSeek-V3.2 encoder path, which puts `request.tools` in the prompt
whenever the choice leaves any, every tool); `"auto"` and `"required"` every tool (`"required"`
constrains decoding, which `/generate` does not do, but not the prompt). The field stays in the
row's metadata, so every sample records it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic

from app.core.contracts import Message
from app.core.errors import InputError
from app.prompts.request_json import json_type

# the row fields applied (a run pins them; `--no-request-fields`: none)
APPLIED = ("tool_choice", "continue_final_message")
# request fields a row may hold that change no prompt on SGLang 0.5.23's chat path, so they stay
# metadata and the enqueue report names them: `add_generation_prompt` is no field of its
# ChatCompletionRequest (pydantic drops it; only /v1/tokenize's TokenizeRequest reads it), and
# `parallel_tool_calls` reaches only its decoding constraints, never a template or an encoder
NOT_APPLIED = ("add_generation_prompt", "parallel_tool_calls")
# SGLang's ChatCompletionRequest.continue_final_message: a pydantic bool, read in lax mode
_BOOL = pydantic.TypeAdapter(bool)


def tools_for_choice(
    tools: list[dict[str, Any]] | None, choice: Any, *, every_tool: bool = False
) -> list[dict[str, Any]] | None:
    """The tools the template renders for a row's tool_choice (absent or None: "auto", as
    SGLang defaults it); InputError with SGLang's message for what it refuses. every_tool: the
    server's path renders every tool of the request for a named choice (DeepSeek-V3.2's)."""
    if choice is None or choice == "auto":
        return tools
    if choice == "none":
        return None
    if choice == "required":
        if not tools:
            raise InputError("Tools cannot be empty if tool choice is set to required.")
        return tools
    name = _named(choice)
    if not tools:
        raise InputError("Tools cannot be empty if tool choice is set to a specific tool.")
    chosen = [t for t in tools if (t.get("function") or {}).get("name") == name]
    if not chosen:
        raise InputError(f"Tool '{name}' not found in tools list.")
    return tools if every_tool else chosen


def _named(choice: Any) -> str:
    """The function name of a named tool_choice; InputError for a value SGLang's model refuses."""
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    kind = choice.get("type", "function") if isinstance(choice, dict) else None
    if not isinstance(name, str) or kind != "function":
        raise InputError(
            'tool_choice must be "auto", "required", "none" or '
            '{"type": "function", "function": {"name": NAME}}'
        )
    return name


def continues_final_message(value: Any) -> bool:
    """A row's continue_final_message as SGLang's request model reads it (pydantic's bool: also
    0/1 and "yes"/"no", "true"/"false", "on"/"off"...); null or absent: false, its default.
    InputError naming the field for a value it refuses."""
    if value is None:
        return False
    try:
        return _BOOL.validate_python(value)
    except pydantic.ValidationError:
        raise InputError(
            f"continue_final_message must be true or false, not the JSON {json_type(value)} "
            f"{value!r}"[:200]
        ) from None


def assistant_prefix(turns: Sequence[Message]) -> str | None:
    """What SGLang continues for a request with continue_final_message: the content of a final
    assistant turn whose content (normalized as the template sees it, null read as "") is a
    string, which the prompt then leaves out; None when the turns end otherwise (the request
    renders as without the field)."""
    if not turns or turns[-1].get("role") != "assistant":
        return None
    content = turns[-1].get("content")
    return content if isinstance(content, str) else None

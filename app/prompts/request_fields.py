"""A row's request-level fields applied as SGLang 0.5.23's chat path applies them: `tool_choice`
picks which of the row's tools the template sees (`OpenAIServingChat._process_messages`), and the
combinations its request validation refuses (`_validate_request`) are refused with its message.

`"none"` renders no tools; a named choice (`{"type": "function", "function": {"name": N}}`) only
the tool named N; `"auto"` and `"required"` every tool (`"required"` constrains decoding, which
`/generate` does not do, but not the prompt). The field stays in the row's metadata, so every
sample records it.
"""

from __future__ import annotations

from typing import Any

from app.core.errors import InputError

CHOICES = ("auto", "required", "none")


def tools_for_choice(
    tools: list[dict[str, Any]] | None, choice: Any
) -> list[dict[str, Any]] | None:
    """The tools the template renders for a row's tool_choice (absent or None: "auto", as
    SGLang defaults it); InputError with SGLang's message for what it refuses."""
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
    return chosen


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

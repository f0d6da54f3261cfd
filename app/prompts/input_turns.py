"""The turns of a prompt object as checked Messages: OpenAI `role`/`content` turns, ShareGPT
`from`/`value` turns, and ShareGPT's tool-call and observation turns in OpenAI's shape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.core.contracts import Message
from app.core.errors import InputError, TokenmillError
from app.prompts.chat_path import content_part, json_type, resolve_reasoning_aliases

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# ShareGPT "from" values and the roles they mean.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


# Defined here, the lowest of the input modules, so that turns, records and lines raise one kind.
class BadRow(TokenmillError):
    """A reason a line cannot be used (turned into an InputError with its line number)."""


@dataclass(frozen=True)
class BadTurn:
    """The first turn of a row that cannot be used: its position and why."""

    index: int
    reason: str


def parse_turns_until_bad(value: Any, field: str) -> tuple[list[Message], BadTurn | None]:
    """The turns before the first bad one, and that one (None if every turn is good)."""
    if not isinstance(value, list):
        raise BadRow(f"'{field}' must be a list of turns, not a JSON {json_type(value)}")
    if not value:
        raise BadRow(f"'{field}' is empty")
    items = sharegpt_tool_turns(value, field)
    turns: list[Message] = []
    for index, item in enumerate(items):
        try:
            turns.append(_turn(item, f"{field}[{index}]"))
        except BadRow as bad:
            return turns, BadTurn(index, str(bad))
    return turns, None


def _turn(item: Any, where: str) -> Message:
    if not isinstance(item, dict):
        raise BadRow(f"{where} must be an object, not a JSON {json_type(item)}")
    if "from" in item:
        speaker = item["from"]
        if not isinstance(speaker, str) or speaker.lower() not in SHAREGPT_ROLES:
            known = ", ".join(sorted(SHAREGPT_ROLES))
            raise BadRow(f"{where} has unknown 'from' {json.dumps(speaker)} (known: {known})")
        if "value" not in item:
            raise BadRow(f"{where} has no 'value'")
        turn: Message = {"role": SHAREGPT_ROLES[speaker.lower()], "content": item["value"]}
        turn.update((k, v) for k, v in item.items() if k not in ("from", "value", "role"))
        content_field = "value"
    else:
        if "role" not in item:
            raise BadRow(f"{where} has no 'role' (or ShareGPT 'from')")
        role = item["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise BadRow(
                f"{where} has unknown role {json.dumps(role)} "
                "(allowed: system, developer, user, assistant, tool)"
            )
        turn = dict(item)
        if "content" not in item:
            # SGLang's request models: content defaults to None on every role but user's
            if role == "user":
                raise BadRow(f"{where} has no 'content' (a user turn needs content, empty or not)")
            turn["content"] = None
        content_field = "content"
    try:
        turn = resolve_reasoning_aliases(turn, where)
    except InputError as error:
        raise BadRow(error.reason) from None
    turn["content"] = _content(turn, f"{where}.{content_field}")
    if turn["role"] != "user":  # SGLang drops a user turn's other fields unread
        _check_extra_fields(turn, where)
    return turn


def _content(turn: Message, where: str) -> str | list[Any] | None:
    """The content as given (a string, a list of text and image parts, or null where
    allowed); a part of another kind is the line's error, named."""
    content = turn["content"]
    if content is None:
        # SGLang's user model requires content; the others take null (rendered as "")
        if turn["role"] != "user":
            return None
        raise BadRow(f"{where} is null (a user turn needs content, empty or not)")
    if isinstance(content, list):
        for i, part in enumerate(content):
            try:
                content_part(part, f"{where}[{i}]", turn["role"])
            except InputError as error:
                raise BadRow(error.reason) from None
        return content
    if not isinstance(content, str):
        raise BadRow(
            f"{where} must be a string or a list of text and image parts, "
            f"not a JSON {json_type(content)}"
        )
    return content


def _check_extra_fields(turn: Message, where: str) -> None:
    for name in ("name", "tool_call_id", "reasoning_content"):
        if turn.get(name) is not None and not isinstance(turn[name], str):
            raise BadRow(f"{where}.{name} must be a string, not a JSON {json_type(turn[name])}")
    if turn.get("tool_calls") is not None and not isinstance(turn["tool_calls"], list):
        raise BadRow(f"{where}.tool_calls must be a list")
    if turn.get("phase") not in (None, "commentary", "final_answer"):
        raise BadRow(f'{where}.phase must be "commentary" or "final_answer"')
    if turn.get("prefix") is not None and not isinstance(turn["prefix"], bool):
        raise BadRow(f"{where}.prefix must be true, false or null")


def prompt_turns(turns: list[Message], field: str) -> list[Message]:
    """Cut the trailing assistant turns: the prompt is every turn before them, whatever its
    roles (SGLang renders a conversation without a user turn, or ending with a system turn)."""
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    if not turns:
        raise BadRow(f"'{field}' has no turn before its assistant turns")
    return turns


# --- LLaVA / ShareGPT4V image rows ------------------------------------------------------------


IMAGE_MARKER = "<image>"
# the fields beside the turns that hold a LLaVA row's images: one path, or a list of them
LLAVA_IMAGE_FIELDS = ("image", "images")


def llava_images(data: dict[str, Any]) -> tuple[str, list[str]] | None:
    """The field and the image references of a LLaVA / ShareGPT4V row (`"image": path` or
    `"images": [path, ...]` beside its turns), or None for a row without them."""
    present = [name for name in LLAVA_IMAGE_FIELDS if data.get(name) is not None]
    if not present:
        return None
    if len(present) > 1:
        raise BadRow("both 'image' and 'images' beside the turns; give the images in one")
    name = present[0]
    value = data[name]
    refs = [value] if name == "image" and isinstance(value, str) else value
    if not isinstance(refs, list):
        want = "a string" if name == "image" else "a list of strings"
        raise BadRow(f"'{name}' must be {want}, not a JSON {json_type(value)}")
    for index, ref in enumerate(refs):
        if not isinstance(ref, str) or not ref.strip():
            raise BadRow(f"'{name}'[{index}] must be a non-empty string (an image reference)")
    return name, refs


def llava_turns(items: Any, field: str, name: str, refs: list[str]) -> Any:
    """The turns of a LLaVA row with each `<image>` marker of a turn's text made an image part
    at its place (the text around it kept as text parts, empty pieces dropped), the row's
    images taken in order. A marker count other than the images' is the line's error."""
    if not isinstance(items, list):
        return items
    markers = sum((_turn_text(item) or "").count(IMAGE_MARKER) for item in items)
    if markers != len(refs):
        raise BadRow(
            f"'{field}' has {markers} {IMAGE_MARKER} marker(s) but '{name}' gives "
            f"{len(refs)} image(s); each image needs one marker at its place in the text"
        )
    images = iter(refs)
    out: list[Any] = []
    for item in items:
        text = _turn_text(item)
        if text is None or IMAGE_MARKER not in text:
            out.append(item)
            continue
        parts: list[dict[str, Any]] = []
        for position, piece in enumerate(text.split(IMAGE_MARKER)):
            if position:
                parts.append({"type": "image_url", "image_url": {"url": next(images)}})
            if piece:
                parts.append({"type": "text", "text": piece})
        key = "value" if "from" in item else "content"
        out.append({**item, key: parts})
    return out


def _turn_text(item: Any) -> str | None:
    if not isinstance(item, dict):
        return None
    text = item.get("value") if "from" in item else item.get("content")
    return text if isinstance(text, str) else None


# --- ShareGPT tool turns -----------------------------------------------------------------------


SHAREGPT_CALL = "function_call"
SHAREGPT_RESULT = "observation"


def sharegpt_tool_call_id(turn: int, k: int) -> str:
    """The id of the k-th call (from 0) of the `function_call` turn at index turn (from 0)."""
    return f"call_{turn}_{k}"


def sharegpt_tool_turns(items: list[Any], field: str) -> list[Any]:
    """ShareGPT tool turns (LLaMA-Factory's format) as OpenAI turns; other items unchanged.

    - A `{"from": "function_call", "value": ...}` turn becomes an assistant turn with no
      content and `tool_calls`. Its value is a JSON string (or already an object) of one call
      `{"name", "arguments"}`, or a list of them (parallel calls). `arguments` is kept as
      given: an object, or a string (which the chat path parses like an OpenAI one).
    - Call ids follow one rule: `call_{turn}_{k}`, turn being the index of the function_call
      turn in the conversation (from 0) and k the index of the call in it (from 0).
    - An `{"from": "observation", "value": ...}` turn becomes a `tool` turn answering the
      oldest call not answered yet (its `tool_call_id`), so observations answer calls in
      order; an observation with no call left to answer is an error naming the turn.
    - Invalid JSON, or a call without a string `name`, is an error naming the turn (the
      line's error).
    """
    if not any(
        isinstance(item, dict) and item.get("from") in (SHAREGPT_CALL, SHAREGPT_RESULT)
        for item in items
    ):
        return items
    out: list[Any] = []
    unanswered: list[str] = []
    for index, item in enumerate(items):
        where = f"{field}[{index}]"
        speaker = item.get("from") if isinstance(item, dict) else None
        if speaker == SHAREGPT_CALL:
            calls = _sharegpt_calls(item.get("value"), index, where)
            unanswered = [call["id"] for call in calls]
            out.append({"role": "assistant", "content": None, "tool_calls": calls})
        elif speaker == SHAREGPT_RESULT:
            if not unanswered:
                raise BadRow(
                    f"{where} is an observation with no function_call before it left to answer"
                )
            out.append(
                {"role": "tool", "content": item.get("value"), "tool_call_id": unanswered.pop(0)}
            )
        else:
            out.append(item)
    return out


def sharegpt_tools(value: Any, turns: Any) -> Any:
    """A ShareGPT row's `tools` in OpenAI's shape; any other row's unchanged.

    LLaMA-Factory stores a row's tools as a JSON string of bare function objects
    (`[{"name", "description", "parameters"}]`): for rows whose turns are ShareGPT
    (`from`/`value`), the string is parsed and each bare function is wrapped as
    `{"type": "function", "function": ...}`. Invalid JSON is the line's error.
    """
    if not (isinstance(turns, list) and any(isinstance(t, dict) and "from" in t for t in turns)):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise BadRow(f"'tools' is a string that is not valid JSON ({exc})") from None
    if not isinstance(value, list):
        return value
    return [
        {"type": "function", "function": tool}
        if isinstance(tool, dict) and "function" not in tool and "name" in tool
        else tool
        for tool in value
    ]


def _sharegpt_calls(value: Any, turn: int, where: str) -> list[dict[str, Any]]:
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise BadRow(f"{where}.value is not valid JSON for a function call ({exc})") from None
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not calls:
        raise BadRow(f"{where}.value is an empty list of function calls")
    out: list[dict[str, Any]] = []
    for k, call in enumerate(calls):
        at = f"{where}.value[{k}]" if isinstance(parsed, list) else f"{where}.value"
        if not isinstance(call, dict):
            raise BadRow(f'{at} must be a {{"name", "arguments"}} object, not a {json_type(call)}')
        name = call.get("name")
        if not isinstance(name, str) or not name:
            raise BadRow(f"{at} has no string 'name'")
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict | str):
            raise BadRow(f"{at}.arguments must be an object or a JSON string")
        out.append(
            {
                "id": sharegpt_tool_call_id(turn, k),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return out

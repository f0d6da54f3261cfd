"""SGLang 0.5.23's chat path before rendering: message normalization, tools, template kwargs.

Pure functions, no tokenizer: what `/v1/chat/completions` does to a request before its Jinja
chat template runs, so that client-built prompts are the ones the deployed model sees.

The rules, read from `sglang/srt/entrypoints/openai/serving_chat.py`, `protocol.py` and
`sglang/srt/parser/jinja_template_utils.py` of the 0.5.23 wheel:

- Assistant `tool_calls` take the shape of SGLang's `ToolCall` model: `{"id", "index",
  "type": "function", "function": {"name", "arguments"}}` (missing ones null, other keys
  dropped); `arguments` given as a JSON string is parsed into an object, and one that is not
  a JSON object is an error.
- `content: null` becomes `""`; then every key whose value is None is dropped from the turn.
- Content given as a list of parts: for templates that take `string` content the text parts
  are joined with a single space; for `openai` templates the list is kept, each text part as
  `{"type": "text", "text"}`. A `tool` turn whose parts are all text is joined with a space
  in either case.
- Image parts (`image_url`, and SGLang's `input_image`; tokenmill also reads `{"type":
  "image", "image": url}`) of user turns and tool results: kept in the list as
  `{"type": "image_url", "image_url": {"url"}}` (the url only), a tool turn holding one keeps
  its list. `template_view` gives the template what SGLang does, each image part as `{"type":
  "image"}`, and `image_urls` the images in the order SGLang collects them. A `string`
  template drops image parts in SGLang (no placeholder would stand for the image), so there
  an image part is refused; so are video and audio parts, which tokenmill does not take.
- A thinking part (`{"type": "thinking" | "reasoning", "thinking" | "text"}`) of an assistant
  turn is checked as SGLang's request model checks it and left out of the turn, as its chat
  path leaves it out in either format; in another role it is refused with SGLang's message.
- A turn's own `tools` (a system turn's) must be a list, as in SGLang's request model (a JSON
  string, read for a row's top-level `tools`, is its 400 there).
- Tools (the request's `tools`) take the shape of SGLang's `Tool` model: `{"type",
  "function": {...}, "defer_loading"}`, the function's keys in the order given, `description`
  and `parameters` added as null when missing, `strict` / `defer_loading` only when given.
  When rendering fails with the tools, it is tried once more with each tool reduced to its
  bare `function` object (`bare_function_tools`).
- Template kwargs: the run's, then the row's over them; a `reasoning_effort` sets the template
  variable `reasoning_effort` and defaults `thinking` and `enable_thinking` to
  `effort != "none"`, as a request's `reasoning_effort` does.
- Each turn keeps the fields SGLang's request models declare for its role, in the models'
  order: a user turn `role` and `content`; the others `role`, `content`, `tool_call_id`, `name`,
  `phase`, `reasoning_content`, `tool_calls`, `tools`, `prefix`. With `pass_turn_fields` every
  field reaches the template as given (a run opts into that with `--pass-turn-fields`).
- Tool-call arguments are parsed as orjson parses them (an integer beyond 64 bits becomes a
  float; NaN, Infinity and lone surrogates are refused), and so is the rest of a row
  (`as_sglang_reads`, `app.prompts.request_json`). Tool parameter schemas are rewritten as SGLang's
  `normalize_json_schema_types` rewrites them, then checked (`app.prompts.tool_schemas`).

Where tokenmill differs on purpose: `reasoning` / `thinking` on a turn are aliases of
`reasoning_content` (`resolve_reasoning_aliases`, applied when reading). Tool results are not
reordered: SGLang reorders a run of tool results holding media into the order of their calls
(for templates that may render them by tool_call_id), so such a run out of that order is
refused rather than reordered (`tool_result_order_error`), for the templates SGLang reorders
them for. Tool calls are not checked for
answering tool turns: SGLang checks that pairing only for MiniMax-M3.

The rules carry NORMALIZATION_VERSION; a run pins the version it was created with, and
`check_version` refuses a run pinned to rules this tokenmill does not have.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.core.constants import NORMALIZATION_VERSION
from app.core.contracts import Message
from app.core.errors import ConfigurationError, InputError
from app.prompts.request_json import as_sglang_reads as as_sglang_reads
from app.prompts.request_json import json_type as json_type
from app.prompts.request_json import parse_tool_call_arguments as parse_tool_call_arguments
from app.prompts.tool_schemas import checked_parameters

ContentFormat = Literal["string", "openai"]

# .3 adds image parts; text-only turns normalize as under .2, so runs pinned to it go on
KNOWN_VERSIONS = frozenset({"sglang-0.5.23.2", NORMALIZATION_VERSION})

# Turn fields that are aliases of reasoning_content (vLLM-style datasets).
REASONING_ALIASES = ("reasoning", "thinking")
# Content part types read as text ("input_text", the Responses API spelling, is refused as the
# chat endpoint refuses it).
_TEXT_PART_TYPES = ("text",)
# Image part types: SGLang's two (`image_url`, `input_image`) and the `{"type": "image",
# "image": url}` spelling of Hugging Face processors, read as an image_url part.
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
# An assistant turn's reasoning as a content part (SGLang's ContentThinkingPart): accepted as
# its request model accepts it, and left out of the rendered turn, as its chat path leaves it out.
THINKING_PART_TYPES = ("thinking", "reasoning")
# Media tokenmill does not take (SGLang's video and audio parts, and their other spellings).
MEDIA_PART_TYPES = ("video_url", "video", "input_video", "audio_url", "input_audio", "audio")
# The roles whose image parts the templates render (Kimi-K2.5 renders tool results' too).
IMAGE_ROLES = ("user", "tool")
# The fields SGLang's request models keep, per role, in their order.
USER_FIELDS = ("role", "content")
GENERIC_FIELDS = (
    "role",
    "content",
    "tool_call_id",
    "name",
    "phase",
    "reasoning_content",
    "tool_calls",
    "tools",
    "prefix",
)
# The fields of SGLang's Function model, in its order.
_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


@dataclass(frozen=True)
class ChatInputs:
    """Everything one prompt is rendered from: the turns, the tools, the template kwargs."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    # the turns and tools are already what normalize_messages / parse_tools return (read by
    # app.prompts.inputs, or stored by an item), so rendering does not normalize them again
    normalized: bool = False
    # continue_final_message: the final assistant turn's text, left out of messages and
    # appended after the generation prompt (SGLang's assistant_prefix); None: none
    assistant_prefix: str | None = None


# --- versions ---------------------------------------------------------------------------------


def check_version(version: str | None, *, run: str | None = None) -> str:
    """The pinned version, if this tokenmill has its rules; else a ConfigurationError."""
    name = f"run {run!r}" if run else "the run"
    if version is None:
        raise ConfigurationError(
            f"{name} was created before tokenmill pinned its message-normalization rules, so "
            "its prompts cannot be rebuilt the same way; create a new run (new --run name)"
        )
    if version not in KNOWN_VERSIONS:
        raise ConfigurationError(
            f"{name} pins the message-normalization rules {version!r}, which this tokenmill "
            f"does not have (it has {', '.join(sorted(KNOWN_VERSIONS))}); use the tokenmill "
            "version that created the run, or a new run"
        )
    return version


# --- messages ---------------------------------------------------------------------------------


def resolve_reasoning_aliases(turn: Message, where: str = "turn") -> Message:
    """The turn with `reasoning` / `thinking` renamed to `reasoning_content`.

    Null ones are ignored; two non-null ones that differ are an InputError naming them.
    """
    if not any(alias in turn for alias in REASONING_ALIASES):
        return turn
    names = ("reasoning_content", *REASONING_ALIASES)
    present = [name for name in names if turn.get(name) is not None]
    values = [turn[name] for name in present]
    if any(value != values[0] for value in values[1:]):
        raise InputError(
            f"{where} has different {' and '.join(present)}; they are the same field "
            "(reasoning_content) and may hold one text"
        )
    out = {k: v for k, v in turn.items() if k not in REASONING_ALIASES}
    if present:
        out["reasoning_content"] = turn[present[0]]
    return out


def normalize_messages(
    messages: Sequence[Message],
    content_format: ContentFormat,
    *,
    field: str = "messages",
    pass_turn_fields: bool = False,
) -> list[Message]:
    """The turns as SGLang's chat path hands them to a Jinja template (see the module doc).

    Returns new dicts; the input is not changed. Idempotent: normalized turns come back equal.
    Raises InputError naming the turn and field (`messages[2].tool_calls[0].function.arguments`,
    `field` being the first name) for tool-call arguments that are not a JSON object, and for
    content parts that are not text.
    """
    if content_format not in ("string", "openai"):
        raise ValueError(f"content format must be 'string' or 'openai', not {content_format!r}")
    return [
        normalize_turn(turn, content_format, f"{field}[{index}]", pass_turn_fields=pass_turn_fields)
        for index, turn in enumerate(messages)
    ]


def deployment_fields(turn: Message) -> Message:
    """The turn with only the fields SGLang's request model for its role keeps, in its order."""
    kept = USER_FIELDS if turn.get("role") == "user" else GENERIC_FIELDS
    return {name: turn[name] for name in kept if name in turn}


def normalize_turn(
    turn: Message, content_format: ContentFormat, where: str, *, pass_turn_fields: bool = False
) -> Message:
    """One turn of normalize_messages; `where` names it in errors."""
    out = dict(turn) if pass_turn_fields else deployment_fields(turn)
    if isinstance(out.get("tool_calls"), list):
        # SGLang parses the arguments of assistant turns only
        parse = out.get("role") == "assistant"
        out["tool_calls"] = [
            _tool_call(call, f"{where}.tool_calls[{i}]", parse=parse)
            for i, call in enumerate(out["tool_calls"])
        ]
    if isinstance(out.get("tools"), list):  # tools declared on a system turn
        out["tools"] = normalize_tools(out["tools"], f"{where}.tools")
    elif out.get("tools") is not None and out.get("role") != "user":
        # a turn's tools are a list in SGLang's request model (no JSON string read, unlike a
        # row's top-level tools): it answers 400 "tools: Input should be a valid list"
        raise InputError(
            f"{where}.tools must be a list of tools, not a JSON {json_type(out['tools'])} "
            "(SGLang answers 400: Input should be a valid list)"
        )
    if out.get("content") is None:
        out["content"] = ""
    content = out["content"]
    if isinstance(content, list):
        role = out.get("role")
        parts = [
            content_part(part, f"{where}.content[{i}]", role, content_format)
            for i, part in enumerate(content)
        ]
        parts = [part for part in parts if part["type"] not in THINKING_PART_TYPES]
        texts = [part["text"] for part in parts if part["type"] == "text"]
        if content_format == "string":
            out["content"] = " ".join(texts)
        else:
            # SGLang rebuilds such a turn with its content last
            del out["content"]
            out["content"] = parts
            if role == "tool" and len(texts) == len(parts):
                out["content"] = " ".join(texts)
    return {key: value for key, value in out.items() if value is not None}


def content_part(
    part: Any, where: str, role: Any, content_format: ContentFormat = "openai"
) -> dict[str, Any]:
    """One content part, checked: `{"type": "text", "text"}` or `{"type": "image_url",
    "image_url": {"url"}}`; an InputError naming the part for anything else."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PART_TYPES:
        text = part.get("text")
        if not isinstance(text, str):
            raise InputError(f"{where} has no string 'text'")
        return {"type": "text", "text": text}
    if kind in IMAGE_PART_TYPES:
        if role not in IMAGE_ROLES:
            raise InputError(
                f"{where} is an image part in {_article(role)} {role} turn; images are taken "
                "in user turns "
                "and tool results"
            )
        if content_format == "string":
            raise InputError(
                f"{where} is an image part, but the chat template takes string content: "
                "SGLang drops image parts for such templates, so no placeholder would stand "
                "for the image"
            )
        return {"type": "image_url", "image_url": {"url": _image_url(part, kind, where)}}
    if kind in THINKING_PART_TYPES:
        return thinking_part(part, kind, where, role)
    if kind in MEDIA_PART_TYPES:
        raise InputError(
            f"{where} is a {json.dumps(kind)} part; tokenmill takes text and image parts"
        )
    shown = kind if isinstance(part, dict) else json_type(part)
    raise InputError(f"{where} is a {json.dumps(shown)} part; tokenmill takes text and image parts")


def thinking_part(part: dict[str, Any], kind: str, where: str, role: Any) -> dict[str, Any]:
    """A thinking part checked as SGLang's ContentThinkingPart: in an assistant turn, with
    exactly one of `thinking` and `text`, a string; the chat path renders no such part."""
    if role != "assistant":
        raise InputError(f"{where}: thinking content parts are only valid in assistant messages")
    given = [name for name in ("thinking", "text") if part.get(name) is not None]
    if len(given) != 1:
        raise InputError(f"{where}: thinking parts require exactly one of 'thinking' or 'text'")
    if not isinstance(part[given[0]], str):
        raise InputError(f"{where}.{given[0]} must be a string")
    return {"type": kind}


def _article(word: Any) -> str:
    return "an" if str(word)[:1] in tuple("aeiou") else "a"


def _image_url(part: dict[str, Any], kind: str, where: str) -> str:
    """The image reference of an image part (`image_url.url`, or a bare string in its place)."""
    field = "image" if kind == "image" else "image_url"
    value = part.get(field)
    if isinstance(value, dict):
        value = value.get("url")
        field += ".url"
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{where} has no image reference (a non-empty string '{field}')")
    return value


def is_image_part(part: Any) -> bool:
    """Whether part is a normalized image part."""
    return isinstance(part, dict) and part.get("type") == "image_url"


def image_urls(turns: Sequence[Message]) -> list[str]:
    """The image references of normalized turns, in the order SGLang collects the images."""
    return [
        part["image_url"]["url"]
        for turn in turns
        if isinstance(turn.get("content"), list)
        for part in turn["content"]
        if is_image_part(part)
    ]


def with_image_urls(turns: Sequence[Message], url_of: Callable[[str], str]) -> list[Message]:
    """Normalized turns with each image reference replaced by url_of(reference)."""
    out: list[Message] = []
    for turn in turns:
        content = turn.get("content")
        if isinstance(content, list) and any(is_image_part(part) for part in content):
            parts = [
                {"type": "image_url", "image_url": {"url": url_of(part["image_url"]["url"])}}
                if is_image_part(part)
                else part
                for part in content
            ]
            turn = {**turn, "content": parts}
        out.append(turn)
    return out


def template_view(turns: Sequence[Message]) -> list[Message]:
    """The turns as SGLang hands them to the template: each image part as `{"type": "image"}`
    (the images themselves travel beside the prompt, in `image_urls` order)."""
    out: list[Message] = []
    for turn in turns:
        content = turn.get("content")
        if isinstance(content, list) and any(is_image_part(part) for part in content):
            parts = [{"type": "image"} if is_image_part(part) else part for part in content]
            turn = {**turn, "content": parts}
        out.append(turn)
    return out


def tool_result_order_error(
    turns: Sequence[Message], field: str = "messages"
) -> tuple[int, str] | None:
    """The position and reason of the first run of tool results holding an image that does
    not answer its calls in their order, or None: SGLang reorders such a run for a template
    that may render results by tool_call_id (`template_may_reorder_tool_results`), and
    tokenmill keeps the rows' order, so for those templates the run is refused."""
    for index, turn in enumerate(turns):
        calls = turn.get("tool_calls") if turn.get("role") == "assistant" else None
        if not calls:
            continue
        run: list[tuple[int, Message]] = []
        for at in range(index + 1, len(turns)):
            if turns[at].get("role") != "tool":
                break
            run.append((at, turns[at]))
        if not any(image_urls([result]) for _, result in run):
            continue
        order = [call.get("id") if isinstance(call, dict) else None for call in calls]
        answered = [result.get("tool_call_id") for _, result in run]
        # SGLang leaves a run it cannot pair alone (ids missing, repeated or unknown)
        pairable = (
            None not in order
            and len(set(order)) == len(order)
            and len(set(answered)) == len(answered)
            and all(call_id in order for call_id in answered)
        )
        if pairable and answered != sorted(answered, key=order.index):
            return run[0][0], (
                f"{field}[{run[0][0]}]: the tool results after {field}[{index}] hold an image "
                "and answer its calls out of order, which SGLang reorders for this template "
                "(it reads tool_call_id); give them in the order of the calls"
            )
    return None


def _tool_call(call: Any, where: str, *, parse: bool) -> dict[str, Any]:
    """One tool call in SGLang's ToolCall shape, its arguments parsed when parse is set."""
    if not isinstance(call, dict):
        raise InputError(f"{where} must be an object, not a JSON {json_type(call)}")
    function = call.get("function")
    if not isinstance(function, dict):
        raise InputError(f"{where}.function must be an object with 'name' and 'arguments'")
    kind = call.get("type", "function")
    if kind != "function":
        raise InputError(f'{where}.type is {json.dumps(kind)}; only "function" is allowed')
    for name, value in (("id", call.get("id")), ("function.name", function.get("name"))):
        if value is not None and not isinstance(value, str):
            raise InputError(f"{where}.{name} must be a string, not a JSON {json_type(value)}")
    index = call.get("index")
    if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
        raise InputError(f"{where}.index must be an integer, not a JSON {json_type(index)}")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and parse:
        arguments = parse_tool_call_arguments(arguments, f"{where}.function.arguments")
    elif arguments is not None and not isinstance(arguments, str | dict):
        raise InputError(
            f"{where}.function.arguments must be a JSON object or a string holding one, "
            f"not a JSON {json_type(arguments)}"
        )
    return {
        "id": call.get("id"),
        "index": index,
        "type": "function",
        "function": {"name": function.get("name"), "arguments": arguments},
    }


def final_assistant_as_user(messages: Sequence[Message]) -> list[Message]:
    """A chat completion whose last turn is an assistant turn with string content: SGLang
    sends that turn as a user turn of the same content (without `continue_final_message`).

    A tokenmill prompt ends with one at a boundary right after an earlier answer (two
    assistant turns in a row); the emulator's `/v1/tokenize` renders arbitrary requests.
    """
    out = list(messages)
    if out and out[-1].get("role") == "assistant" and isinstance(out[-1].get("content"), str):
        out[-1] = {"role": "user", "content": out[-1]["content"]}
    return out


# --- tools ------------------------------------------------------------------------------------


def parse_tools(value: Any, where: str = "tools") -> list[dict[str, Any]] | None:
    """A row's `tools`: a list of tool objects, or a JSON string of one, in SGLang's Tool shape.

    None or an empty list is None (no tools reach the template, as in SGLang). Raises
    InputError naming the field for a string that is not JSON or a tool that is not valid.
    """
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InputError(f"'{where}' is a string that is not valid JSON ({exc})") from None
        if value is None:
            return None
    if value is None:
        return None
    if not isinstance(value, list):
        raise InputError(
            f"'{where}' must be a list of tools (or a JSON string of one), "
            f"not a JSON {json_type(value)}"
        )
    return normalize_tools(value, where) or None


def normalize_tools(tools: Iterable[Any], where: str = "tools") -> list[dict[str, Any]]:
    """Each tool as SGLang's `Tool.model_dump()` gives it to the template."""
    return [_tool(tool, f"{where}[{i}]", i) for i, tool in enumerate(tools)]


def _tool(tool: Any, where: str, index: int) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise InputError(f"{where} must be an object, not a JSON {json_type(tool)}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InputError(
            f"{where} has no 'function' object; a tool is "
            '{"type": "function", "function": {"name": ..., "parameters": ...}}'
        )
    kind = tool.get("type", "function")
    if not isinstance(kind, str):
        raise InputError(f"{where}.type must be a string, not a JSON {json_type(kind)}")
    defer = _optional_bool(tool.get("defer_loading"), f"{where}.defer_loading")
    return {
        "type": kind,
        "function": _function(function, defer, f"{where}.function", index),
        "defer_loading": defer,
    }


def _function(
    function: dict[str, Any], tool_defer: bool | None, where: str, index: int
) -> dict[str, Any]:
    name = function.get("name")
    if not isinstance(name, str):
        raise InputError(f"{where}.name must be a string, not a JSON {json_type(name)}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InputError(f"{where}.description must be a string or null")
    strict = _optional_bool(function.get("strict"), f"{where}.strict")
    defer = _optional_bool(function.get("defer_loading"), f"{where}.defer_loading")
    if defer is None:
        defer = tool_defer
    values: dict[str, Any] = {
        "description": description,
        "name": name,
        "parameters": checked_parameters(copy.deepcopy(function.get("parameters")), index, where),
        "strict": strict,
        "defer_loading": defer,
    }
    for key in ("strict", "defer_loading"):
        if values[key] is None:
            del values[key]
    given = [key for key in function if key in values]
    return {key: values[key] for key in given + [k for k in values if k not in given]}


def _optional_bool(value: Any, where: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise InputError(f"{where} must be true, false or null, not a JSON {json_type(value)}")


def bare_function_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools reduced to their `function` objects: SGLang's second try when a template
    fails with the full tools (some templates take tools without the OpenAI wrapper)."""
    if not tools:
        return None
    return [tool.get("function", tool) for tool in tools]


# --- template kwargs ----------------------------------------------------------------------------


def merge_template_kwargs(
    run_kwargs: Mapping[str, Any] | None,
    row_kwargs: Mapping[str, Any] | None,
    reasoning_effort: Any = None,
) -> dict[str, Any]:
    """The template kwargs of one row: the run's, the row's over them, then a row's
    `reasoning_effort` as SGLang applies a request's (a `reasoning_effort` inside the kwargs
    wins as the variable's value, but only the request-level one sets the thinking defaults)."""
    merged = dict(run_kwargs or {})
    merged.update(row_kwargs or {})
    if reasoning_effort is not None:
        merged.setdefault("thinking", reasoning_effort != "none")
        merged.setdefault("enable_thinking", reasoning_effort != "none")
        merged.setdefault("reasoning_effort", reasoning_effort)
    return merged


def check_reasoning_effort(value: Any, where: str = "reasoning_effort") -> str | float | None:
    """A row's `reasoning_effort`: one of SGLang's tiers or a number in [0, 0.99]."""
    if value is None:
        return None
    if isinstance(value, str) and value in _EFFORT_TIERS:
        return value
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 0.99:
        return float(value)
    raise InputError(
        f"'{where}' must be one of {', '.join(_EFFORT_TIERS)} or a number from 0 to 0.99, "
        f"not {json.dumps(value)}"
    )


_EFFORT_TIERS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")

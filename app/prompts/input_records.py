"""One prompt object (a JSONL line or a table row) as a PromptRecord: its prompt field, item key,
system turn, tools, template kwargs and the metadata kept beside them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.core.contracts import Message, PromptRecord, stable_hash
from app.core.errors import InputError
from app.prompts.chat_path import (
    ContentFormat,
    as_sglang_reads,
    check_reasoning_effort,
    json_type,
    normalize_turn,
    parse_tools,
    tool_result_order_error,
)
from app.prompts.input_turns import (
    IMAGE_MARKER,
    BadRow,
    BadTurn,
    llava_images,
    llava_turns,
    parse_turns_until_bad,
    prompt_turns,
    sharegpt_tools,
)
from app.prompts.request_fields import (
    assistant_prefix,
    continues_final_message,
    tools_for_choice,
)
from app.prompts.row_sampling import parse_row_sampling

# The ledger's item_key column holds 200 characters.
MAX_KEY_CHARS = 200
# Keys derived from content: 20 hex chars (80 bits) keep collisions out of reach.
CONTENT_KEY_CHARS = 20

# Checked in this order; the first one present is used (the others are kept as metadata).
PROMPT_FIELDS = ("messages", "conversations", "prompt", "input_ids")
# Top-level fields that are template inputs or the item key, besides the prompt field; every
# other top-level field is row metadata, exported with each sample.
INPUT_FIELDS = (
    "id",
    "system",
    "tools",
    "chat_template_kwargs",
    "reasoning_effort",
    "sampling_params",
)


@dataclass(frozen=True)
class ReadRules:
    """How rows become records: the prompt field (None: the first of PROMPT_FIELDS), the
    template's content format, and whether turns keep every field (`--pass-turn-fields`)."""

    field: str | None = None
    content_format: ContentFormat = "string"
    pass_turn_fields: bool = False
    # the template reads tool_call_id, so SGLang puts tool results in call order first
    reorders_tool_results: bool = True
    # the row's tool_choice applied as SGLang applies it (else kept as metadata only)
    request_fields: bool = True
    # the server renders every tool for a named tool_choice (SGLang's DeepSeek-V3.2 encoder)
    renders_every_tool: bool = False


def build_record(
    data: dict[str, Any], line_no: int, rules: ReadRules | None = None
) -> tuple[PromptRecord, bool]:
    """The row as a record, and whether its key is the row's own `id` (else derived from its
    content); BadRow names what is wrong with it."""
    rules = rules or ReadRules()
    try:
        data = as_sglang_reads(data, "the row")
    except InputError as error:
        raise BadRow(error.reason) from None
    row = _read_row(data, line_no, rules)
    record = _ids_record(row) if row.kind == "input_ids" else _chat_record(row, rules)
    return record, row.key is not None


@dataclass(frozen=True)
class _Row:
    """What every record takes from its row: the prompt field and its kind, the row's own key,
    system turn, metadata and sampling, and the top-level fields used as inputs."""

    data: dict[str, Any]
    line_no: int
    field: str
    kind: str  # "messages", "conversations", "prompt" or "input_ids"
    key: str | None
    system: str | None
    used: tuple[str, ...]
    metadata: dict[str, Any] | None
    sampling: dict[str, Any] | None


def _read_row(data: dict[str, Any], line_no: int, rules: ReadRules) -> _Row:
    """The row's prompt field, key, system turn, LLaVA images (folded into its turns),
    metadata and sampling."""
    field, kind = _prompt_field(data, rules.field)
    key = _explicit_key(data.get("id"))
    system = _system_field(data.get("system"))
    used = [field] + [name for name in INPUT_FIELDS if data.get(name) is not None]
    llava = llava_images(data) if _may_be_llava(data, field, kind) else None
    if llava is not None:
        data = {**data, field: llava_turns(data[field], field, *llava)}
        used.append(llava[0])
    metadata = _metadata(data, used)
    try:
        sampling = parse_row_sampling(data.get("sampling_params"))
    except InputError as error:
        raise BadRow(error.reason) from None
    return _Row(data, line_no, field, kind, key, system, tuple(used), metadata, sampling)


def _prompt_field(data: dict[str, Any], named: str | None) -> tuple[str, str]:
    """The field the prompt is read from (`--field`, else the first of PROMPT_FIELDS present)
    and its kind."""
    if named is not None:
        if data.get(named) is None:
            raise BadRow(f"no value in the --field {named!r} (keys: {_key_list(data)})")
        return named, _kind_of(data[named])
    found = next((name for name in PROMPT_FIELDS if data.get(name) is not None), None)
    if found is None:
        raise BadRow(
            "no prompt field: expected one of 'messages', 'conversations', 'prompt' or "
            f"'input_ids' (keys: {_key_list(data)})"
        )
    return found, found


def _ids_record(row: _Row) -> PromptRecord:
    """A pre-tokenized row: its ids, sent as they are (no template inputs beside them)."""
    for name in ("system", "tools", "chat_template_kwargs", "reasoning_effort"):
        if row.data.get(name) is not None:
            raise BadRow(f"'{name}' cannot be combined with pre-tokenized '{row.field}'")
    ids = _input_ids(row.data[row.field], row.field)
    return PromptRecord(
        row.line_no,
        row.key or content_key("input_ids", ids if row.sampling is None else [ids, row.sampling]),
        input_ids=ids,
        metadata=row.metadata,
        prompt_fields=row.used,
        sampling_params=row.sampling,
    )


def _chat_record(row: _Row, rules: ReadRules) -> PromptRecord:
    """A chat row: its turns up to the first bad one, its tools and request fields, and the
    messages rendered as its prompt (a continued final turn left out, SGLang's prefill)."""
    turns, bad, shift = _checked_turns(row, rules)
    tools, continued, effort = _request_inputs(row.data, row.field, rules)
    # a continued final turn is in the prompt, so a bad trailing assistant turn is too
    in_tail = (
        bad is not None
        and not continued
        and _in_trailing_assistant_turns(row.data[row.field], bad.index - shift)
    )
    row_kwargs = _row_kwargs(row.data.get("chat_template_kwargs"))
    if bad is not None and not any(turn["role"] != "assistant" for turn in turns):
        raise BadRow(bad.reason)  # no boundary before the bad turn
    prefix = assistant_prefix(turns) if continued and bad is None else None
    # a continued turn is left out, every turn before it rendered (SGLang's prefill)
    messages = prompt_turns(list(turns if prefix is None else turns[:-1]), row.field)
    if prefix is not None:
        messages = list(turns[:-1])
    key_content = _key_content(messages, tools, row_kwargs, effort, row.sampling, prefix)
    return PromptRecord(
        row.line_no,
        row.key or content_key("messages", key_content),
        messages=messages,
        conversation=turns if len(turns) > len(messages) else None,
        tools=tools,
        chat_template_kwargs=row_kwargs,
        reasoning_effort=effort,
        metadata=row.metadata,
        prompt_fields=row.used,
        bad_turn=None if bad is None else (bad.index, bad.reason),
        bad_turn_in_tail=in_tail,
        sampling_params=row.sampling,
        assistant_prefix=prefix,
    )


def _checked_turns(row: _Row, rules: ReadRules) -> tuple[list[Message], BadTurn | None, int]:
    """The row's turns (its system field first) normalized up to the first bad one, that bad
    turn, and how far the system field shifted the row's own turn indexes."""
    bad: BadTurn | None = None
    if row.kind == "prompt":
        turns = [_prompt_turn(row.data[row.field], row.field)]
    else:
        turns, bad = parse_turns_until_bad(row.data[row.field], row.field)
    shift = 0
    if row.system is not None:
        if any(turn["role"] == "system" for turn in turns):
            raise BadRow(f"both a 'system' field and a system turn in '{row.field}'")
        turns.insert(0, {"role": "system", "content": row.system})
        shift = 1
        bad = bad and BadTurn(bad.index + 1, bad.reason)
    turns, bad = _normalized_until_bad(turns, bad, row.field, rules)
    unordered = tool_result_order_error(turns, row.field) if rules.reorders_tool_results else None
    if unordered is not None and (bad is None or unordered[0] < bad.index):
        # the boundaries before the out-of-order run keep (`--turns each`)
        turns, bad = turns[: unordered[0]], BadTurn(unordered[0], unordered[1])
    return turns, bad, shift


def _request_inputs(
    data: dict[str, Any], field: str, rules: ReadRules
) -> tuple[list[dict[str, Any]] | None, bool, str | float | None]:
    """The row's tools (its tool_choice applied), whether it continues its final turn, and its
    reasoning_effort; BadRow for a value SGLang refuses."""
    try:
        tools = parse_tools(sharegpt_tools(data.get("tools"), data[field]))
        continued = rules.request_fields and continues_final_message(
            data.get("continue_final_message")
        )
        if rules.request_fields:
            choice = data.get("tool_choice")
            tools = tools_for_choice(tools, choice, every_tool=rules.renders_every_tool)
        return tools, continued, check_reasoning_effort(data.get("reasoning_effort"))
    except InputError as error:
        raise BadRow(error.reason) from None


def _may_be_llava(data: dict[str, Any], field: str, kind: str) -> bool:
    """Whether an `image` / `images` field beside the turns is a LLaVA row's images: in a
    `conversations` row, or when a turn's text holds an `<image>` marker (elsewhere such a
    field is the row's metadata)."""
    if kind in ("prompt", "input_ids"):
        return False
    turns = data.get(field)
    return field == "conversations" or (
        isinstance(turns, list)
        and any(IMAGE_MARKER in (_turn_string(turn) or "") for turn in turns)
    )


def _turn_string(turn: Any) -> str | None:
    if not isinstance(turn, dict):
        return None
    text = turn.get("value", turn.get("content"))
    return text if isinstance(text, str) else None


def _in_trailing_assistant_turns(raw: Any, index: int) -> bool:
    """Whether the raw turns from index on are all OpenAI-style assistant turns: the ones a
    `--turns last` prompt drops, so a bad one there does not touch the prompt."""
    if not isinstance(raw, list) or not 0 <= index < len(raw):
        return False
    return all(isinstance(item, dict) and item.get("role") == "assistant" for item in raw[index:])


def _normalized_until_bad(
    turns: list[Message], bad: BadTurn | None, field: str, rules: ReadRules
) -> tuple[list[Message], BadTurn | None]:
    """The turns normalized up to the first that cannot be (or the bad one read before)."""
    out: list[Message] = []
    for index, turn in enumerate(turns):
        try:
            out.append(
                normalize_turn(
                    turn,
                    rules.content_format,
                    f"{field}[{index}]",
                    pass_turn_fields=rules.pass_turn_fields,
                )
            )
        except InputError as error:
            return out, BadTurn(index, error.reason)
    return out, bad


def _key_content(
    messages: list[Message],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None,
    effort: str | float | None,
    sampling: dict[str, Any] | None = None,
    prefix: str | None = None,
) -> Any:
    """What a content key hashes: the turns, and the row's tools, kwargs, sampling and continued
    final turn when it has any (so rows without them keep the keys they always had)."""
    if prefix is not None:
        return {
            "content": _key_content(messages, tools, kwargs, effort, sampling),
            "prefix": prefix,
        }
    if tools is None and kwargs is None and effort is None and sampling is None:
        return messages
    content = {"messages": messages, "tools": tools, "kwargs": kwargs, "effort": effort}
    return content if sampling is None else content | {"sampling": sampling}


def _row_kwargs(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRow(
            f"'chat_template_kwargs' must be a JSON object such as {{\"thinking\": false}}, "
            f"not a JSON {json_type(value)}"
        )
    return dict(value)


def _metadata(data: dict[str, Any], used: list[str]) -> dict[str, Any] | None:
    """The row's fields that are neither its prompt nor a template input, as JSON values."""
    kept = {name: _jsonable(value) for name, value in data.items() if name not in used}
    # a null input field (say "tools": null) is no input and no metadata
    unused = (*INPUT_FIELDS, *PROMPT_FIELDS)
    kept = {name: value for name, value in kept.items() if value is not None or name not in unused}
    return kept or None


def _jsonable(value: Any) -> Any:
    """A value as JSON can hold it (Parquet columns may hold dates, bytes, decimals)."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    isoformat = getattr(value, "isoformat", None)
    return isoformat() if callable(isoformat) else str(value)


def _kind_of(value: Any) -> str:
    """What a --field value holds: a prompt string, token ids, or turns."""
    if isinstance(value, str):
        return "prompt"
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return "input_ids"
    return "messages"


def _explicit_key(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise BadRow(f"'id' must be a string or an integer, not a JSON {json_type(value)}")
    key = str(value)
    if not key.strip():
        raise BadRow("'id' is empty")
    if len(key) > MAX_KEY_CHARS:
        raise BadRow(f"'id' is longer than {MAX_KEY_CHARS} characters")
    return key


def _system_field(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRow(f"'system' must be a string, not a JSON {json_type(value)}")
    # Many datasets carry "system": "" on every line: an empty one means none.
    return value if value.strip() else None


def _input_ids(value: Any, field: str = "input_ids") -> list[int]:
    if not isinstance(value, list):
        raise BadRow(f"'{field}' must be a list of token ids, not a JSON {json_type(value)}")
    if not value:
        raise BadRow(f"'{field}' is empty")
    for index, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise BadRow(f"'{field}'[{index}] is {json.dumps(token)}, not a non-negative integer")
    return list(value)


def _prompt_turn(value: Any, field: str = "prompt") -> Message:
    if not isinstance(value, str):
        raise BadRow(f"'{field}' must be a string, not a JSON {json_type(value)}")
    if not value.strip():
        raise BadRow(f"'{field}' is empty")
    return {"role": "user", "content": value}


def _key_list(data: dict[str, Any]) -> str:
    names = [repr(name) for name in list(data)[:8]]
    return ", ".join(names) + (", ..." if len(data) > 8 else "") if names else "none"


def content_key(kind: str, value: Any) -> str:
    """The item key of a line without an id: a short hash of its turns or ids."""
    return stable_hash({kind: value})[:CONTENT_KEY_CHARS]


def report_bad_turns(records: list[PromptRecord], fail: Callable[[InputError], None]) -> None:
    """`--turns each`: a record with a bad turn keeps its boundaries before it; the ones that
    contain it are the line's error, reported through fail."""
    for record in records:
        if record.bad_turn is not None:
            index, reason = record.bad_turn
            fail(
                InputError(
                    f"{reason}; the boundaries from turn {index} on are not enqueued (the "
                    "earlier ones are)",
                    record.line,
                )
            )

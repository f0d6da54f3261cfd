"""Prompt files: streaming JSONL parsing into PromptRecords, with one clear error per bad line.

Also parses the `--chat-template-kwargs` option. No tokenizer here: records hold turns or ids.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

from app.core.contracts import Message, PromptRecord, stable_hash
from app.core.errors import ConfigurationError, InputError
from app.prompts.chat_path import (
    ContentFormat,
    check_reasoning_effort,
    json_type,
    normalize_messages,
    parse_tools,
    resolve_reasoning_aliases,
)
from app.prompts.input_formats import TableInput, iter_rows, open_table, prompt_columns

logger = logging.getLogger(__name__)

DEFAULT_MAX_LINE_BYTES = 32 * 1024 * 1024
# The ledger's item_key column holds 200 characters.
MAX_KEY_CHARS = 200
# Keys derived from content: 20 hex chars (80 bits) keep collisions out of reach.
CONTENT_KEY_CHARS = 20
_SKIP_CHUNK_BYTES = 1024 * 1024
_UTF8_BOM = b"\xef\xbb\xbf"

ROLES = frozenset({"system", "user", "assistant", "tool"})
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
# Checked in this order; the first one present is used (the others are kept as metadata).
PROMPT_FIELDS = ("messages", "conversations", "prompt", "input_ids")
# Top-level fields that are template inputs or the item key, besides the prompt field; every
# other top-level field is row metadata, exported with each sample.
INPUT_FIELDS = ("id", "system", "tools", "chat_template_kwargs", "reasoning_effort")


def read_prompts(
    path: Path,
    *,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    field: str | None = None,
    content_format: ContentFormat = "string",
) -> Iterator[PromptRecord | InputError]:
    """Yield a PromptRecord or an InputError for every non-blank line of a JSONL file, or for
    every row of a Parquet / datasets input (see `app.prompts.input_formats`; errors say "row N").

    Lines are read one at a time in binary (a `.gz` file is decompressed on the fly) and
    numbered from 1; a bad line yields its InputError and reading goes on. A line may hold:

    - `messages`: a list of `{"role", "content"}` turns (roles system, user, assistant, tool);
      every other field of a turn reaches the template as given, `reasoning` and `thinking`
      being aliases of `reasoning_content`;
    - `conversations`: ShareGPT turns `{"from", "value"}` (human/user, gpt/chatgpt/assistant,
      system, tool/function/observation) or `{"role", "content"}` turns;
    - `prompt`: a string, one user turn;
    - `input_ids`: a non-empty list of non-negative ints, used as the prompt ids verbatim.

    Optional `id` (string or int) is the item key; without it the key is a hash of the turns
    (or ids), so the same prompt twice is reported as a duplicate. An optional non-empty
    `system` string becomes a leading system turn (an error if the turns have their own).
    `tools` (a list of OpenAI tools, or a JSON string of one) goes to the template as
    `tools=`; `chat_template_kwargs` (an object) and `reasoning_effort` are the row's template
    kwargs, merged over the run's. Every other top-level field is kept as row metadata.

    The turns are normalized as SGLang's chat path does (`app.prompts.chat_path`, for the template's
    `content_format`): tool-call arguments given as JSON strings parsed (invalid JSON is the
    line's error), content parts joined with a space for "string" templates and kept as a
    list for "openai" ones, null content "" and null fields dropped. Trailing assistant turns
    are dropped: the prompt ends at the last user (or tool) turn, and the answer after it is
    what gets regenerated.

    `field` names the field (column) holding the prompt instead: its value is read as turns,
    a prompt string or ids, whichever it holds.
    """
    path = Path(path)
    table = open_table(path)
    if table is not None:
        return _unique(_table_records(table, field, content_format), "row")
    return _unique(_jsonl_records(path, max_line_bytes, field, content_format), "line")


def _jsonl_records(
    path: Path, max_line_bytes: int, field: str | None, content_format: ContentFormat
) -> Iterator[tuple[PromptRecord, bool] | InputError]:
    with _open(path) as stream:
        for line_no, raw, complete in _lines(stream, max_line_bytes, path):
            if raw is None:
                yield InputError(f"line is longer than {max_line_bytes} bytes", line_no)
                continue
            if not raw.strip():
                continue
            try:
                yield _parse_line(
                    raw, line_no, complete, first=line_no == 1, field=field, fmt=content_format
                )
            except InputError as error:
                yield error


def _table_records(
    table: TableInput, field: str | None, content_format: ContentFormat
) -> Iterator[tuple[PromptRecord, bool] | InputError]:
    columns = prompt_columns(table, field)
    for row_no, row in iter_rows(table, columns):
        try:
            yield _record(row, row_no, field, content_format)
        except _Bad as bad:
            yield InputError(str(bad), row_no, unit="row")


def _unique(
    entries: Iterator[tuple[PromptRecord, bool] | InputError], unit: str
) -> Iterator[PromptRecord | InputError]:
    """Records, with a second record of the same key reported as a duplicate of the first."""
    seen: dict[str, int] = {}
    for entry in entries:
        if isinstance(entry, InputError):
            yield entry
            continue
        record, explicit = entry
        first = seen.setdefault(record.key, record.line)
        if first == record.line:
            yield record
        elif explicit:
            yield InputError(
                f"duplicate id {record.key!r} (first seen on {unit} {first})",
                record.line,
                unit=unit,
            )
        else:
            yield InputError(
                f"duplicate prompt: same content as {unit} {first}", record.line, unit=unit
            )


def parse_chat_template_kwargs(text: str | None) -> dict[str, Any]:
    """The JSON object given to `--chat-template-kwargs` (None or blank: no kwargs)."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigurationError(
            f"--chat-template-kwargs is not valid JSON ({exc}); "
            "give a JSON object such as '{\"thinking\": false}'"
        ) from exc
    if not isinstance(value, dict):
        raise ConfigurationError(
            f"--chat-template-kwargs must be a JSON object such as "
            f"'{{\"thinking\": false}}', not a JSON {json_type(value)}"
        )
    return value


def content_key(kind: str, value: Any) -> str:
    """The item key of a line without an id: a short hash of its turns or ids."""
    return stable_hash({kind: value})[:CONTENT_KEY_CHARS]


# --- reading lines --------------------------------------------------------------------------


def _open(path: Path) -> IO[bytes]:
    try:
        if path.suffix == ".gz":
            return cast(IO[bytes], gzip.open(path, "rb"))
        return path.open("rb")
    except OSError as exc:
        raise InputError(f"cannot open the prompts file {str(path)!r}: {exc.strerror}") from exc


def _lines(
    stream: IO[bytes], max_line_bytes: int, path: Path
) -> Iterator[tuple[int, bytes | None, bool]]:
    """(line number, bytes without the newline or None if too long, ended by a newline)."""
    line_no = 0
    while True:
        chunk = _readline(stream, max_line_bytes + 1, path, line_no)
        if not chunk:
            return
        line_no += 1
        complete = chunk.endswith(b"\n")
        if len(chunk) > max_line_bytes and not complete:
            # Too long: skip to the end of the line without holding it in memory.
            while chunk and not chunk.endswith(b"\n"):
                chunk = _readline(stream, _SKIP_CHUNK_BYTES, path, line_no)
            yield line_no, None, True
            continue
        yield line_no, chunk.rstrip(b"\n").removesuffix(b"\r"), complete


def _readline(stream: IO[bytes], size: int, path: Path, line_no: int) -> bytes:
    """One readline; a file that cannot be read on (not gzip, truncated .gz) is an InputError."""
    try:
        return stream.readline(size)
    except (OSError, EOFError, zlib.error) as exc:
        where = f"after line {line_no}" if line_no else "at its start"
        raise InputError(f"cannot read the prompts file {str(path)!r} {where}: {exc}") from exc


def _parse_line(
    raw: bytes,
    line_no: int,
    complete: bool,
    *,
    first: bool,
    field: str | None = None,
    fmt: ContentFormat = "string",
) -> tuple[PromptRecord, bool]:
    """The record of one line, and whether its key is an explicit id."""
    if first:
        raw = raw.removeprefix(_UTF8_BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"line is not valid UTF-8 (bad byte at offset {exc.start})"
        raise InputError(reason, line_no) from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise InputError("invalid JSON: nested too deeply", line_no) from None
    except ValueError as exc:
        if not complete:
            raise InputError(
                "truncated last line: no newline at the end of the file and the JSON is "
                f"incomplete ({exc})",
                line_no,
            ) from None
        raise InputError(f"invalid JSON: {exc}", line_no) from None
    if not isinstance(data, dict):
        raise InputError(f"line is a JSON {json_type(data)}, not an object", line_no)
    try:
        return _record(data, line_no, field, fmt)
    except _Bad as bad:
        raise InputError(str(bad), line_no) from None


class _Bad(Exception):
    """A reason a line cannot be used (turned into an InputError with its line number)."""


# --- one JSON object --------------------------------------------------------------------------


def _record(
    data: dict[str, Any],
    line_no: int,
    named: str | None = None,
    content_format: ContentFormat = "string",
) -> tuple[PromptRecord, bool]:
    if named is not None:
        if data.get(named) is None:
            raise _Bad(f"no value in the --field {named!r} (keys: {_key_list(data)})")
        field, kind = named, _kind_of(data[named])
    else:
        found = next((name for name in PROMPT_FIELDS if data.get(name) is not None), None)
        if found is None:
            raise _Bad(
                "no prompt field: expected one of 'messages', 'conversations', 'prompt' or "
                f"'input_ids' (keys: {_key_list(data)})"
            )
        field = kind = found
    key = _explicit_key(data.get("id"))
    system = _system_field(data.get("system"))
    used = [field] + [name for name in INPUT_FIELDS if data.get(name) is not None]
    metadata = _metadata(data, used)
    if kind == "input_ids":
        for name in ("system", "tools", "chat_template_kwargs", "reasoning_effort"):
            if data.get(name) is not None:
                raise _Bad(f"'{name}' cannot be combined with pre-tokenized '{field}'")
        ids = _input_ids(data[field], field)
        record = PromptRecord(
            line_no,
            key or content_key("input_ids", ids),
            input_ids=ids,
            metadata=metadata,
            prompt_fields=tuple(used),
        )
        return record, key is not None
    turns = [_prompt_turn(data[field], field)] if kind == "prompt" else _turns(data[field], field)
    if system is not None:
        if any(turn["role"] == "system" for turn in turns):
            raise _Bad(f"both a 'system' field and a system turn in '{field}'")
        turns.insert(0, {"role": "system", "content": system})
    try:
        turns = normalize_messages(turns, content_format, field=field)
        tools = parse_tools(sharegpt_tools(data.get("tools"), data[field]))
        effort = check_reasoning_effort(data.get("reasoning_effort"))
    except InputError as error:
        raise _Bad(error.reason) from None
    row_kwargs = _row_kwargs(data.get("chat_template_kwargs"))
    messages = _prompt_turns(list(turns), field)
    record = PromptRecord(
        line_no,
        key or content_key("messages", _key_content(messages, tools, row_kwargs, effort)),
        messages=messages,
        conversation=turns if len(turns) > len(messages) else None,
        tools=tools,
        chat_template_kwargs=row_kwargs,
        reasoning_effort=effort,
        metadata=metadata,
        prompt_fields=tuple(used),
    )
    return record, key is not None


def _key_content(
    messages: list[Message],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None,
    effort: str | float | None,
) -> Any:
    """What a content key hashes: the turns, and the row's tools and kwargs when it has any
    (so rows without them keep the keys they always had)."""
    if tools is None and kwargs is None and effort is None:
        return messages
    return {"messages": messages, "tools": tools, "kwargs": kwargs, "effort": effort}


def _row_kwargs(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _Bad(
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
        raise _Bad(f"'id' must be a string or an integer, not a JSON {json_type(value)}")
    key = str(value)
    if not key.strip():
        raise _Bad("'id' is empty")
    if len(key) > MAX_KEY_CHARS:
        raise _Bad(f"'id' is longer than {MAX_KEY_CHARS} characters")
    return key


def _system_field(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _Bad(f"'system' must be a string, not a JSON {json_type(value)}")
    # Many datasets carry "system": "" on every line: an empty one means none.
    return value if value.strip() else None


def _input_ids(value: Any, field: str = "input_ids") -> list[int]:
    if not isinstance(value, list):
        raise _Bad(f"'{field}' must be a list of token ids, not a JSON {json_type(value)}")
    if not value:
        raise _Bad(f"'{field}' is empty")
    for index, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise _Bad(f"'{field}'[{index}] is {json.dumps(token)}, not a non-negative integer")
    return list(value)


def _prompt_turn(value: Any, field: str = "prompt") -> Message:
    if not isinstance(value, str):
        raise _Bad(f"'{field}' must be a string, not a JSON {json_type(value)}")
    if not value.strip():
        raise _Bad(f"'{field}' is empty")
    return {"role": "user", "content": value}


def _turns(value: Any, field: str) -> list[Message]:
    if not isinstance(value, list):
        raise _Bad(f"'{field}' must be a list of turns, not a JSON {json_type(value)}")
    if not value:
        raise _Bad(f"'{field}' is empty")
    items = sharegpt_tool_turns(value, field)
    return [_turn(item, f"{field}[{index}]") for index, item in enumerate(items)]


def _turn(item: Any, where: str) -> Message:
    if not isinstance(item, dict):
        raise _Bad(f"{where} must be an object, not a JSON {json_type(item)}")
    if "from" in item:
        speaker = item["from"]
        if not isinstance(speaker, str) or speaker.lower() not in SHAREGPT_ROLES:
            known = ", ".join(sorted(SHAREGPT_ROLES))
            raise _Bad(f"{where} has unknown 'from' {json.dumps(speaker)} (known: {known})")
        if "value" not in item:
            raise _Bad(f"{where} has no 'value'")
        turn: Message = {"role": SHAREGPT_ROLES[speaker.lower()], "content": item["value"]}
        turn.update((k, v) for k, v in item.items() if k not in ("from", "value", "role"))
        content_field = "value"
    else:
        if "role" not in item:
            raise _Bad(f"{where} has no 'role' (or ShareGPT 'from')")
        role = item["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise _Bad(
                f"{where} has unknown role {json.dumps(role)} "
                "(allowed: system, user, assistant, tool)"
            )
        if "content" not in item:
            raise _Bad(f"{where} has no 'content'")
        turn = dict(item)
        content_field = "content"
    try:
        turn = resolve_reasoning_aliases(turn, where)
    except InputError as error:
        raise _Bad(error.reason) from None
    turn["content"] = _content(turn, f"{where}.{content_field}")
    if turn["role"] == "user" and not _text_of(turn["content"]).strip():
        raise _Bad(f"{where}.{content_field} is empty (a user turn needs content)")
    _check_extra_fields(turn, where)
    return turn


def _text_of(content: str | list[Any] | None) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return content or ""


def _content(turn: Message, where: str) -> str | list[Any] | None:
    """The content as given (a string, a list of text parts, or null where allowed)."""
    content = turn["content"]
    if content is None:
        # OpenAI style: an assistant turn that only calls tools has no content.
        if turn["role"] == "assistant" and turn.get("tool_calls"):
            return None
        raise _Bad(f"{where} is null")
    if isinstance(content, list):
        for i, part in enumerate(content):
            _text_part(part, f"{where}[{i}]")
        return content
    if not isinstance(content, str):
        raise _Bad(
            f"{where} must be a string or a list of text parts, not a JSON {json_type(content)}"
        )
    return content


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
        kind = part.get("type") if isinstance(part, dict) else json_type(part)
        raise _Bad(f"{where} is a {json.dumps(kind)} part; only text parts are supported")
    text = part.get("text")
    if not isinstance(text, str):
        raise _Bad(f"{where} has no string 'text'")
    return text


def _check_extra_fields(turn: Message, where: str) -> None:
    for name in ("name", "tool_call_id", "reasoning_content"):
        if turn.get(name) is not None and not isinstance(turn[name], str):
            raise _Bad(f"{where}.{name} must be a string, not a JSON {json_type(turn[name])}")
    if turn.get("tool_calls") is not None and not isinstance(turn["tool_calls"], list):
        raise _Bad(f"{where}.tool_calls must be a list")


def _prompt_turns(turns: list[Message], field: str) -> list[Message]:
    """Cut the turns after the last user (or tool) turn."""
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    if not any(turn["role"] == "user" for turn in turns):
        raise _Bad(f"'{field}' has no user turn")
    if turns[-1]["role"] not in ("user", "tool"):
        raise _Bad(f"'{field}' ends with a {turns[-1]['role']} turn, not a user or tool turn")
    return turns


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
                raise _Bad(
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
            raise _Bad(f"'tools' is a string that is not valid JSON ({exc})") from None
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
            raise _Bad(f"{where}.value is not valid JSON for a function call ({exc})") from None
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not calls:
        raise _Bad(f"{where}.value is an empty list of function calls")
    out: list[dict[str, Any]] = []
    for k, call in enumerate(calls):
        at = f"{where}.value[{k}]" if isinstance(parsed, list) else f"{where}.value"
        if not isinstance(call, dict):
            raise _Bad(f'{at} must be a {{"name", "arguments"}} object, not a {json_type(call)}')
        name = call.get("name")
        if not isinstance(name, str) or not name:
            raise _Bad(f"{at} has no string 'name'")
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict | str):
            raise _Bad(f"{at}.arguments must be an object or a JSON string")
        out.append(
            {
                "id": sharegpt_tool_call_id(turn, k),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return out


def _key_list(data: dict[str, Any]) -> str:
    names = [repr(name) for name in list(data)[:8]]
    return ", ".join(names) + (", ..." if len(data) > 8 else "") if names else "none"

"""Prompt files: every accepted line shape, every rejected one with its exact line and reason,
and the streaming behaviour (bad lines in between, huge lines, truncated ends, gzip)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from app.core.contracts import PromptRecord, stable_hash
from app.core.errors import ConfigurationError, InputError
from app.prompts.input_records import CONTENT_KEY_CHARS, content_key
from app.prompts.inputs import parse_chat_template_kwargs, read_prompts

U = {"role": "user", "content": "What is 2 + 2?"}
A = {"role": "assistant", "content": "4"}
S = {"role": "system", "content": "Be brief."}


def read(tmp_path: Path, data: bytes, **kwargs: Any) -> list[PromptRecord | InputError]:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(data)
    return list(read_prompts(path, **kwargs))


def line(value: Any) -> bytes:
    return json.dumps(value).encode() + b"\n"


def only_record(tmp_path: Path, value: Any) -> PromptRecord:
    [entry] = read(tmp_path, line(value))
    assert isinstance(entry, PromptRecord), entry
    assert entry.line == 1
    return entry


def only_error(tmp_path: Path, data: bytes, **kwargs: Any) -> InputError:
    [entry] = read(tmp_path, data, **kwargs)
    assert isinstance(entry, InputError), entry
    return entry


# --- accepted shapes ------------------------------------------------------------------------

GOOD: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
    ("messages", {"messages": [U]}, [U]),
    ("messages with system", {"messages": [S, U]}, [S, U]),
    ("trailing assistant dropped", {"messages": [U, A]}, [U]),
    ("multi-turn, last answer dropped", {"messages": [S, U, A, U, A]}, [S, U, A, U]),
    ("several trailing assistants dropped", {"messages": [U, A, A]}, [U]),
    (
        "sharegpt",
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        [{"role": "user", "content": "hi"}],
    ),
    (
        "sharegpt system and history",
        {
            "conversations": [
                {"from": "system", "value": "sys"},
                {"from": "Human", "value": "a"},
                {"from": "chatgpt", "value": "b"},
                {"from": "user", "value": "c"},
                {"from": "assistant", "value": "d"},
            ]
        },
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
    ),
    ("conversations with role/content", {"conversations": [S, U, A]}, [S, U]),
    ("prompt string", {"prompt": "Hello there"}, [{"role": "user", "content": "Hello there"}]),
    (
        "system field prepended",
        {"system": "Be brief.", "prompt": "Hi"},
        [S, {"role": "user", "content": "Hi"}],
    ),
    (
        "system field before sharegpt turns",
        {"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi"}]},
        [S, {"role": "user", "content": "Hi"}],
    ),
    ("empty system field ignored", {"system": " ", "messages": [U]}, [U]),
    (
        "text parts joined with a space",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}],
                }
            ]
        },
        [{"role": "user", "content": "a  b"}],
    ),
    (
        "the fields SGLang keeps per role, null ones dropped",
        {
            "messages": [
                {"role": "user", "content": "q", "name": "ann", "weight": 0, "loss": False},
                {"role": "assistant", "reasoning_content": "r", "weight": 1, "content": "a"},
                {"role": "user", "content": "q2", "tool_call_id": None},
            ]
        },
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
            {"role": "user", "content": "q2"},
        ],
    ),
    (
        "empty user content, null assistant and tool content, developer turns",
        {
            "messages": [
                {"role": "developer", "content": "d"},
                {"role": "user", "content": ""},
                {"role": "assistant", "content": None},
                {"role": "user", "content": []},
                {"role": "tool", "content": None},
            ]
        },
        [
            {"role": "developer", "content": "d"},
            {"role": "user", "content": ""},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": ""},
            {"role": "tool", "content": ""},
        ],
    ),
    (
        "tool result ends the prompt",
        {
            "messages": [
                U,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ]
        },
        [
            U,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "index": None,
                        "type": "function",
                        "function": {"name": "f", "arguments": {}},
                    }
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
    ),
    ("messages win over prompt", {"messages": [U], "prompt": "other"}, [U]),
    (
        "null messages fall through to prompt",
        {"messages": None, "prompt": "p"},
        [{"role": "user", "content": "p"}],
    ),
    (
        "empty assistant history allowed",
        {"messages": [U, {"role": "assistant", "content": ""}, U]},
        [U, {"role": "assistant", "content": ""}, U],
    ),
]


@pytest.mark.parametrize(
    ("value", "expected"), [(v, e) for _, v, e in GOOD], ids=[name for name, _, _ in GOOD]
)
def test_accepted_shapes(
    tmp_path: Path, value: dict[str, Any], expected: list[dict[str, Any]]
) -> None:
    record = only_record(tmp_path, value)
    assert record.messages == expected
    assert record.input_ids is None
    assert record.key == content_key("messages", expected)
    assert len(record.key) == CONTENT_KEY_CHARS


def test_content_key_is_a_short_stable_hash() -> None:
    assert content_key("messages", [U]) == stable_hash({"messages": [U]})[:CONTENT_KEY_CHARS]
    assert content_key("messages", [U]) != content_key("messages", [S, U])


def test_input_ids(tmp_path: Path) -> None:
    record = only_record(tmp_path, {"input_ids": [1, 2, 0, 163606]})
    assert record.input_ids == [1, 2, 0, 163606]
    assert record.messages is None
    assert record.key == content_key("input_ids", [1, 2, 0, 163606])


@pytest.mark.parametrize(("value", "key"), [(7, "7"), ("q-001", "q-001"), ("é", "é")])
def test_explicit_id_is_the_key(tmp_path: Path, value: Any, key: str) -> None:
    assert only_record(tmp_path, {"id": value, "prompt": "hi"}).key == key


def test_id_with_input_ids(tmp_path: Path) -> None:
    assert only_record(tmp_path, {"id": "x", "input_ids": [5]}).key == "x"


def test_same_turns_same_key_whatever_the_shape(tmp_path: Path) -> None:
    a = only_record(tmp_path, {"prompt": "hi"})
    b = only_record(tmp_path, {"conversations": [{"from": "human", "value": "hi"}]})
    assert a.key == b.key


# --- rejected lines -----------------------------------------------------------------------

BAD: list[tuple[str, Any, str]] = [
    ("array line", [1, 2], "line is a JSON array, not an object"),
    ("string line", "hello", "line is a JSON string, not an object"),
    ("null line", None, "line is a JSON null, not an object"),
    (
        "no prompt field",
        {"text": "x", "id": 1},
        "no prompt field: expected one of 'messages', 'conversations', 'prompt' or "
        "'input_ids' (keys: 'text', 'id')",
    ),
    (
        "empty object",
        {},
        "no prompt field: expected one of 'messages', 'conversations', 'prompt' or "
        "'input_ids' (keys: none)",
    ),
    (
        "messages not a list",
        {"messages": "hi"},
        "'messages' must be a list of turns, not a JSON string",
    ),
    ("empty messages", {"messages": []}, "'messages' is empty"),
    ("empty conversations", {"conversations": []}, "'conversations' is empty"),
    (
        "turn not an object",
        {"messages": [U, "hi"]},
        "messages[1] must be an object, not a JSON string",
    ),
    (
        "turn without role",
        {"messages": [{"content": "x"}]},
        "messages[0] has no 'role' (or ShareGPT 'from')",
    ),
    (
        "turn without content",
        {"messages": [{"role": "user"}]},
        "messages[0] has no 'content' (a user turn needs content, empty or not)",
    ),
    (
        "unknown role",
        {"messages": [{"role": "bot", "content": "x"}]},
        'messages[0] has unknown role "bot" (allowed: system, developer, user, assistant, tool)',
    ),
    (
        "role not a string",
        {"messages": [{"role": 1, "content": "x"}]},
        "messages[0] has unknown role 1 (allowed: system, developer, user, assistant, tool)",
    ),
    (
        "unknown sharegpt speaker",
        {"conversations": [{"from": "narrator", "value": "x"}]},
        "conversations[0] has unknown 'from' \"narrator\" (known: assistant, bard, bing, "
        "chatgpt, function, gpt, human, model, observation, system, tool, user)",
    ),
    (
        "sharegpt turn without value",
        {"conversations": [{"from": "human"}]},
        "conversations[0] has no 'value'",
    ),
    (
        "numeric content",
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content must be a string or a list of text and image parts, not a JSON number",
    ),
    (
        "dict content",
        {"conversations": [{"from": "human", "value": {"a": 1}}]},
        "conversations[0].value must be a string or a list of text and image parts, not a "
        "JSON object",
    ),
    (
        "null user content",
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content is null (a user turn needs content, empty or not)",
    ),
    (
        "image part without a url",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0] has no image reference (a non-empty string 'image_url.url')",
    ),
    (
        "audio part",
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        'messages[0].content[0] is a "input_audio" part; tokenmill takes text and image parts',
    ),
    (
        "image in an assistant turn",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "image", "image": "a.png"}]},
                {"role": "user", "content": "and?"},
            ]
        },
        "messages[1].content[0] is an image part in an assistant turn; images are taken in user "
        "turns and tool results",
    ),
    (
        "text part without text",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0] has no string 'text'",
    ),
    ("empty prompt", {"prompt": "  "}, "'prompt' is empty"),
    ("prompt not a string", {"prompt": ["a"]}, "'prompt' must be a string, not a JSON array"),
    (
        "only assistant turns",
        {"conversations": [{"from": "gpt", "value": "x"}]},
        "'conversations' has no turn before its assistant turns",
    ),
    (
        "name not a string (a system turn keeps it; a user turn drops it unread)",
        {"messages": [{"role": "system", "content": "x", "name": 3}, U]},
        "messages[0].name must be a string, not a JSON number",
    ),
    (
        "tool_calls not a list",
        {"messages": [U, {"role": "assistant", "content": "", "tool_calls": {"id": 1}}, U]},
        "messages[1].tool_calls must be a list",
    ),
    ("empty input_ids", {"input_ids": []}, "'input_ids' is empty"),
    (
        "input_ids not a list",
        {"input_ids": "1 2"},
        "'input_ids' must be a list of token ids, not a JSON string",
    ),
    ("negative id", {"input_ids": [1, -2]}, "'input_ids'[1] is -2, not a non-negative integer"),
    ("float id", {"input_ids": [1.5]}, "'input_ids'[0] is 1.5, not a non-negative integer"),
    ("bool id", {"input_ids": [3, True]}, "'input_ids'[1] is true, not a non-negative integer"),
    ("string id", {"input_ids": ["7"]}, "'input_ids'[0] is \"7\", not a non-negative integer"),
    (
        "id a list",
        {"id": [1], "prompt": "x"},
        "'id' must be a string or an integer, not a JSON array",
    ),
    (
        "id a bool",
        {"id": True, "prompt": "x"},
        "'id' must be a string or an integer, not a JSON boolean",
    ),
    ("id empty", {"id": "", "prompt": "x"}, "'id' is empty"),
    ("id too long", {"id": "k" * 201, "prompt": "x"}, "'id' is longer than 200 characters"),
    (
        "system not a string",
        {"system": 1, "prompt": "x"},
        "'system' must be a string, not a JSON number",
    ),
    (
        "system field and system turn",
        {"system": "a", "messages": [S, U]},
        "both a 'system' field and a system turn in 'messages'",
    ),
    (
        "system with input_ids",
        {"system": "a", "input_ids": [1]},
        "'system' cannot be combined with pre-tokenized 'input_ids'",
    ),
]


@pytest.mark.parametrize(
    ("messages", "prompt"),
    [([S, A], [S]), ([U, S], [U, S]), ([S], [S]), ([A, U, A, A], [A, U])],
    ids=["no user turn", "ending with a system turn", "system only", "greeting, two answers"],
)
def test_shapes_sglang_renders_are_read(
    tmp_path: Path, messages: list[Any], prompt: list[Any]
) -> None:
    """Every shape SGLang renders: the prompt is every turn before the trailing answers."""
    (record,) = read(tmp_path, line({"messages": messages}))
    assert isinstance(record, PromptRecord)
    assert [t["role"] for t in record.messages or []] == [t["role"] for t in prompt]


@pytest.mark.parametrize(
    ("value", "reason"), [(v, r) for _, v, r in BAD], ids=[name for name, _, _ in BAD]
)
def test_rejected_shapes(tmp_path: Path, value: Any, reason: str) -> None:
    error = only_error(tmp_path, line(value))
    assert (error.line, error.reason) == (1, reason)
    assert str(error) == f"line 1: {reason}"


RAW_BAD: list[tuple[str, bytes, str]] = [
    (
        "invalid JSON",
        b'{"prompt": "x",}\n',
        "invalid JSON: Expecting property name enclosed in double quotes: line 1 column 16 "
        "(char 15)",
    ),
    ("not JSON at all", b"hello\n", "invalid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("non-UTF-8", b'{"prompt": "caf\xe9"}\n', "line is not valid UTF-8 (bad byte at offset 15)"),
    (
        "truncated last line",
        b'{"prompt": "an unfinished',
        "truncated last line: no newline at the end of the file and the JSON is incomplete "
        "(Unterminated string starting at: line 1 column 12 (char 11))",
    ),
    ("deeply nested", b"[" * 100_000 + b"]" * 100_000 + b"\n", "invalid JSON: nested too deeply"),
]


@pytest.mark.parametrize(
    ("data", "reason"), [(d, r) for _, d, r in RAW_BAD], ids=[name for name, _, _ in RAW_BAD]
)
def test_rejected_bytes(tmp_path: Path, data: bytes, reason: str) -> None:
    error = only_error(tmp_path, data)
    assert (error.line, error.reason) == (1, reason)


def test_huge_line_is_skipped_and_reading_goes_on(tmp_path: Path) -> None:
    huge = line({"prompt": "x" * 5000})
    entries = read(
        tmp_path, line({"prompt": "a"}) + huge + line({"prompt": "b"}), max_line_bytes=1000
    )
    assert [type(e).__name__ for e in entries] == ["PromptRecord", "InputError", "PromptRecord"]
    error = entries[1]
    assert isinstance(error, InputError)
    assert (error.line, error.reason) == (2, "line is longer than 1000 bytes")
    assert entries[2].line == 3


def test_line_of_exactly_the_limit_is_read(tmp_path: Path) -> None:
    data = line({"prompt": "y" * 100})
    assert isinstance(read(tmp_path, data, max_line_bytes=len(data) - 1)[0], PromptRecord)
    assert isinstance(read(tmp_path, data, max_line_bytes=len(data) - 2)[0], InputError)


def test_huge_last_line_without_newline(tmp_path: Path) -> None:
    error = only_error(tmp_path, b'{"prompt": "' + b"z" * 3000, max_line_bytes=1000)
    assert (error.line, error.reason) == (1, "line is longer than 1000 bytes")


def test_last_line_without_newline_is_fine_when_complete(tmp_path: Path) -> None:
    entries = read(tmp_path, line({"prompt": "a"}) + b'{"prompt": "b"}')
    assert [e.line for e in entries] == [1, 2]
    assert all(isinstance(e, PromptRecord) for e in entries)


def test_duplicate_explicit_id(tmp_path: Path) -> None:
    data = (
        line({"id": "x", "prompt": "a"}) + line({"prompt": "c"}) + line({"id": "x", "prompt": "b"})
    )
    entries = read(tmp_path, data)
    error = entries[2]
    assert isinstance(error, InputError)
    assert (error.line, error.reason) == (3, "duplicate id 'x' (first seen on line 1)")


def test_integer_and_string_ids_collide(tmp_path: Path) -> None:
    entries = read(tmp_path, line({"id": 1, "prompt": "a"}) + line({"id": "1", "prompt": "b"}))
    assert isinstance(entries[1], InputError)
    assert entries[1].reason == "duplicate id '1' (first seen on line 1)"


def test_duplicate_content_without_id(tmp_path: Path) -> None:
    data = line({"prompt": "same"}) + line({"messages": [{"role": "user", "content": "same"}]})
    entries = read(tmp_path, data)
    assert isinstance(entries[1], InputError)
    assert (entries[1].line, entries[1].reason) == (2, "duplicate prompt: same content as line 1")


def test_bad_lines_between_good_ones(tmp_path: Path) -> None:
    data = b"".join(
        [
            line({"prompt": "one"}),  # 1
            b"\n",  # 2 blank
            b"{broken\n",  # 3
            line({"messages": [U]}),  # 4
            b"   \t\r\n",  # 5 blank
            line([1]),  # 6
            line({"conversations": [{"from": "human", "value": "two"}]}),  # 7
            b'{"prompt": "\xff"}\n',  # 8
            line({"input_ids": [3, 4]}),  # 9
            line({"messages": [A]}),  # 10
            b'{"id": "last", "prompt": "three"}\r\n',  # 11
            b'{"prompt": "cut',  # 12
        ]
    )
    entries = read(tmp_path, data)
    good = [(e.line, e.key) for e in entries if isinstance(e, PromptRecord)]
    bad = [(e.line, e.reason.split(":")[0]) for e in entries if isinstance(e, InputError)]
    assert [n for n, _ in good] == [1, 4, 7, 9, 11]
    assert good[-1][1] == "last"
    assert bad == [
        (3, "invalid JSON"),
        (6, "line is a JSON array, not an object"),
        (8, "line is not valid UTF-8 (bad byte at offset 12)"),
        (10, "'messages' has no turn before its assistant turns"),
        (12, "truncated last line"),
    ]
    assert [e.line for e in entries] == sorted(e.line for e in entries)


def test_byte_order_mark_on_the_first_line(tmp_path: Path) -> None:
    entries = read(tmp_path, b"\xef\xbb\xbf" + line({"prompt": "a"}) + line({"prompt": "b"}))
    assert all(isinstance(e, PromptRecord) for e in entries)


def test_gzip_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl.gz"
    path.write_bytes(gzip.compress(line({"prompt": "a"}) + b"oops\n"))
    entries = list(read_prompts(path))
    assert isinstance(entries[0], PromptRecord)
    assert isinstance(entries[1], InputError) and entries[1].line == 2


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"cannot open the prompts file .*nope\.jsonl"):
        list(read_prompts(tmp_path / "nope.jsonl"))


def test_reading_is_lazy(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(line({"prompt": "a"}) + line({"prompt": "b"}))
    entries = read_prompts(path)
    first = next(entries)
    assert isinstance(first, PromptRecord) and first.line == 1
    with path.open("ab") as fh:  # appended after reading began: still seen, so it streams
        fh.write(line({"prompt": "c"}))
    assert [e.line for e in entries] == [2, 3]


def test_demo_prompts_are_all_valid() -> None:
    from importlib import resources

    path = Path(str(resources.files("emulator") / "data" / "demo_prompts.jsonl"))
    entries = list(read_prompts(path))
    assert len(entries) >= 55
    assert all(isinstance(e, PromptRecord) for e in entries), [
        str(e) for e in entries if isinstance(e, InputError)
    ]
    shapes = {
        next(k for k in ("messages", "conversations", "prompt") if k in json.loads(raw))
        for raw in path.read_text(encoding="utf-8").splitlines()
    }
    assert shapes == {"messages", "conversations", "prompt"}


# --- --chat-template-kwargs ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, {}),
        ("", {}),
        ("  ", {}),
        ('{"thinking": false}', {"thinking": False}),
        ('{"a": {"b": [1]}}', {"a": {"b": [1]}}),
    ],
)
def test_chat_template_kwargs(text: str | None, expected: dict[str, Any]) -> None:
    assert parse_chat_template_kwargs(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[1, 2]",
            "--chat-template-kwargs must be a JSON object such as "
            "'{\"thinking\": false}', not a JSON array",
        ),
        (
            "true",
            "--chat-template-kwargs must be a JSON object such as "
            "'{\"thinking\": false}', not a JSON boolean",
        ),
        (
            "thinking=false",
            "--chat-template-kwargs is not valid JSON (Expecting value: line 1 "
            "column 1 (char 0)); give a JSON object such as "
            "'{\"thinking\": false}'",
        ),
    ],
)
def test_bad_chat_template_kwargs(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_chat_template_kwargs(text)
    assert str(info.value) == message


TOOL_A = {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}
TOOL_B = {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("auto", ["a", "b"]),
        ("required", ["a", "b"]),
        ("none", None),
        ({"type": "function", "function": {"name": "b"}}, ["b"]),
    ],
)
def test_tool_choice_picks_the_rendered_tools(tmp_path: Path, choice: Any, names: Any) -> None:
    """tool_choice applied as SGLang applies it, and kept in the row's metadata; with
    request_fields off (`--no-request-fields`) the tools are the row's, as before."""
    row = {"messages": [U], "tools": [TOOL_A, TOOL_B], "tool_choice": choice}
    (record,) = read(tmp_path, line(row))
    assert isinstance(record, PromptRecord)
    got = None if record.tools is None else [t["function"]["name"] for t in record.tools]
    assert got == names
    assert record.metadata["tool_choice"] == choice
    (kept,) = read(tmp_path, line(row), request_fields=False)
    assert isinstance(kept, PromptRecord) and kept.tools is not None and len(kept.tools) == 2

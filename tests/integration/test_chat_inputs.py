"""Agentic rows through the real producer on SQLite and Postgres: tools (list or JSON string),
per-row kwargs, reasoning aliases and metadata reach the prompts, the ledger and every export;
verify re-renders from what each item stored, so lost tools or kwargs fail it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, func, select, update

from app.core.constants import NORMALIZATION_VERSION
from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import ConfigurationError
from app.ledger import claims, common, reads, run_queries
from app.ledger import outcomes as ledger_outcomes
from app.outputs.export import export_run
from app.outputs.parquet_export import export_parquet
from app.outputs.verify import CHECK_TEMPLATE, verify_run
from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from app.prompts.transformers_pin import as_server_renders
from tests.support import sglang_chat_path as sglang
from tests.support.chat_templates import AGENT_TEMPLATE, tokenizer_with_template
from workers.intake.producer import EnqueueOptions, enqueue

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
CALL = {
    "id": "c1",
    "index": None,
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
AGENTIC = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "18C", "tool_call_id": "c1"},
]
ROWS: list[dict[str, Any]] = [
    {"id": "tools", "messages": AGENTIC, "tools": [WEATHER, SEARCH], "source": "web"},
    {
        "id": "tools-string",
        "messages": [{"role": "user", "content": "Search cats"}],
        "tools": json.dumps([WEATHER, SEARCH]),
        "chat_template_kwargs": {"thinking": False},
        "source": "web",
        "category": "search",
    },
    {
        "id": "alias",
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "thinking": "add them"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "3+3?"}],
            },
        ],
        "reasoning_effort": "low",
    },
    {"id": "plain", "prompt": "Write a haiku."},
    {
        "id": "bad",
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}],
            },
            {"role": "tool", "content": "r", "tool_call_id": "c1"},
        ],
    },
]
RUN_KWARGS = {"thinking": True}
# the tools as SGLang's Tool.model_dump() gives them to the template
TOOLS_DUMPED = [
    {**WEATHER, "defer_loading": None},
    {
        "type": "function",
        "function": {"name": "search", "parameters": {"type": "object"}, "description": None},
        "defer_loading": None,
    },
]


@pytest.fixture(scope="module")
def agent(kimi_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    folder = tmp_path_factory.mktemp("agent") / "tok"
    return load_tokenizer(tokenizer_with_template(kimi_tokenizer_dir, folder, AGENT_TEMPLATE))


def expected_ids(tok: ChatTokenizer, row: dict[str, Any], tools: Any, **kwargs: Any) -> list[int]:
    """The prompt from SGLang's own turn functions and the template run directly."""
    # tokenmill reads `thinking` as reasoning_content (an alias SGLang's models do not have)
    given = [
        {("reasoning_content" if k == "thinking" else k): v for k, v in t.items()}
        for t in row["messages"]
    ]
    turns = sglang.reference_messages(given, tok.content_format)
    with (
        as_server_renders()
    ):  # transformers 5.19's rendering (tests/integration/test_sglang_oracle)
        text = tok.hf_tokenizer.apply_chat_template(
            turns, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
    return list(tok.hf_tokenizer.encode(text, add_special_tokens=False))


def enqueue_rows(db: Engine, tok: ChatTokenizer, tmp_path: Path, name: str) -> Any:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS), encoding="utf-8")
    options = EnqueueOptions(path, name, SamplingParams(max_new_tokens=4, seed=1), 1, RUN_KWARGS)
    return enqueue(db, tok, options, publish=None)


def stored(db: Engine, name: str, status: str = "pending") -> dict[str, reads.StoredItem]:
    with db.connect() as conn:
        run = run_queries.get_run(conn, name)
        return {i.item_key: i for i in reads.iter_items(conn, run.id, statuses=(status,))}


def finish_all(db: Engine, tok: ChatTokenizer, name: str) -> run_queries.RunInfo:
    eos = tok.eos_token_ids[0]
    with db.begin() as conn:
        run = run_queries.get_run(conn, name)
        claimed = claims.claim_next(conn, owner="w", server="gpu-a", lease_s=60, limit=100)
        outcomes: list[ledger_outcomes.Outcome] = [
            ledger_outcomes.Done(
                c.id,
                GenerateResult(
                    rid=f"r{c.id}",
                    output_ids=[500, 501, eos],
                    finish_reason="stop",
                    matched_stop=eos,
                    prompt_tokens=len(c.prompt_ids),
                    completion_tokens=3,
                    cached_tokens=0,
                    e2e_latency_s=0.1,
                ),
            )
            for c in claimed
        ]
        ledger_outcomes.record_outcomes(conn, outcomes, owner="w", lease_s=60)
    return run


def test_every_template_input_reaches_the_prompt(
    db: Engine, agent: ChatTokenizer, tmp_path: Path
) -> None:
    report = enqueue_rows(db, agent, tmp_path, "agentic")
    assert (report.prompts, report.inserted, report.skipped) == (4, 4, 1)
    (error,) = report.errors
    assert error.line == 5 and "messages[1].tool_calls[0].function.arguments" in error.reason
    assert report.prompt_fields == {  # the rows that were read (not the bad one)
        "messages": 3,
        "tools": 2,
        "chat_template_kwargs": 1,
        "reasoning_effort": 1,
        "prompt": 1,
    }
    assert report.key_fields == {"id": 4}
    assert report.metadata_fields == {"source": 2, "category": 1}

    found = stored(db, "agentic")
    assert found["tools"].tools == TOOLS_DUMPED == found["tools-string"].tools
    # stored in the key order the template renders: the function's given keys first
    assert found["tools"].tools is not None
    assert list(found["tools"].tools[1]["function"]) == ["name", "parameters", "description"]
    tools_dumped = TOOLS_DUMPED
    assert found["tools"].prompt_ids == expected_ids(agent, ROWS[0], tools_dumped, **RUN_KWARGS)
    assert found["tools-string"].prompt_ids == expected_ids(
        agent, ROWS[1], tools_dumped, thinking=False
    )
    assert agent.decode(found["tools-string"].prompt_ids).endswith("<think></think>")
    effort = {"thinking": True, "enable_thinking": True, "reasoning_effort": "low"}
    assert found["alias"].chat_template_kwargs == effort
    alias_ids = expected_ids(agent, ROWS[2], None, **effort)
    assert found["alias"].prompt_ids == alias_ids
    assert "<think>add them</think>4" in agent.decode(alias_ids)
    assert "and 3+3?" in agent.decode(alias_ids)  # string template: parts joined with a space
    assert found["plain"].tools is None and found["plain"].chat_template_kwargs is None
    # the stored turns are the normalized ones: arguments parsed, null content ""
    assert found["tools"].messages is not None
    assert found["tools"].messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert found["tools"].messages[1]["content"] == ""
    assert found["tools"].metadata == {"source": "web"}
    assert found["tools-string"].metadata == {"source": "web", "category": "search"}
    assert found["alias"].metadata is None

    with db.connect() as conn:
        run = run_queries.get_run(conn, "agentic")
        assert run.generation.normalization_version == NORMALIZATION_VERSION
        count = (
            select(func.count())
            .select_from(common.tool_sets)
            .where(common.tool_sets.c.run_id == run.id)
        )
        assert conn.execute(count).scalar_one() == 1  # one tools list, stored once
    again = enqueue_rows(db, agent, tmp_path, "agentic")
    assert (again.inserted, again.already_present) == (0, 4)


def test_verify_re_renders_from_what_each_item_stored(
    db: Engine, agent: ChatTokenizer, tmp_path: Path
) -> None:
    enqueue_rows(db, agent, tmp_path, "verified")
    run = finish_all(db, agent, "verified")
    clean = verify_run(db, run, agent)
    assert clean.clean, clean.to_json()
    assert clean.checks[CHECK_TEMPLATE].checked == 4

    found = stored(db, "verified", "done")
    with db.begin() as conn:  # the tools of one row lost, the kwargs of another
        conn.execute(
            update(common.items)
            .where(common.items.c.id == found["tools"].id)
            .values(tool_set_id=None)
        )
        conn.execute(
            update(common.items)
            .where(common.items.c.id == found["tools-string"].id)
            .values(chat_template_kwargs=None)
        )
    report = verify_run(db, run, agent)
    template = report.checks[CHECK_TEMPLATE]
    assert not report.clean and template.mismatches == 2
    assert {m.key for m in template.examples} == {"tools", "tools-string"}


def test_unknown_normalization_rules_are_refused(
    db: Engine, agent: ChatTokenizer, tmp_path: Path
) -> None:
    enqueue_rows(db, agent, tmp_path, "pinned")
    run = finish_all(db, agent, "pinned")
    with db.begin() as conn:
        conn.execute(
            update(common.runs).where(common.runs.c.id == run.id).values(normalization_version="v0")
        )
        run = run_queries.get_run(conn, "pinned")
    report = verify_run(db, run, agent)
    assert not report.clean
    assert any("'v0', which this tokenmill does not have" in f for f in report.findings)
    assert report.checks[CHECK_TEMPLATE].checked == 0
    with pytest.raises(ConfigurationError, match="does not have"):
        enqueue_rows(db, agent, tmp_path, "pinned")


def test_exports_carry_metadata_tools_and_kwargs(
    db: Engine, agent: ChatTokenizer, tmp_path: Path
) -> None:
    enqueue_rows(db, agent, tmp_path, "exported")
    run = finish_all(db, agent, "exported")
    specforge = tmp_path / "sf.jsonl"
    export_run(db, run, "specforge", specforge)
    rows = {r["id"]: r for r in map(json.loads, specforge.read_text().splitlines())}
    assert rows["tools-string"]["metadata"] == {"source": "web", "category": "search"}
    assert "metadata" not in rows["plain"]

    conversations = tmp_path / "conv.jsonl"
    export_run(db, run, "conversations", conversations, tokenizer=agent)
    conv = {r["id"]: r for r in map(json.loads, conversations.read_text().splitlines())}
    assert conv["tools"]["tools"] == TOOLS_DUMPED
    assert conv["tools-string"]["chat_template_kwargs"] == {"thinking": False}
    assert conv["tools"]["metadata"] == {"source": "web"}
    assert conv["tools"]["conversations"][1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }

    out = tmp_path / "parquet"
    export_parquet(db, run, out.as_uri())
    table = pq.read_table(next(out.rglob("part-*.parquet")))
    by_id = dict(
        zip(table.column("id").to_pylist(), table.column("metadata").to_pylist(), strict=True)
    )
    assert json.loads(by_id["tools"]) == {"source": "web"}
    assert by_id["plain"] is None

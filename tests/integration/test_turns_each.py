"""`--turns each` on SQLite and Postgres: one item per boundary with its original history,
idempotent re-enqueue, one message per conversation, exports per turn; and `--turns all`
refusing tool conversations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import ConfigurationError
from app.ledger import claims, outcomes, reads, run_queries
from app.outputs.export import export_run
from app.prompts.chat_path import normalize_messages, normalize_tools
from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from workers.intake.producer import EnqueueOptions, EnqueueReport, enqueue

CALL: dict[str, Any] = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "search", "arguments": '{"q": "tides"}'},
        }
    ],
}
AGENT: list[dict[str, Any]] = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "When is high tide?"},
    CALL,
    {"role": "tool", "tool_call_id": "call_0", "content": "06:12 and 18:40"},
    {"role": "assistant", "content": "At 06:12 and 18:40."},
    {"role": "user", "content": "Thanks. And low tide?"},
]
CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "alpha"},
    {"role": "assistant", "content": "ORIGINAL alpha"},
    {"role": "user", "content": "beta"},
    {"role": "assistant", "content": "ORIGINAL beta"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
LINES: list[dict[str, Any]] = [
    {
        "id": "agent",
        "messages": AGENT,
        "tools": TOOLS,
        "chat_template_kwargs": {"thinking": False},
        "source": "tide-bot",
    },
    {"id": "chat", "messages": CHAT},
    {"id": "single", "prompt": "one question"},
]
# key → the boundary prompts (turn index → original turns before it)
BOUNDARIES: dict[str, dict[int, list[dict[str, Any]]]] = {
    "agent": {0: AGENT[:2], 1: AGENT[:4], 2: AGENT},
    "chat": {0: CHAT[:1], 1: CHAT[:3]},
    "single": {0: [{"role": "user", "content": "one question"}]},
}


@pytest.fixture
def tokenizer(kimi_tokenizer_dir: Path) -> ChatTokenizer:
    return load_tokenizer(kimi_tokenizer_dir)


def write_lines(tmp_path: Path, lines: list[dict[str, Any]]) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def enqueue_each(
    db: Engine,
    tokenizer: ChatTokenizer,
    path: Path,
    *,
    turns: str = "each",
    published: list[list[int]] | None = None,
    batch_size: int = 32,
) -> EnqueueReport:
    options = EnqueueOptions(
        path,
        "agentic",
        SamplingParams(max_new_tokens=32, seed=3),
        samples_per_prompt=2,
        turns=turns,
        batch_size=batch_size,
    )
    publish = None if published is None else published.append
    return enqueue(db, tokenizer, options, publish=publish)


def enqueued_run(db: Engine, tokenizer: ChatTokenizer, tmp_path: Path) -> run_queries.RunInfo:
    """The run of LINES, enqueued with --turns each."""
    enqueue_each(db, tokenizer, write_lines(tmp_path, LINES))
    with db.connect() as conn:
        return run_queries.get_run(conn, "agentic")


def all_items(db: Engine, run_id: int) -> list[reads.StoredItem]:
    statuses = ("waiting", "pending", "queued", "leased", "done", "failed")
    with db.connect() as conn:
        return list(reads.iter_items(conn, run_id, statuses=statuses))


def test_each_boundary_is_an_item_on_its_original_history(
    db: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    path = write_lines(tmp_path, LINES)
    report = enqueue_each(db, tokenizer, path)
    assert report.errors == []
    assert report.inserted == 2 * (3 + 2 + 1)
    with db.connect() as conn:
        run = run_queries.get_run(conn, "agentic")
    assert run.generation.turns == "each"
    found = all_items(db, run.id)
    keys = sorted((i.item_key, i.sample_index, i.turn_index) for i in found)
    expected = sorted(
        (key, k, turn) for key, turns in BOUNDARIES.items() for turn in turns for k in (0, 1)
    )
    assert keys == expected
    for item in found:
        history = BOUNDARIES[item.item_key][item.turn_index]
        assert item.status == "pending"
        assert item.messages == normalize_messages(history, tokenizer.content_format)
        if item.item_key == "agent":  # every boundary carries the row's template inputs
            assert (item.tools, item.metadata) == (normalize_tools(TOOLS), {"source": "tide-bot"})
            assert item.chat_template_kwargs == {"thinking": False}
            assert item.prompt_ids == tokenizer.apply(history, {"thinking": False}, TOOLS)
        else:
            assert (item.tools, item.chat_template_kwargs, item.metadata) == (None, None, None)
            assert item.prompt_ids == tokenizer.apply(history)
    # within a conversation, ids run shortest history first
    agent = [i for i in found if i.item_key == "agent"]
    lengths = [len(i.prompt_ids) for i in sorted(agent, key=lambda i: i.id)]
    assert lengths == sorted(lengths)

    again = enqueue_each(db, tokenizer, path)
    assert (again.inserted, again.already_present, again.errors) == (0, 3, [])
    assert len(all_items(db, run.id)) == len(found)


def test_a_conversation_is_published_in_one_message(
    db: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    path = write_lines(tmp_path, LINES)
    published: list[list[int]] = []
    report = enqueue_each(db, tokenizer, path, published=published, batch_size=4)
    assert report.published == 12
    with db.connect() as conn:
        run = run_queries.get_run(conn, "agentic")
    key_of = {i.id: i.item_key for i in all_items(db, run.id)}
    # the agent's 6 items exceed batch_size 4 and still share one message; the chat's 4 and
    # the single prompt's 2 do not fit together in 4
    assert [sorted({key_of[i] for i in m}) for m in published] == [["agent"], ["chat"], ["single"]]
    assert [len(m) for m in published] == [6, 4, 2]
    assert sorted(i for m in published for i in m) == sorted(key_of)


def test_a_turn_over_the_context_is_reported_and_the_others_kept(
    db: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    long_answer = {"role": "assistant", "content": "word " * 400}
    line = {"id": "long", "messages": [AGENT[1], long_answer, {"role": "user", "content": "ok"}]}
    path = write_lines(tmp_path, [line])
    limit = len(tokenizer.apply([AGENT[1]])) + 50
    tokenizer._context_length = limit  # a model with a small context
    report = enqueue_each(db, tokenizer, path)
    assert report.inserted == 2
    assert [(e.line, e.reason.split(":")[0]) for e in report.errors] == [(1, "turn 1")]
    assert "context length" in report.errors[0].reason


def test_exports_carry_the_regenerated_turn(
    db: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    run = enqueued_run(db, tokenizer, tmp_path)
    found = all_items(db, run.id)
    answer = [*tokenizer.hf_tokenizer.encode("fine", add_special_tokens=False)]
    answer.append(tokenizer.eos_token_ids[0])
    result = GenerateResult("r", answer, "stop", None, 10, len(answer), 0, 0.1)
    with db.begin() as conn:
        claims.claim_items(conn, [i.id for i in found], owner="w", server="s", lease_s=60)
        outcomes.record_outcomes(
            conn, [outcomes.Done(i.id, result) for i in found], owner="w", lease_s=60
        )

    out = tmp_path / "sf.jsonl"
    export_run(db, run, "specforge", out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["id"], r["sample"], r["turn"]) for r in rows) == sorted(
        (i.item_key, i.sample_index, i.turn_index) for i in found
    )
    by_turn = {(r["id"], r["sample"], r["turn"]): r for r in rows}
    agent_turn_1 = by_turn[("agent", 0, 1)]
    assert (
        agent_turn_1["input_ids"] == tokenizer.apply(AGENT[:4], {"thinking": False}, TOOLS) + answer
    )

    conv = tmp_path / "conv.jsonl"
    export_run(db, run, "conversations", conv, tokenizer=tokenizer)
    conv_rows = {
        (r["id"], r["sample"], r["turn"]): r for r in map(json.loads, conv.read_text().splitlines())
    }
    assert len(conv_rows) == len(found)
    turns = conv_rows[("agent", 1, 2)]["conversations"]
    assert turns[:-1] == normalize_messages(AGENT, tokenizer.content_format)
    assert turns[-1]["role"] == "assistant" and turns[-1]["content"] == "fine"

    with pytest.raises(ConfigurationError, match="boundary samples"):
        export_run(db, run, "specforge", tmp_path / "w.jsonl", whole_conversation=True)


def test_turns_all_takes_tool_conversations_as_agentic_chains(
    db: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    # the Kimi-shaped vocabulary holds <|tool_calls_section_begin|>: SGLang detects kimi_k2
    path = write_lines(tmp_path, LINES)
    report = enqueue_each(db, tokenizer, path, turns="all")
    assert report.errors == []
    with db.connect() as conn:
        run = run_queries.get_run(conn, "agentic")
    assert run is not None and (run.generation.chat_pins or {})["tool_call_parser"] == "kimi_k2"


def test_the_runner_claims_whole_conversations(
    db: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    run = enqueued_run(db, tokenizer, tmp_path)
    with db.begin() as conn:
        first = claims.claim_next_groups(
            conn, owner="a", server="gpu-a", lease_s=60, limit=1, run_id=run.id
        )
    # the first key in id order, every sample and turn of it
    assert {c.item_key for c in first} == {"agent"} and len(first) == 6
    assert sorted(c.turn_index for c in first) == [0, 0, 1, 1, 2, 2]
    with db.begin() as conn:
        rest = claims.claim_next_groups(
            conn, owner="b", server="gpu-b", lease_s=60, limit=5, run_id=run.id
        )
        nothing = claims.claim_next_groups(
            conn, owner="c", server="gpu-c", lease_s=60, limit=5, run_id=run.id
        )
    assert sorted({c.item_key for c in rest}) == ["chat", "single"] and len(rest) == 6
    assert nothing == []

"""Each stage of the enqueue pipeline on its own: read, plan, template or render, build items,
store and publish (on the SQLite ledger), report."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.core.contracts import PromptRecord
from app.core.errors import InputError, PermanentError
from app.ledger import queue, run_queries
from app.prompts.template_pool import Templater
from app.prompts.tokenization import ChatTokenizer
from app.sglang.render import RenderRequest
from workers.intake.prompting import (
    ItemBuilder,
    LocalTemplating,
    PromptedChunk,
    PromptIds,
    ServerRendering,
)
from workers.intake.reading import CHUNK_LINES, PlannedChunk, Planner, ReadChunk, Reader
from workers.intake.reporting import EnqueueReport, Reporter
from workers.intake.storing import Publisher, Store, pack

USER = [{"role": "user", "content": "Hello"}]
AGENTIC = [
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": "first answer"},
    {"role": "user", "content": "two"},
    {"role": "assistant", "content": "second answer"},
]


def reporter(unit: str = "line") -> tuple[Reporter, list[InputError], list[int]]:
    errors: list[InputError] = []
    progress: list[int] = []
    return (
        Reporter(
            EnqueueReport(run="r"), unit=unit, on_error=errors.append, on_progress=progress.append
        ),
        errors,
        progress,
    )


def chat(line: int, key: str, messages: list[dict[str, str]] = USER) -> PromptRecord:
    return PromptRecord(line=line, key=key, messages=[dict(m) for m in messages])  # type: ignore[misc]


@pytest.fixture(scope="module")
def tokenizer(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


# --- read ------------------------------------------------------------------------------------


def test_reader_yields_chunks_and_reports_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) for i in range(CHUNK_LINES)]
    lines.insert(3, "{not json")
    path.write_text("\n".join(lines) + "\n")
    rep, errors, _ = reporter()
    chunks = list(
        Reader(
            path, prompt_field=None, content_format="string", pass_turn_fields=False, turns="last"
        ).chunks(rep)
    )
    assert [len(c.records) for c in chunks] == [CHUNK_LINES - 1, 1]
    assert [c.first_line for c in chunks] == [1, CHUNK_LINES + 1]
    assert chunks[-1].lines == CHUNK_LINES + 1
    assert [e.line for e in errors] == [4] and rep.report.errors == errors
    assert rep.report.key_fields["id"] == CHUNK_LINES


def test_reader_refuses_an_empty_input_at_once(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(InputError, match="is empty"):
        Reader(
            path, prompt_field=None, content_format="string", pass_turn_fields=False, turns="last"
        )


def test_reporter_names_rows_of_a_table_input() -> None:
    rep, errors, _ = reporter(unit="row")
    rep.fail(InputError("bad", 7))
    assert errors[0].unit == "row" and errors[0].line == 7


# --- plan ------------------------------------------------------------------------------------


def test_planner_drops_keys_the_run_holds_and_counts_them() -> None:
    asked: list[list[str]] = []

    def existing(keys: Iterable[str]) -> set[str]:
        asked.append(list(keys))
        return {"b"}

    rep, _, _ = reporter()
    planner = Planner("last", existing_keys=existing, reporter=rep)
    planned = planner.plan(ReadChunk([chat(1, "a"), chat(2, "b")], 1, 2))
    assert [r.key for r in planned.records] == ["a"] and planned.turn_of is None
    assert asked == [["a", "b"]]
    assert (rep.report.prompts, rep.report.already_present) == (2, 1)


def test_planner_splits_each_boundary_and_plans_chains() -> None:
    rep, _, _ = reporter()
    each = Planner("each", existing_keys=None, reporter=rep).plan(
        ReadChunk([chat(1, "a", AGENTIC)], 1, 1)
    )
    assert each.turn_of == [0, 1]
    assert [len(r.messages or []) for r in each.records] == [1, 3]
    chained = Planner("all", existing_keys=None, reporter=rep).plan(
        ReadChunk([chat(1, "a", AGENTIC)], 1, 1)
    )
    assert [len(r.messages or []) for r in chained.records] == [1]
    assert len(chained.plans["a"]) == 2


# --- template or render ------------------------------------------------------------------------


def test_local_templating_keeps_pre_tokenized_ids_in_place(tokenizer: ChatTokenizer) -> None:
    templater = Templater(tokenizer, 1)
    try:
        records = [chat(1, "a"), PromptRecord(line=2, key="b", input_ids=[5, 6]), chat(3, "c")]
        ids = LocalTemplating(templater, {}).start(PlannedChunk(records, 3)).ids.result()
    finally:
        templater.close()
    expected = tokenizer.apply_batch([USER], {})[0]
    assert ids == [expected, [5, 6], expected]


class FakeRenderer:
    """Renders each request as [its number of turns], refusing requests with two turns."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def render_many(self, requests: Sequence[RenderRequest]) -> list[list[int] | PermanentError]:
        self.asked.append(len(requests))
        return [
            PermanentError("too many") if len(r.messages) == 2 else [len(r.messages)]
            for r in requests
        ]


def test_server_rendering_names_the_line_it_refuses() -> None:
    renderer = FakeRenderer()
    records = [
        chat(1, "a"),
        PromptRecord(line=2, key="b", input_ids=[9]),
        chat(3, "c", AGENTIC[:2]),
    ]
    ids = ServerRendering(renderer, {}).start(PlannedChunk(records, 3)).ids.result()
    assert renderer.asked == [2]  # one call per chunk, chat records only
    assert ids[:2] == [[1], [9]]
    assert isinstance(ids[2], InputError) and ids[2].line == 3
    assert "the render server refused the prompt: too many" in ids[2].reason


# --- build -----------------------------------------------------------------------------------


def prompted(planned: PlannedChunk, ids: PromptIds) -> PromptedChunk:
    done: Future[PromptIds] = Future()
    done.set_result(ids)
    return PromptedChunk(planned, done)


def test_builder_refuses_empty_and_too_long_prompts_with_their_lines() -> None:
    rep, errors, _ = reporter()
    builder = ItemBuilder(run_kwargs={}, samples_per_prompt=2, context_length=4, reporter=rep)
    records = [chat(1, "a"), chat(2, "b"), chat(3, "c"), chat(4, "d")]
    items = builder.items(
        prompted(PlannedChunk(records, 4), [[1, 2], [], [1, 2, 3, 4], InputError("broken", 4)])
    )
    assert [(i.item_key, i.sample_index) for i in items] == [("a", 0), ("a", 1)]
    assert [(e.line, e.reason) for e in errors] == [
        (2, "the prompt is empty after templating"),
        (3, "prompt has 4 tokens, at or over the model's context length 4"),
        (4, "broken"),
    ]


def test_builder_makes_boundary_items_and_names_their_turn() -> None:
    rep, errors, _ = reporter()
    builder = ItemBuilder(run_kwargs={}, samples_per_prompt=1, context_length=None, reporter=rep)
    planned = PlannedChunk([chat(1, "a"), chat(1, "a", AGENTIC[:3])], 1, turn_of=[0, 1])
    items = builder.items(prompted(planned, [[7], []]))
    assert [(i.item_key, i.turn_index, i.prompt_ids) for i in items] == [("a", 0, [7])]
    assert errors[0].reason == "turn 1: the prompt is empty after templating"


# --- store and publish -------------------------------------------------------------------------


def new_items(keys: str) -> list[queue.NewItem]:
    return [queue.NewItem(k, 0, n + 1, None, [1, 2, 3]) for n, k in enumerate(keys)]


def test_store_inserts_in_order_publishes_and_reports_progress(
    sqlite_engine: Engine, run: run_queries.RunInfo
) -> None:
    rep, _, progress = reporter()
    published: list[list[int]] = []
    publisher = Publisher(sqlite_engine, run.id, published.append, rep, group_size=None)
    store = Store(sqlite_engine, run.id, link_chains=False, publisher=publisher, reporter=rep)
    try:
        store.submit(new_items("abc"), 3)
        store.submit(new_items("cde"), 5)  # "c" is already stored
        store.flush()
    finally:
        store.close()
    assert rep.report.inserted == 5 and progress == [3, 5]
    assert [len(p) for p in published] == [3, 2]
    assert published[0] + published[1] == sorted(published[0] + published[1])
    assert rep.report.published == 5
    publisher.publish_pending()  # nothing new: nothing sent again
    assert len(published) == 2


def test_publisher_keeps_a_conversation_in_one_message(
    sqlite_engine: Engine, run: run_queries.RunInfo
) -> None:
    rep, _, _ = reporter()
    items = [queue.NewItem(k, 0, 1, None, [1], t) for k in "ab" for t in range(3)]
    with sqlite_engine.begin() as conn:
        queue.insert_items(conn, run.id, items)
    published: list[list[int]] = []
    Publisher(sqlite_engine, run.id, published.append, rep, group_size=4).publish_pending()
    assert [len(m) for m in published] == [3, 3]


def test_pack_never_splits_a_group() -> None:
    assert pack([[1, 2], [3], [4, 5, 6, 7, 8], [9]], 4) == [[1, 2, 3], [4, 5, 6, 7, 8], [9]]

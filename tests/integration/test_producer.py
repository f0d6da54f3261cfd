"""The producer against real Postgres with the fixture tokenizer: counts, bad lines skipped
with their numbers, reruns that add nothing, refused setting changes, published ids only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.core.contracts import SamplingParams
from app.core.errors import RunMismatch
from app.ledger import reads, run_queries
from app.prompts.tokenization import ChatTokenizer
from workers.intake.producer import EnqueueOptions, enqueue


@pytest.fixture(scope="module")
def tokenizer(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD = [
    json.dumps({"id": "a", "messages": [{"role": "user", "content": "Hello there"}]}),
    json.dumps({"id": "b", "prompt": "Explain queues."}),
    json.dumps({"id": "c", "input_ids": [163587, 400, 401, 163601]}),
]


def test_enqueue_counts_publishes_and_reruns_add_nothing(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [GOOD[0], "{not json", GOOD[1], json.dumps({"id": "d", "messages": []}), GOOD[2]],
    )
    published: list[list[int]] = []
    options = EnqueueOptions(
        path, "p1", SamplingParams(max_new_tokens=64, seed=3), samples_per_prompt=2
    )
    report = enqueue(pg_engine, tokenizer, options, publish=published.append)
    assert (report.prompts, report.inserted, report.published, report.skipped) == (3, 6, 6, 2)
    assert [e.line for e in report.errors] == [2, 4]
    assert all(isinstance(i, int) for batch in published for i in batch)
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "p1")
        counts = reads.run_counts(conn, run)
        rows = {
            (i.item_key, i.sample_index): i
            for i in reads.iter_items(conn, run.id, statuses=("queued",))
        }
    assert counts.queued == 6
    assert rows[("a", 1)].prompt_ids == tokenizer.apply(
        [{"role": "user", "content": "Hello there"}]
    )
    assert rows[("a", 1)].prompt_ids[-1] == 163606  # K2.5's template opens <think>
    assert rows[("c", 0)].prompt_ids == [163587, 400, 401, 163601]

    again = enqueue(pg_engine, tokenizer, options, publish=published.append)
    assert (again.inserted, again.published, again.already_present) == (0, 0, 3)


def test_crash_before_publishing_is_healed_by_the_next_enqueue(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    path = write_lines(tmp_path / "in.jsonl", GOOD)
    options = EnqueueOptions(path, "p2", SamplingParams())
    enqueue(pg_engine, tokenizer, options, publish=None)  # rows written, nothing published
    published: list[int] = []
    report = enqueue(pg_engine, tokenizer, options, publish=published.extend)
    assert report.inserted == 0 and sorted(published) == [1, 2, 3]


def test_other_settings_for_an_existing_run_are_refused(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    path = write_lines(tmp_path / "in.jsonl", GOOD)
    enqueue(pg_engine, tokenizer, EnqueueOptions(path, "p3", SamplingParams(seed=1)), publish=None)
    with pytest.raises(RunMismatch, match="max_new_tokens: 2048 → 99"):
        enqueue(
            pg_engine,
            tokenizer,
            EnqueueOptions(path, "p3", SamplingParams(seed=1, max_new_tokens=99)),
            publish=None,
        )
    with pytest.raises(RunMismatch, match="chat template kwargs"):
        enqueue(
            pg_engine,
            tokenizer,
            EnqueueOptions(
                path, "p3", SamplingParams(seed=1), chat_template_kwargs={"thinking": False}
            ),
            publish=None,
        )


def test_prompt_over_the_context_length_is_skipped_with_its_line(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    assert tokenizer.context_length is not None
    huge = json.dumps({"id": "big", "input_ids": [400] * tokenizer.context_length})
    path = write_lines(tmp_path / "in.jsonl", [GOOD[0], huge])
    report = enqueue(
        pg_engine, tokenizer, EnqueueOptions(path, "p4", SamplingParams()), publish=None
    )
    assert report.inserted == 1
    assert [(e.line, "context length" in e.reason) for e in report.errors] == [(2, True)]

"""The `specforge` export of a real run (producer → ledger results → export_run) passes the
checks SpecForge applies to `data.prompts_path` rows; broken rows fail them, each named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.core.contracts import GenerateResult, SamplingParams
from app.ledger import claims, run_queries
from app.ledger import outcomes as ledger_outcomes
from app.outputs.export import export_run
from app.outputs.specforge_checks import file_problems, row_problems
from app.prompts.tokenization import load_tokenizer
from workers.intake.producer import EnqueueOptions, enqueue

PROMPTS = [
    {"id": "a", "messages": [{"role": "user", "content": "Hello there"}]},
    {"id": "b", "prompt": "Explain queues."},
    {"id": "c", "input_ids": [163587, 400, 401, 163601]},
]


def test_specforge_export_of_a_run_passes_specforge_checks(
    sqlite_engine: Engine, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    tokenizer = load_tokenizer(kimi_tokenizer_dir)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    options = EnqueueOptions(source, "sf", SamplingParams(max_new_tokens=4), samples_per_prompt=2)
    enqueue(sqlite_engine, tokenizer, options, publish=None)
    eos = tokenizer.eos_token_ids[0]
    with sqlite_engine.begin() as conn:
        run = run_queries.get_run(conn, "sf")
        claimed = claims.claim_next(conn, owner="w", server="s", lease_s=60, limit=100)
        outcomes: list[ledger_outcomes.Outcome] = []
        for n, c in enumerate(claimed):
            output = [700, 701, 702, 703] if n % 2 else [700, eos]
            result = GenerateResult(
                rid=str(c.id),
                output_ids=output,
                finish_reason="length" if n % 2 else "stop",
                matched_stop=None if n % 2 else eos,
                prompt_tokens=len(c.prompt_ids),
                completion_tokens=len(output),
                cached_tokens=0,
                e2e_latency_s=0.1,
            )
            outcomes.append(ledger_outcomes.Done(c.id, result))
        ledger_outcomes.record_outcomes(conn, outcomes, owner="w", lease_s=60)

    out = tmp_path / "sf.jsonl"
    report = export_run(sqlite_engine, run, "specforge", out)
    assert report.rows == 6
    assert list(file_problems(out)) == []
    # SpecForge cuts rows to its max_length: the answers still fit in the prompt + 4 tokens
    longest_prompt = max(
        len(json.loads(line)["input_ids"]) - 4 for line in out.read_text().splitlines()
    )
    assert list(file_problems(out, max_length=longest_prompt + 1)) == []


GOOD: dict[str, Any] = {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"input_ids": [1, 2]}, "missing loss_mask"),
        ({**GOOD, "loss_mask": [0, 0, 1]}, "input_ids has 4 ids but loss_mask 3 values"),
        ({**GOOD, "loss_mask": [0, 2, 1, 1]}, "loss_mask[1] is 2, not 0 or 1"),
        ({**GOOD, "loss_mask": [0, 0, 0, 0]}, "0 trainable tokens, fewer than 1"),
        ({**GOOD, "input_ids": [1, 2.5, 3, 4]}, "input_ids[1] is 2.5, not an integer"),
        ({**GOOD, "input_ids": [1, True, 3, 4]}, "input_ids[1] is true, not an integer"),
        ({**GOOD, "input_ids": [[1, 2, 3, 4]]}, "input_ids is not one-dimensional"),
        ({"input_ids": [], "loss_mask": []}, "input_ids is empty"),
        ({**GOOD, "loss_mask": "0011"}, "loss_mask is not a list"),
    ],
)
def test_broken_rows_fail_with_their_reason(row: dict[str, Any], problem: str) -> None:
    assert row_problems(GOOD) == []
    assert any(problem in p for p in row_problems(row)), row_problems(row)


def test_answers_past_max_length_would_be_dropped(tmp_path: Path) -> None:
    assert row_problems(GOOD, max_length=3) == []
    assert row_problems(GOOD, max_length=2) == [
        "0 trainable tokens within the first 2 tokens, fewer than 1: SpecForge drops the row"
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + "{oops\n" + json.dumps({"input_ids": [1]}) + "\n")
    found = list(file_problems(path))
    assert [line for line, _ in found] == [3, 4]
    assert found[1][1] == "missing loss_mask"

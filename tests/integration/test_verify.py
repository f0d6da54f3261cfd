"""`tokenmill verify` against real Postgres: a run built by the real producer with results
written through the ledger is clean; tampered rows are each named; the CLI's exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, update

from app.core.contracts import GenerateResult, SamplingParams
from app.core.settings import get_settings
from app.ledger import claims, common, reads, run_queries
from app.ledger import outcomes as ledger_outcomes
from app.outputs.verify import (
    CHECK_COMPLETION,
    CHECK_LENGTH,
    CHECK_PROMPT,
    CHECK_STOP,
    CHECK_TEMPLATE,
    verify_run,
)
from app.prompts.tokenization import ChatTokenizer
from ops.cli import cli
from tests.support.procs import clean_env, tokenmill
from workers.intake.producer import EnqueueOptions, enqueue

MAX_NEW = 6
LINES = [
    {"id": "a", "messages": [{"role": "user", "content": "Hello there"}]},
    {"id": "b", "prompt": "Explain queues."},
    {
        "id": "c",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "And now?"},
        ],
    },
    {"id": "d", "input_ids": [163587, 400, 401, 163601]},
    {"id": "e", "prompt": "Write a haiku."},
]


@pytest.fixture(scope="module")
def tokenizer(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


def build_run(
    db: Engine, tokenizer: ChatTokenizer, tmp_path: Path, name: str
) -> run_queries.RunInfo:
    """Enqueue LINES with the real producer, then finish every item through the ledger: "e"
    truncated at max_new_tokens, the others stopped on EOS."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES), encoding="utf-8")
    options = EnqueueOptions(path, name, SamplingParams(max_new_tokens=MAX_NEW, seed=1))
    report = enqueue(db, tokenizer, options, publish=None)
    assert report.inserted == len(LINES)
    eos = tokenizer.eos_token_ids[0]
    with db.begin() as conn:
        run = run_queries.get_run(conn, name)
        claimed = claims.claim_next(conn, owner="w", server="gpu-a", lease_s=60, limit=100)
        keys = {i.id: i.item_key for i in reads.iter_items(conn, run.id, statuses=("leased",))}
        outcomes: list[ledger_outcomes.Outcome] = []
        for c in claimed:
            truncated = keys[c.id] == "e"
            output = [500 + k for k in range(MAX_NEW)] if truncated else [500, 501, eos]
            result = GenerateResult(
                rid=f"r{c.id}",
                output_ids=output,
                finish_reason="length" if truncated else "stop",
                matched_stop=None if truncated else eos,
                prompt_tokens=len(c.prompt_ids),
                completion_tokens=len(output),
                cached_tokens=0,
                e2e_latency_s=0.1,
            )
            outcomes.append(ledger_outcomes.Done(c.id, result))
        ledger_outcomes.record_outcomes(conn, outcomes, owner="w", lease_s=60)
    return run


def item_id(db: Engine, run: run_queries.RunInfo, key: str) -> int:
    with db.connect() as conn:
        return next(i.id for i in reads.iter_items(conn, run.id) if i.item_key == key)


def tamper(db: Engine, run: run_queries.RunInfo, key: str, **values: object) -> int:
    target = item_id(db, run, key)
    with db.begin() as conn:
        conn.execute(update(common.items).where(common.items.c.id == target).values(**values))
    return target


def test_clean_run_then_each_tampering_is_named(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    run = build_run(pg_engine, tokenizer, tmp_path, "v1")
    report = verify_run(pg_engine, run, tokenizer)
    assert report.clean, report.to_json()
    checks = report.checks
    assert report.items == 5
    assert (checks[CHECK_TEMPLATE].checked, checks[CHECK_TEMPLATE].not_checkable) == (4, 1)
    assert (checks[CHECK_STOP].checked, checks[CHECK_LENGTH].checked) == (4, 1)
    assert checks[CHECK_COMPLETION].checked == checks[CHECK_PROMPT].checked == 5

    with pg_engine.connect() as conn:
        stored = {i.item_key: i for i in reads.iter_items(conn, run.id)}
    changed_prompt = list(stored["a"].prompt_ids)
    changed_prompt[2] += 1
    a = tamper(pg_engine, run, "a", prompt_ids=changed_prompt)
    b = tamper(pg_engine, run, "b", output_ids=[500, 501], completion_tokens=2)
    c = tamper(pg_engine, run, "c", completion_tokens=9)
    e = tamper(pg_engine, run, "e", output_ids=[500] * (MAX_NEW - 1), completion_tokens=MAX_NEW - 1)
    d = tamper(pg_engine, run, "d", prompt_tokens=3)

    report = verify_run(pg_engine, run, tokenizer)
    assert not report.clean
    checks = report.checks
    found = {name: [(m.item_id, m.detail) for m in t.examples] for name, t in checks.items()}
    assert [i for i, _ in found[CHECK_TEMPLATE]] == [a]
    assert "position 2" in found[CHECK_TEMPLATE][0][1]
    assert [i for i, _ in found[CHECK_STOP]] == [b]
    assert "last output id 501 is not a stop/EOS id" in found[CHECK_STOP][0][1]
    assert [i for i, _ in found[CHECK_COMPLETION]] == [c]
    assert "the server reported completion_tokens 9" in found[CHECK_COMPLETION][0][1]
    assert [i for i, _ in found[CHECK_LENGTH]] == [e]
    assert f"{MAX_NEW - 1} output ids; max_new_tokens is {MAX_NEW}" in found[CHECK_LENGTH][0][1]
    assert [i for i, _ in found[CHECK_PROMPT]] == [d]
    assert report.to_json()["clean"] is False


def test_a_changed_tokenizer_is_a_finding(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    run = build_run(pg_engine, tokenizer, tmp_path, "v2")
    with pg_engine.begin() as conn:
        conn.execute(
            update(common.runs).where(common.runs.c.id == run.id).values(tokenizer_hash="f" * 64)
        )
        run = run_queries.get_run(conn, "v2")
    report = verify_run(pg_engine, run, tokenizer)
    assert not report.clean
    assert len(report.findings) == 1
    assert "not the ones the run pinned: tokenizer files: hash" in report.findings[0]
    assert "ffffffffffff pinned" in report.findings[0]


def test_cli_exit_codes(
    pg_engine: Engine,
    pg_url: str,
    tokenizer: ChatTokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = build_run(pg_engine, tokenizer, tmp_path, "v3")
    for name, value in clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=pg_url).items():
        if name.startswith("TOKENMILL_"):
            monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    try:
        clean = CliRunner().invoke(cli, ["verify", "v3", "--json"])
        assert clean.exit_code == 0, clean.output
        assert json.loads(clean.stdout)["clean"] is True
        missing = CliRunner().invoke(cli, ["verify", "no-such-run"])
        assert missing.exit_code == 2
        assert "no run named 'no-such-run'" in missing.output
    finally:
        get_settings.cache_clear()

    # the real command line, in a subprocess
    bad = tamper(pg_engine, run, "b", output_ids=[500, 501], completion_tokens=2)
    env = clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=pg_url)
    dirty = tokenmill(["verify", "v3"], env)
    assert dirty.returncode == 1, dirty.stderr
    assert "FAIL stop_token" in dirty.stdout
    assert f"item {bad} (id 'b', sample 0, turn 0)" in dirty.stdout


def test_export_is_checked_against_the_ledger(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    from app.outputs.parquet_export import export_parquet

    run = build_run(pg_engine, tokenizer, tmp_path, "v4")
    out = tmp_path / "export"
    export_parquet(pg_engine, run, str(out), shard_rows=2)
    report = verify_run(pg_engine, run, tokenizer, export_url=str(out))
    assert report.clean, report.to_json()
    assert report.export is not None
    assert (report.export.rows, report.export.shards) == (5, 3)

    shard = sorted(out.glob("part-*.parquet"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    report = verify_run(pg_engine, run, tokenizer, export_url=str(out))
    assert not report.clean
    assert report.export is not None and any(shard.name in p for p in report.export.problems)
    assert report.to_json()["export"]["problems"] == report.export.problems

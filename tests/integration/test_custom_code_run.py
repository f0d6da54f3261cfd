"""A run made with the custom-code (Kimi-shaped) fixture tokenizer: the path is stored absolute,
verify and export honour the pinned --trust-remote-code from another folder, and an enqueue
after the tokenizer's helper module changed is refused with the file named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import RunMismatch
from app.ledger import claims, reads, run_queries
from app.ledger import outcomes as ledger_outcomes
from app.prompts.tokenization import load_tokenizer
from emulator.fixtures.agentic_rows import agentic_rows
from emulator.fixtures.kimi_custom import HELPER_MODULE, ensure_agentic_tokenizer
from tests.support.procs import clean_env, tokenmill
from workers.intake.producer import EnqueueOptions, enqueue

ROWS = 40


def finish_every_item(db: Engine, run: run_queries.RunInfo, eos: int) -> None:
    with db.begin() as conn:
        claimed = claims.claim_next(conn, owner="w", server="gpu-a", lease_s=60, limit=1000)
        outcomes: list[ledger_outcomes.Outcome] = []
        for c in claimed:
            output = [500, 501, eos]
            result = GenerateResult(
                rid=f"r{c.id}",
                output_ids=output,
                finish_reason="stop",
                matched_stop=eos,
                prompt_tokens=len(c.prompt_ids),
                completion_tokens=len(output),
                cached_tokens=0,
                e2e_latency_s=0.1,
            )
            outcomes.append(ledger_outcomes.Done(c.id, result))
        ledger_outcomes.record_outcomes(conn, outcomes, owner="w", lease_s=60)


def test_a_custom_code_run_is_pinned(
    pg_engine: Engine, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = ensure_agentic_tokenizer(tmp_path / "cache")
    folder = Path(shutil.copytree(built, tmp_path / "tok"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in agentic_rows(ROWS)), encoding="utf-8")

    monkeypatch.chdir(tmp_path)  # a relative --tokenizer path, as typed
    tokenizer = load_tokenizer("tok", trust_remote_code=True)
    options = EnqueueOptions(
        rows, "agentic", SamplingParams(max_new_tokens=4, seed=1), trust_remote_code=True
    )
    report = enqueue(pg_engine, tokenizer, options, publish=None)
    assert (report.inserted, report.skipped) == (ROWS, 0), report.to_json()
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "agentic")
    assert run.generation.tokenizer_path == str(folder.resolve())
    assert run.generation.trust_remote_code
    assert (
        run.generation.tokenizer_files is not None
        and HELPER_MODULE in run.generation.tokenizer_files
    )
    with pg_engine.connect() as conn:
        pending = reads.iter_items(conn, run.id, statuses=("pending",))
        prompts = {i.item_key: i.prompt_ids for i in pending}
    # the row's tools reached the template through the folder's helper module
    assert "namespace functions {\n// Current weather of a city.\ntype get_weather" in (
        tokenizer.decode(prompts["agentic-0"])
    )
    finish_every_item(pg_engine, run, tokenizer.eos_token_ids[0])

    # verify and export from another folder, without --trust-remote-code: the run pins it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=pg_url)
    verified = tokenmill(["verify", "agentic"], env, cwd=elsewhere)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "clean" in verified.stdout
    out = elsewhere / "conversations.jsonl"
    exported = tokenmill(
        ["export", "agentic", "--format", "conversations", "--out", str(out)], env, cwd=elsewhere
    )
    assert exported.returncode == 0, exported.stderr
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == ROWS
    assert json.loads(lines[0])["conversations"][-1]["role"] == "assistant"

    # the helper module changes: the same run refuses the enqueue and names the file
    helper = folder / HELPER_MODULE
    helper.write_text(helper.read_text().replace("namespace functions", "namespace fns"))
    changed = load_tokenizer(folder, trust_remote_code=True)
    with pytest.raises(RunMismatch, match=f"tokenizer file '{HELPER_MODULE}' changed"):
        enqueue(pg_engine, changed, options, publish=None)
    # the command line too, with no --trust-remote-code: the run's pin lets the code load
    refused = tokenmill(
        ["enqueue", str(rows), "--run", "agentic", "--tokenizer", str(folder)],
        env,
        cwd=elsewhere,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert HELPER_MODULE in refused.stderr
    # verify reports the changed file, and neither verify nor the export runs its code
    marker = tmp_path / "helper-ran"
    helper.write_text(
        helper.read_text() + f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    )
    dirty = tokenmill(["verify", "agentic"], env, cwd=elsewhere)
    assert dirty.returncode == 1
    assert f"tokenizer file '{HELPER_MODULE}' changed" in dirty.stdout
    assert "their code was not run" in dirty.stdout
    refused_export = tokenmill(
        ["export", "agentic", "--format", "conversations", "--out", str(out)], env, cwd=elsewhere
    )
    assert refused_export.returncode == 2, refused_export.stdout + refused_export.stderr
    assert HELPER_MODULE in refused_export.stderr
    assert not marker.exists()
    # an explicit --trust-remote-code checks with the changed files anyway
    forced = tokenmill(["verify", "agentic", "--trust-remote-code"], env, cwd=elsewhere)
    assert forced.returncode == 1
    assert marker.read_text() == "ran"


def test_custom_code_without_the_flag_names_it(
    pg_engine: Engine, pg_url: str, tmp_path: Path
) -> None:
    folder = ensure_agentic_tokenizer(tmp_path / "cache")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "hello"}) + "\n", encoding="utf-8")
    env = clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=pg_url)
    refused = tokenmill(["enqueue", str(rows), "--run", "x", "--tokenizer", str(folder)], env)
    assert refused.returncode == 2
    assert "pass --trust-remote-code" in refused.stderr

"""The README's commands through the real CLI in subprocesses: `tokenmill demo` with no
services configured, and `run` → `status --json` → `export` against an emulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.emulator_proc import start_emulator
from tests.support.procs import clean_env, tokenmill

pytestmark = pytest.mark.e2e


def test_demo_runs_on_embedded_defaults(tmp_path: Path) -> None:
    # point the service URLs nowhere: the demo must not need or touch them
    env = clean_env(tmp_path / "data") | {
        "TOKENMILL_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/x",
        "TOKENMILL_BROKER_URL": "redis://127.0.0.1:1/0",
    }
    result = tokenmill(["demo"], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "0 mismatches" in result.stderr
    exported = [line for line in result.stdout.splitlines() if line.startswith("specforge:")]
    path = Path(exported[0].split()[1])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows and all(len(r["input_ids"]) == len(r["loss_mask"]) for r in rows)


def test_run_status_export(tmp_path: Path, kimi_tokenizer_dir: Path) -> None:
    env = clean_env(tmp_path / "data")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            [json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) for i in range(20)]
            + ["not json", json.dumps({"id": "long", "prompt": "x " * 40})]
        )
        + "\n"
    )
    emulator = start_emulator(["--step-ms", "1", "--median-tokens", "30", "--context-length", "64"])
    try:
        run = tokenmill(
            [
                "run",
                str(prompts),
                "--run",
                "r1",
                "--tokenizer",
                str(kimi_tokenizer_dir),
                "--server",
                emulator.url,
                "--max-new-tokens",
                "40",
                "--json",
            ],
            env,
            tmp_path,
        )
    finally:
        emulator.stop()
    assert run.returncode == 0, run.stderr
    assert "line 21" in run.stderr  # the bad line is named
    status = tokenmill(["status", "r1", "--json"], env, tmp_path)
    counts = json.loads(status.stdout)
    assert {k: counts[k] for k in ("total", "pending", "queued", "leased")} == {
        "total": 21,
        "pending": 0,
        "queued": 0,
        "leased": 0,
    }
    assert counts["done"] + counts["failed"] == 21 and counts["truncated"] >= 1
    assert counts["failed"] >= 1  # prompt + max_new_tokens over the 64-token context: a 400
    out = tmp_path / "r1.jsonl"
    export = tokenmill(["export", "r1", "--format", "specforge", "--out", str(out)], env, tmp_path)
    assert export.returncode == 0, export.stderr
    assert len(out.read_text().splitlines()) == counts["done"]

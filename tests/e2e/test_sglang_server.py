"""tokenmill against SGLang 0.5.23's own HTTP server (tests/support/sglang_http): the wheel's
FastAPI app, TokenizerManager and DetokenizerManager, only the scheduler replaced by a fake
that speaks SGLang's IPC messages. One server for the session (`sglang_server`)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import clean_env, tokenmill
from tests.support.sglang_http.harness import SGLangServer

pytestmark = pytest.mark.e2e

ROWS = 12
MAX_NEW = 32


def _generate(server: SGLangServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/generate", json=body, timeout=30)


def test_generate_is_sglangs_own(sglang_server: SGLangServer) -> None:
    body = {"input_ids": [300, 301, 302], "sampling_params": {"max_new_tokens": 8}}
    first, again = _generate(sglang_server, body).json(), _generate(sglang_server, body).json()
    assert first["output_ids"] == again["output_ids"]  # deterministic
    assert 1 <= len(first["output_ids"]) <= 8
    meta = first["meta_info"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(first["output_ids"])
    assert meta["finish_reason"]["type"] in {"stop", "length"}
    too_long = {"input_ids": [300] * 200, "sampling_params": {"max_new_tokens": 8}}
    answer = _generate(sglang_server, too_long)
    assert answer.status_code == 400
    assert "longer than the model's context length (128 tokens)" in answer.text


def _rows(path: Path) -> Path:
    """ROWS short prompts and one whose prompt and MAX_NEW tokens overrun the context (128)."""
    rows = [{"id": f"q{i}", "prompt": f"question {i} about tides"} for i in range(ROWS)]
    rows.append({"id": "long", "prompt": "x " * 110})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_run_export_parity(
    sglang_server: SGLangServer, tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    """`tokenmill run` on SGLang's server: every item done but the over-context one, failed at
    once (one attempt) with SGLang's own 400; the export is token-exact to what the server
    answers for the same ids; `parity` (the server's /v1/tokenize) finds every prompt equal."""
    env = clean_env(tmp_path / "data")
    prompts = _rows(tmp_path / "p.jsonl")
    argv = ["run", str(prompts), "--run", "s1", "--tokenizer", str(kimi_tokenizer_dir)]
    argv += ["--server", sglang_server.base_url, "--max-new-tokens", str(MAX_NEW)]
    run = tokenmill(argv, env, tmp_path)
    assert run.returncode == 0, run.stderr
    status = json.loads(tokenmill(["status", "s1", "--json"], env, tmp_path).stdout)
    assert (status["total"], status["done"], status["failed"]) == (ROWS + 1, ROWS, 1)

    with sqlite3.connect(tmp_path / "data" / "ledger.sqlite3") as db:
        failed = db.execute("SELECT item_key, attempts, error FROM items WHERE status = 'failed'")
        [(key, attempts, error)] = failed.fetchall()
    assert (key, attempts) == ("long", 1)
    assert "Requested token count exceeds the model's maximum context length of 128" in error

    out = tmp_path / "s1.jsonl"
    export = tokenmill(["export", "s1", "--out", str(out)], env, tmp_path)
    assert export.returncode == 0, export.stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(s["id"] for s in samples) == sorted(f"q{i}" for i in range(ROWS))
    for sample in samples:
        start = sample["loss_mask"].index(1)
        prompt, output = sample["input_ids"][:start], sample["input_ids"][start:]
        body = {"input_ids": prompt, "sampling_params": sample["sampling_params"]}
        assert _generate(sglang_server, body).json()["output_ids"] == output, sample["id"]

    parity = tokenmill(
        ["parity", "s1", "--server", sglang_server.base_url, "--json"], env, tmp_path
    )
    assert parity.returncode == 0, parity.stderr
    report = json.loads(parity.stdout)
    assert (report["checked"], report["equal"], report["mismatched"]) == (ROWS + 1, ROWS + 1, 0)
    assert report["versions"]["server_sglang"] == "0.5.23"

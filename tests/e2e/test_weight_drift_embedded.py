"""The embedded runner (`tokenmill run` with two --server) when one server's weights are
updated in place mid-run: its answers of the new weights are never written, the other server
finishes the run, and nothing is lost or duplicated; the export holds the old weights only."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from app.ledger import common, database, reads, run_queries
from emulator.config import EmulatorConfig
from emulator.model import generate_output
from ops.emulator_proc import start_emulator
from tests.support.procs import ROOT, clean_env, tokenmill

pytestmark = pytest.mark.e2e

ITEMS = 200
FLAGS = ["--step-ms", "8", "--median-tokens", "40", "--weight-version", "step-100"]
CONFIG = EmulatorConfig(step_ms=8, median_tokens=40, weight_version="step-100")
# 4 requests in flight per server: the run lasts some 8 s, so the update lands with most of it
# still to send however loaded the machine is (at 64 the run could end before it did)
INFLIGHT = "4"


def test_one_server_updated_in_place_under_tokenmill_run(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    data = tmp_path / "data"
    env = clean_env(data, TOKENMILL_INFLIGHT=INFLIGHT)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(ITEMS))
    )
    emulators = [start_emulator(FLAGS) for _ in range(2)]
    runner = subprocess.Popen(
        [sys.executable, "-m", "ops", "run", str(prompts), "--run", "r", "--tokenizer",
         str(kimi_tokenizer_dir), "--server", emulators[0].url, "--server", emulators[1].url,
         "--max-new-tokens", "60", "--seed", "2"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    db = database.make_engine(f"sqlite:///{data / 'ledger.sqlite3'}")
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with db.connect() as conn:
                    if reads.run_counts(conn, run_queries.get_run(conn, "r")).done >= 20:
                        break
            except Exception:  # the run or the ledger does not exist yet
                pass
            assert time.monotonic() < deadline and runner.poll() is None, runner.stderr
            time.sleep(0.2)
        answer = httpx.post(
            f"{emulators[0].url}/update_weights_from_disk",
            json={"model_path": CONFIG.model_path, "weight_version": "step-200"},
            timeout=60,
        )
        assert answer.json()["success"]
        _, err = runner.communicate(timeout=300)
    finally:
        if runner.poll() is None:
            runner.kill()
        for emu in emulators:
            emu.stop()
    assert runner.returncode == 0, err
    with db.connect() as conn:
        run = run_queries.get_run(conn, "r")
        stored = list(reads.iter_items(conn, run.id, statuses=("done", "failed")))
        events = conn.execute(select(common.events.c.kind, common.events.c.message)).all()
    db.dispose()
    assert len(stored) == ITEMS and all(s.status == "done" for s in stored)
    assert len({s.item_key for s in stored}) == ITEMS
    assert {s.weight_version for s in stored} == {"step-100"}
    for s in stored:
        expected, _ = generate_output(s.prompt_ids, run.generation.sampling.for_sample(0), CONFIG)
        assert s.output_ids == expected, s.item_key
    changed = [m for kind, m in events if kind == "weights_changed"]
    assert changed and "weight_version: step-100 → step-200" in changed[0]
    export = tokenmill(["export", "r", "--out", str(tmp_path / "r.jsonl")], env, tmp_path)
    assert export.returncode == 0, export.stderr
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(rows) == ITEMS and {r["weight_version"] for r in rows} == {"step-100"}

"""An image prompt that fits the context as sent but not once its images are expanded fails at
once with the server's message (SGLang checks the context on the expanded ids: sglang.md,
"Images on /generate"), spending one attempt; the image prompts that fit are done, and the
server is not paused for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.ledger import reads, run_queries
from ops.emulator_proc import start_emulator
from tests.e2e.test_image_drift import events_about, ledger_of, single_image_rows
from tests.support.image_reference import image_counts, image_size
from tests.support.procs import ROOT, clean_env

pytestmark = pytest.mark.e2e

# chart (300x200) is 88 image tokens and fits; photo (640x480) is 414 and does not
CONTEXT = 300


def test_a_prompt_over_the_context_once_expanded_fails_at_once_with_the_servers_message(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    rows, expected = single_image_rows(tmp_path / "rows", ["chart", "photo"], 2)
    flags = ["--mm", "kimi", "--tokenizer", str(kimi_tokenizer_dir), "--step-ms", "2"]
    server = start_emulator([*flags, "--median-tokens", "6", "--context-length", str(CONTEXT)])
    try:
        run = subprocess.run(
            [sys.executable, "-m", "ops", "run", str(rows), "--run", "ctx", "--tokenizer",
             str(kimi_tokenizer_dir), "--server", server.url, "--max-new-tokens", "8"],
            env=clean_env(tmp_path / "data"), cwd=ROOT, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
    finally:
        server.stop()
    db = ledger_of(tmp_path / "data")
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, "ctx").id
        stored = {
            s.item_key: s for s in reads.iter_items(conn, run_id, statuses=("done", "failed"))
        }
    said = events_about(db, server.url)
    db.dispose()
    assert "2 done" in run.stderr and "2 failed" in run.stderr, run.stderr
    assert set(stored) == set(expected)
    for key, item in stored.items():
        _, image = expected[key]
        (count,) = image_counts([image])
        if key.startswith("chart"):
            assert count < CONTEXT - len(item.prompt_ids)
            assert (item.status, item.image_token_counts) == ("done", [count]), key
        else:
            # the ids as sent fit; expanded they do not
            assert len(item.prompt_ids) < CONTEXT < len(item.prompt_ids) - 1 + count
            assert (item.status, item.attempts) == ("failed", 1), key
            assert item.error is not None and "longer than the model's context" in item.error
            assert str(len(item.prompt_ids) - 1 + count) in item.error, item.error
    assert image_size(expected["photo-0"][1]) == (640, 480)
    assert not [line for line in said if "paused" in line or "drift" in line], said

"""Image token drift under `tokenmill run`: a server that serves other ids than the request's
with each placeholder repeated is paused with the first difference, and nothing it served is
written; a server restarted mid-run with another `--mm-process-config` is paused too, and every
stored sample keeps the image token counts of the run's settings (nothing mixed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.exc import OperationalError

from app.core.errors import NotFound
from app.core.models import run_image_tokens
from app.ledger import common as ledger_common
from app.ledger import database, reads, run_queries
from emulator.config import EmulatorConfig
from ops.emulator_proc import start_emulator
from tests.support.emulator import free_port
from tests.support.emulator import start_emulator as start_emulator_on
from tests.support.image_reference import image_counts, image_size, qwen_tokens, template_ids
from tests.support.image_rows import IMAGE, make_images
from tests.support.procs import ROOT, clean_env, wait_for

pytestmark = pytest.mark.e2e

QWEN_IMAGE_PAD = 151655
QWEN_BOS = ("<|endoftext|>", 151643)
REFUSED = ("fingerprint_mismatch: ", "image_drift: ")


def single_image_rows(folder: Path, names: list[str], copies: int) -> tuple[Path, dict[str, Any]]:
    """copies rows per image name, each one user turn: the image, then a question; the
    expected (template turns, image file) of each row key."""
    images = make_images(folder)
    rows, expected = [], {}
    for name in names:
        for i in range(copies):
            key = f"{name}-{i}"
            question = f"Question {i}: what is in the picture?"
            text = {"type": "text", "text": question}
            image = {"type": "image_url", "image_url": {"url": f"photos/{images[name].name}"}}
            rows.append({"id": key, "messages": [{"role": "user", "content": [image, text]}]})
            expected[key] = ([{"role": "user", "content": [IMAGE, text]}], images[name])
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path, expected


def bos_on_retokenize(folder: Path, out: Path) -> Path:
    """The tokenizer folder with a post-processor that puts a BOS before every text it
    encodes with special tokens (as LLaVA-style tokenizers do): the ids tokenmill renders are
    unchanged, but a server that re-tokenizes the decoded prompt serves one id more."""
    shutil.copytree(folder, out)
    spec = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    token, token_id = QWEN_BOS
    text, pair = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": token, "type_id": 0}}, text],
        "pair": [text, pair],
        "special_tokens": {token: {"id": token, "ids": [token_id], "tokens": [token]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return out


def ledger_of(data: Path) -> Engine:
    return database.make_engine(f"sqlite:///{data / 'ledger.sqlite3'}")


def events_about(db: Engine, url: str) -> list[str]:
    """The kind and message of every event whose server or message names the server at url."""
    name = url.removeprefix("http://")
    with db.connect() as conn:
        rows = conn.execute(
            select(
                ledger_common.events.c.kind,
                ledger_common.events.c.server,
                ledger_common.events.c.message,
            )
        ).all()
    return [f"{kind}: {message}" for kind, server, message in rows if name in f"{server} {message}"]


def test_a_server_that_drifts_is_paused_and_nothing_it_served_is_written(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    from emulator.fixtures.qwen_vl import ensure_qwen_vl_tokenizer

    qwen = ensure_qwen_vl_tokenizer(tmp_path / "tokenizers")
    drifting_tokenizer = bos_on_retokenize(qwen, tmp_path / "server-tokenizer")
    rows, expected = single_image_rows(tmp_path / "rows", ["chart", "photo", "poster"], 4)
    common = ["--mm", "qwen", "--step-ms", "2", "--median-tokens", "6"]
    good = start_emulator([*common, "--tokenizer", str(qwen)])
    drifting = start_emulator([*common, "--tokenizer", str(drifting_tokenizer), "--mm-retokenize"])
    env = clean_env(tmp_path / "data")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "ops", "run", str(rows), "--run", "drift", "--tokenizer",
             str(qwen), "--server", drifting.url, "--server", good.url, "--max-new-tokens", "8"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        good.stop()
        drifting.stop()
    assert run.returncode == 0, run.stderr
    db = ledger_of(tmp_path / "data")
    said = events_about(db, drifting.url)
    assert any("drift" in line and "position 0" in line for line in said), said
    with db.connect() as conn:
        info = run_queries.get_run(conn, "drift")
        stored = list(reads.iter_items(conn, info.id))
    db.dispose()
    assert len(stored) == len(expected) and {s.status for s in stored} == {"done"}
    drifting_name = drifting.url.removeprefix("http://")
    assert not [s.item_key for s in stored if drifting_name in (s.server or "")]
    for s in stored:
        messages, image = expected[s.item_key]
        assert s.prompt_ids == template_ids(qwen, messages)
        assert s.image_token_counts == [qwen_tokens(*image_size(image))], s.item_key


def done_with_both_images(db: Engine, run: str, wanted: int) -> bool:
    """Whether the run has wanted done items and a recorded count for each of its images."""
    try:
        with db.connect() as conn:
            info = run_queries.get_run(conn, run)
            recorded = conn.execute(
                select(run_image_tokens.c.sha256).where(run_image_tokens.c.run_id == info.id)
            ).all()
            return reads.run_counts(conn, info).done >= wanted and len(recorded) >= 2
    except (OperationalError, NotFound):  # the ledger or the run is not there yet
        return False


def refusals(db: Engine, url: str) -> list[str]:
    """The events that stopped the server at url serving the run: its fingerprint differs
    from the run's, or what it served drifted."""
    return [line for line in events_about(db, url) if line.startswith(REFUSED)]


def test_a_server_restarted_with_other_image_settings_is_paused(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    rows, expected = single_image_rows(tmp_path / "rows", ["square", "photo"], 8)
    # two slots a server, about 1 s an answer: most of the run is left when the restart comes
    flags = ("--mm", "kimi", "--max-running", "2", "--step-ms", "25", "--median-tokens", "40")
    flags += ("--sigma", "0")
    cfg = EmulatorConfig(port=free_port())
    stays = start_emulator(list(flags))
    restarted = start_emulator_on(cfg, *flags)
    restarted.wait_ready()
    url = restarted.url
    data = tmp_path / "data"
    runner = subprocess.Popen(
        [sys.executable, "-m", "ops", "run", str(rows), "--run", "restart", "--tokenizer",
         str(kimi_tokenizer_dir), "--server", stays.url, "--server", url,
         "--max-new-tokens", "40", "--samples-per-prompt", "2", "--seed", "4"],
        env=clean_env(data, TOKENMILL_INFLIGHT="2"),  # a server holds 2 items: work is left
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    db = ledger_of(data)
    try:
        wait_for(
            "4 done, both images counted", lambda: done_with_both_images(db, "restart", 4), 120
        )
        # the other server holds its requests meanwhile: only the restarted one could go on
        httpx.post(f"{stays.url}/pause_generation", json={"mode": "in_place"}, timeout=10)
        restarted.stop()
        other = '{"image": {"in_patch_limit": 1024}}'
        restarted = start_emulator_on(cfg, *flags, "--mm-process-config", other)
        restarted.wait_ready()
        wait_for("the restarted server refused", lambda: bool(refusals(db, url)), 120)
        httpx.post(f"{stays.url}/continue_generation", json={}, timeout=10)
        _, err = runner.communicate(timeout=300)
    finally:
        if runner.poll() is None:
            runner.kill()
        stays.stop()
        restarted.stop()
    assert runner.returncode == 0, err
    said = refusals(db, url)
    assert any("in_patch_limit" in line or "drift" in line for line in said), said
    with db.connect() as conn:
        info = run_queries.get_run(conn, "restart")
        stored = list(reads.iter_items(conn, info.id))
    db.dispose()
    assert len(stored) == 2 * len(expected) and {s.status for s in stored} == {"done"}
    for s in stored:  # K2.5's default settings: the restarted server's counts are never kept
        _, image = expected[s.item_key]
        assert s.image_token_counts == image_counts([image]), s.item_key

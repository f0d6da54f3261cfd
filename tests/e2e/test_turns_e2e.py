"""`tokenmill enqueue --turns all` for real: Postgres, Redis, `celery -A app worker` and the
emulator; the worker is killed (-9) mid-conversation and another takes over; every turn is
done exactly once from the regenerated history, and the whole-conversation export passes
SpecForge's row checks."""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.ledger import reads, run_queries
from app.outputs.export import assistant_turn
from app.prompts.conversation import check_specforge_row
from app.prompts.tokenization import load_tokenizer
from emulator.config import EmulatorConfig
from emulator.model import generate_output
from ops.emulator_proc import EmulatorProcess, start_emulator
from tests.support.procs import service_env, start_worker, stop, tokenmill

pytestmark = pytest.mark.e2e

FLAGS = ["--max-running", "8", "--step-ms", "15", "--median-tokens", "30", "--sigma", "0.3"]
CONFIG = EmulatorConfig(max_running=8, step_ms=15, median_tokens=30, sigma=0.3)
# the Kimi-shaped template, changed to keep every turn's reasoning in history, so that a whole
# conversation has a loss mask (Kimi's own drops it: see --per-turn)
KEEP_REASONING = (
    "loop.index0 > state.last_user and message['reasoning_content']",
    "message['reasoning_content']",
)


def conversation(i: int, turns: int) -> dict[str, object]:
    messages: list[dict[str, str]] = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} of conversation {i}"})
        messages.append({"role": "assistant", "content": f"original answer {t}"})
    return {"id": f"conv{i}", "messages": messages}


LINES = [conversation(i, 2 + i % 2) for i in range(6)]
SAMPLES = 2
EXPECTED = SAMPLES * sum(len(line["messages"]) // 2 for line in LINES)  # type: ignore[arg-type]


@pytest.fixture
def emulator() -> Iterator[EmulatorProcess]:
    proc = start_emulator(FLAGS)
    yield proc
    proc.stop()


def counts_of(db: Engine) -> reads.RunCounts:
    with db.connect() as conn:
        return reads.run_counts(conn, run_queries.get_run(conn, "mt"))


def test_turns_all_survive_a_killed_worker(
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    emulator: EmulatorProcess,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    tok_dir = Path(shutil.copytree(kimi_tokenizer_dir, tmp_path / "tok"))
    config = tok_dir / "tokenizer_config.json"
    assert KEEP_REASONING[0] in config.read_text()
    config.write_text(config.read_text().replace(*KEEP_REASONING))
    prompts = tmp_path / "conversations.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    # the killed worker's leases expire after 5 s, and the ids in messages it held unacked
    # (received, not yet claimed) are republished by reconcile after 3 s instead of 120
    env = service_env(
        pg_url, redis_url, tmp_path, TOKENMILL_LEASE_S="5", TOKENMILL_RECONCILE_GRACE_S="3"
    )
    enqueue = tokenmill(
        [
            "enqueue",
            str(prompts),
            "--run",
            "mt",
            "--tokenizer",
            str(tok_dir),
            "--turns",
            "all",
            "--samples-per-prompt",
            str(SAMPLES),
            "--max-new-tokens",
            "400",
            "--seed",
            "3",
        ],
        env,
    )
    assert enqueue.returncode == 0, enqueue.stderr
    assert counts_of(pg_engine).waiting == EXPECTED - SAMPLES * len(LINES)

    worker_env = env | {"TOKENMILL_SGLANG_URL": emulator.url, "TOKENMILL_SERVER_NAME": "gpu"}
    first = start_worker(worker_env, "w0", tmp_path / "w0.log")
    second = None
    try:
        deadline = time.monotonic() + 120
        while True:  # kill -9 once some later turns are done and others still wait
            c = counts_of(pg_engine)
            if c.done > SAMPLES * len(LINES) and c.waiting:
                break
            assert time.monotonic() < deadline, f"no progress before the kill: {c}"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = start_worker(worker_env, "w1", tmp_path / "w1.log")
        deadline = time.monotonic() + 240
        while True:
            c = counts_of(pg_engine)
            if c.finished:
                break
            assert time.monotonic() < deadline, f"run did not finish: {c}"
            # the catch-up an operator (or beat) runs: expired leases, turns the dead worker
            # finished without starting their successors
            assert tokenmill(["reconcile", "mt"], env).returncode == 0
            time.sleep(1)
    finally:
        stop([p for p in (first, second) if p is not None])
    assert (c.done, c.failed, c.total) == (EXPECTED, 0, EXPECTED)

    tokenizer = load_tokenizer(tok_dir)
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "mt")
        stored = list(reads.iter_items(conn, run.id))
    by_turn = {(s.item_key, s.sample_index, s.turn_index): s for s in stored}
    assert len(by_turn) == EXPECTED  # each turn of each chain exactly once
    for s in stored:
        assert s.attempts == 1
        assert s.prompt_ids == tokenizer.apply(s.messages or [])
        expected, _ = generate_output(
            s.prompt_ids, run.generation.sampling.for_sample(s.sample_index), CONFIG
        )
        assert s.output_ids == expected
        if s.turn_index:
            prev = by_turn[(s.item_key, s.sample_index, s.turn_index - 1)]
            history = prev.messages or []
            assert s.messages is not None
            assert s.messages[: len(history)] == history
            assert s.messages[len(history)] == assistant_turn(prev, run, tokenizer)
            assert "original answer" not in json.dumps(s.messages)

    out = tmp_path / "whole.jsonl"
    export = tokenmill(
        ["export", "mt", "--format", "specforge", "--whole-conversation", "--out", str(out)], env
    )
    assert export.returncode == 0, export.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == SAMPLES * len(LINES)
    for row in rows:
        check_specforge_row(row)
        last = by_turn[(row["id"], row["sample"], row["turns"] - 1)]
        assert row["input_ids"] == last.prompt_ids + (last.output_ids or [])
        # every earlier regenerated turn is trained on, not only the last output
        assert sum(row["loss_mask"]) > len(last.output_ids or [])

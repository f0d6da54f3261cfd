"""The distributed path for real: `tokenmill enqueue` into Postgres and Redis, two
`celery -A app worker` processes serving two emulators, exact outputs, nothing twice."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.ledger import counters, reads, run_queries
from app.prompts.tokenization import load_tokenizer
from emulator.config import EmulatorConfig
from emulator.model import generate_output
from ops.emulator_proc import EmulatorProcess, start_emulator
from tests.support.procs import ROOT, service_env, start_server_workers, stop, tokenmill

pytestmark = pytest.mark.e2e

PROMPTS = ROOT / "emulator" / "data" / "demo_prompts.jsonl"
EMULATOR_FLAGS = [
    "--max-running",
    "16",
    "--step-ms",
    "2",
    "--median-tokens",
    "40",
    "--sigma",
    "1.0",
]
EMULATOR_CONFIG = EmulatorConfig(max_running=16, step_ms=2, median_tokens=40, sigma=1.0)
SAMPLES = 3
ENQUEUE = [
    "enqueue",
    str(PROMPTS),
    "--run",
    "e2e",
    "--max-new-tokens",
    "120",
    "--seed",
    "5",
    "--samples-per-prompt",
    str(SAMPLES),
    "--temperature",
    "0.8",
]
EXPECTED = SAMPLES * sum(1 for line in PROMPTS.read_text().splitlines() if line.strip())


@pytest.fixture
def emulators() -> Iterator[list[EmulatorProcess]]:
    procs = [start_emulator(EMULATOR_FLAGS) for _ in range(2)]
    yield procs
    for p in procs:
        p.stop()


def wait_finished(db: Engine, run_name: str, timeout_s: float) -> reads.RunCounts:
    deadline = time.monotonic() + timeout_s
    while True:
        with db.connect() as conn:
            counts = reads.run_counts(conn, run_queries.get_run(conn, run_name))
        if counts.total and counts.finished:
            return counts
        assert time.monotonic() < deadline, f"run did not finish: {counts}"
        time.sleep(0.5)


def test_two_workers_two_servers_exact_and_exactly_once(
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    emulators: list[EmulatorProcess],
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    base = service_env(pg_url, redis_url, tmp_path)
    enqueue = tokenmill([*ENQUEUE, "--tokenizer", str(kimi_tokenizer_dir)], base)
    assert enqueue.returncode == 0, enqueue.stderr
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "e2e")
        assert reads.run_counts(conn, run).queued == EXPECTED

    workers = start_server_workers(base, [emu.url for emu in emulators], tmp_path)
    try:
        counts = wait_finished(pg_engine, "e2e", 180)
        # a second enqueue adds nothing and publishes nothing
        again = tokenmill([*ENQUEUE, "--tokenizer", str(kimi_tokenizer_dir), "--json"], base)
        assert again.returncode == 0, again.stderr
        assert '"inserted": 0' in again.stdout and '"published": 0' in again.stdout
        # a message delivered again for finished items claims nothing
        redeliver = subprocess.run(
            [
                sys.executable,
                "-c",
                "from workers.intake.publish import publish_items; "
                "publish_items([1, 2, 3], batch_size=3)",
            ],
            env=base,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert redeliver.returncode == 0, redeliver.stderr
        time.sleep(2)
    finally:
        stop(workers)
    assert counts.done == EXPECTED and counts.failed == 0
    with pg_engine.connect() as conn:  # what status read: the counters equal a full count
        assert counters.find_drift(conn) == []

    tokenizer = load_tokenizer(kimi_tokenizer_dir)
    with pg_engine.connect() as conn:
        stored = list(reads.iter_items(conn, run.id))
    assert len(stored) == EXPECTED
    assert len({(s.item_key, s.sample_index) for s in stored}) == EXPECTED
    servers = {s.server for s in stored}
    assert servers == {"gpu-0", "gpu-1"}, "both servers took work from the shared queue"
    for s in stored:
        assert s.attempts == 1
        if s.messages:
            assert s.prompt_ids == tokenizer.apply(s.messages)
        expected, finish = generate_output(
            s.prompt_ids, run.generation.sampling.for_sample(s.sample_index), EMULATOR_CONFIG
        )
        assert s.output_ids == expected
        assert s.finish_reason == finish["type"]
    # samples of one prompt differ (seed + k), and the run pinned the server fingerprint
    by_key: dict[str, set[tuple[int, ...]]] = {}
    for s in stored:
        by_key.setdefault(s.item_key, set()).add(tuple(s.output_ids or []))
    assert all(len(v) == SAMPLES for v in by_key.values())
    with pg_engine.connect() as conn:
        assert run_queries.get_run(conn, "e2e").fingerprint == {
            "model_path": "moonshotai/Kimi-K2.5",
            "weight_version": "default",
            "reasoning_parser": None,
            "version": "0.5.23",
            # the limits that decide SGLang's 400s, as the emulators' /server_info gives them:
            # a context of 16,384, SGLang's input cap (context - 6), 16 slots x 16,384 of KV pool
            "limits": {
                "context_length": 16384,
                "max_req_input_len": 16378,
                "max_total_num_tokens": 262144,
            },
        }

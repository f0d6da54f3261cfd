"""`tokenmill run` through the real CLI against servers that drain, push back, want a key or hold
a smaller context than the tokenizer folder: a SIGTERMed server exits within its drain while
the run goes on and nothing fails; a full queue spends no attempt; a missing key is one line
and nothing is claimed; the server's context length wins and is named."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from app.ledger import common
from ops.emulator_proc import EmulatorProcess, start_emulator
from tests.support.procs import clean_env, run_args, start_tokenmill, tokenmill, wait_for
from tests.support.rows import prompt_rows, write_rows

pytestmark = pytest.mark.e2e

WIDE = {"COLUMNS": "200"}


def stats(emulator: EmulatorProcess, key: str | None = None) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.get(f"{emulator.url}/emulator/stats", headers=headers, timeout=5)
    answer.raise_for_status()
    return dict(answer.json())


def ledger_attempts(data_dir: Path) -> tuple[int, int]:
    """(items, the most attempts any item spent) in the embedded ledger."""
    engine = create_engine(f"sqlite:///{data_dir / 'ledger.sqlite3'}")
    try:
        with engine.connect() as conn:
            items = common.items
            return conn.execute(select(func.count(), func.max(items.c.attempts))).one()  # type: ignore[return-value]
    finally:
        engine.dispose()


def status(env: dict[str, str], cwd: Path, run: str) -> dict[str, int]:
    shown = tokenmill(["status", run, "--json"], env, cwd)
    assert shown.returncode == 0, shown.stderr
    return dict(json.loads(shown.stdout))


def test_a_sigtermed_server_exits_within_its_drain_and_nothing_fails(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    data = tmp_path / "data"
    env = clean_env(data, TOKENMILL_INFLIGHT="8", **WIDE)
    flags = ["--step-ms", "40", "--median-tokens", "30"]
    leaving, staying = start_emulator(flags), start_emulator(flags)
    prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(160))
    err = tmp_path / "run.err"
    # registered: `tokenmill servers` and the timeline show what the run's probes saw
    name = leaving.url.removeprefix("http://")
    added = tokenmill(["servers", "add", name, leaving.url], env, tmp_path)
    assert added.returncode == 0, added.stderr
    argv = run_args(prompts, "r1", kimi_tokenizer_dir, [leaving.url, staying.url])
    run = start_tokenmill([*argv, "--json"], env, tmp_path, err, piped=True)
    try:
        wait_for("the first answers", lambda: stats(leaving)["completed"] >= 8, 120)
        leaving.popen.terminate()  # what `systemctl stop` sends
        code = leaving.popen.wait(timeout=60)
        still_running = run.poll() is None
        out, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
        leaving.stop()
        staying.stop()
    text = err.read_text()
    assert code == 0, text
    assert still_running, "the run ended before the drained server exited"
    assert run.returncode == 0, text
    assert f"--server {leaving.url} drains (its /health answers 503)" in text, text
    counts = json.loads(out)
    assert counts["failed"] == 0 and counts["done"] == 160, counts
    # its items given back spent no attempt
    assert ledger_attempts(data) == (160, 1)
    events = json.loads(tokenmill(["events", "--server", name, "--json"], env, tmp_path).stdout)
    moves = [(e["details"]["from"], e["details"]["to"]) for e in events if e["kind"] == "state"]
    assert ("healthy", "draining") in moves and ("draining", "down") in moves, moves
    (shown,) = json.loads(tokenmill(["servers", "--json"], env, tmp_path).stdout)
    assert shown["state"] == "down" and shown["last_probe_at"] is not None, shown
    assert shown["last_probe_ok"] is False


def test_a_full_queue_is_back_pressure_and_spends_no_attempt(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    data = tmp_path / "data"
    env = clean_env(data, TOKENMILL_INFLIGHT="64", TOKENMILL_RETRY_BACKOFF_S="0.05", **WIDE)
    small = start_emulator(
        ["--step-ms", "5", "--median-tokens", "20", "--max-running", "4", "--max-queued", "2"]
    )
    prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(100))
    try:
        run = tokenmill(
            [*run_args(prompts, "r1", kimi_tokenizer_dir, [small.url]), "--json"], env, tmp_path
        )
        pushed_back = stats(small)["rejected_queue_full"]
    finally:
        small.stop()
    assert run.returncode == 0, run.stderr
    counts = json.loads(run.stdout)
    assert counts["failed"] == 0 and counts["done"] == 100, counts
    assert pushed_back > 0  # the server did push back: 64 in flight against 4 + 2
    assert ledger_attempts(data) == (100, 1)


def test_a_server_that_wants_a_key_is_one_line_and_nothing_is_claimed(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    data = tmp_path / "data"
    env = clean_env(data, **WIDE)
    locked = start_emulator(["--step-ms", "5", "--api-key", "sekrit"])
    prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(20))
    err = tmp_path / "run.err"
    name = locked.url.removeprefix("http://")
    line = f"error: server {name} requires an API key: set TOKENMILL_SGLANG_API_KEY"
    run = start_tokenmill(
        run_args(prompts, "r1", kimi_tokenizer_dir, [locked.url]), env, tmp_path, err
    )
    try:
        wait_for(line, lambda: line in err.read_text(), 120, err.read_text)
        before, started = stats(locked, "sekrit"), time.monotonic()
        time.sleep(5)
        after, elapsed = stats(locked, "sekrit"), time.monotonic() - started
        run.terminate()
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
        locked.stop()
    text = err.read_text()
    assert text.count(line) == 1, text
    probes = (after["unauthorized"] - before["unauthorized"]) + (
        after["health_checks"] - before["health_checks"]
    )
    assert probes <= elapsed + 1, (probes, elapsed)  # the normal rate: at most one a second
    assert after["requests"] == 0  # no /generate was sent
    env_status = status(env, tmp_path, "r1")
    assert env_status["leased"] == 0 and env_status["done"] == 0, env_status


def test_the_servers_smaller_context_length_wins_and_is_named(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    env = clean_env(tmp_path / "data", **WIDE)
    short = start_emulator(["--step-ms", "2", "--median-tokens", "8", "--context-length", "96"])
    rows = prompt_rows(10)
    rows.append({"id": "long", "prompt": "word " * 400})
    prompts = write_rows(tmp_path / "p.jsonl", rows)
    try:
        run = tokenmill(
            [*run_args(prompts, "r1", kimi_tokenizer_dir, [short.url]), "--json"], env, tmp_path
        )
    finally:
        short.stop()
    assert run.returncode == 0, run.stderr
    name = short.url.removeprefix("http://")
    assert f"the servers' context length ({name} 96; their --context-length)" in run.stderr
    assert "prompts are held to 96, the server's" in run.stderr
    # the long prompt is refused at enqueue with the server's limit, naming its line
    assert "line 11" in run.stderr and "96" in run.stderr, run.stderr
    counts = json.loads(run.stdout)
    assert counts["total"] == 10 and counts["failed"] == 0, counts

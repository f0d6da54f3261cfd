"""The operator's second day for real (Postgres, a Redis broker, `celery -A app worker`, the
emulator, the CLI): 24 items fail on a server whose context length was too small; once it is
fixed, `tokenmill retry --reason` brings them to done through the broker, and not one done item
is generated again. `servers remove` refuses the busy server and drops a stray, and a worker
pointed at a wrong port warns and leaves no registration behind."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.ledger import reads, run_queries
from ops.emulator_proc import start_emulator
from tests.chaos.conftest import (
    BASE_FLAGS,
    FAST_SETTINGS,
    MAX_NEW_TOKENS,
    RUN,
    Deployment,
    RedisServer,
    emulator_config,
    free_port,
    prompt_lines,
)
from tests.support.procs import clean_env, service_env, tokenmill, wait_for

pytestmark = pytest.mark.e2e

ITEMS = 72
LONG_EVERY = 3  # items 0, 3, 6, ...: 24 of 72 are long ...
CONTEXT = 200  # ... and do not fit with their max_new_tokens here
SHORT_CONTEXT = {"--context-length": str(CONTEXT)}
FIXED_CONTEXT = {"--context-length": "4096"}


@pytest.fixture
def dep(pg_url: str, pg_engine: Engine, tmp_path: Path) -> Iterator[Deployment]:
    broker = RedisServer(tmp_path)
    broker.start()
    env = service_env(pg_url, broker.url, tmp_path, **FAST_SETTINGS)
    deployment = Deployment(db=pg_engine, env=env, tmp=tmp_path)
    try:
        yield deployment
    finally:
        deployment.stop_all()
        broker.kill()


def generated(log: Path) -> list[int]:
    """The item ids of the /generate requests an emulator finished (its --request-log)."""
    if not log.exists():
        return []
    return [int(json.loads(ln)["rid"].split("-")[1]) for ln in log.read_text().splitlines()]


def outputs(db: Engine) -> dict[int, tuple[str, list[int] | None]]:
    with db.connect() as conn:
        run = run_queries.get_run(conn, RUN)
        items = reads.iter_items(conn, run.id, statuses=("done", "failed"))
        return {s.id: (s.status, s.output_ids) for s in items}


def test_failed_items_are_retried_by_reason_and_no_done_item_is_generated_again(
    dep: Deployment, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    # 24 of 72 prompts carry 40 extra words: over a 200-token context with their new tokens
    dep.enqueue(kimi_tokenizer_dir, ITEMS, long_every=LONG_EVERY, long_words=40)
    port = free_port()
    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    emu = dep.emulator(SHORT_CONTEXT | {"--request-log": str(first_log)}, port=port)
    worker = dep.worker("wa", "gpu-a", emu.url)
    dep.wait_finished(120)
    c = dep.counts()
    assert (c.done, c.failed) == (48, 24), dep.describe()
    before = outputs(dep.db)
    done_before = {i for i, (status, _) in before.items() if status == "done"}
    assert sorted(generated(first_log)) == sorted(done_before)

    status = tokenmill(["status", RUN], dep.env)
    assert status.returncode == 0, status.stderr
    assert f"run {RUN}: 24 failed, by reason (`tokenmill retry {RUN}` re-queues them):" in (
        status.stdout
    )
    assert "24  HTTP 400: Requested token count exceeds the model's maximum context length" in (
        status.stdout
    )
    as_json = json.loads(tokenmill(["status", RUN, "--json"], dep.env).stdout)
    assert list(as_json["failed_by_reason"].values()) == [24]

    # the server's context length is fixed: the same port, a new process
    emu.proc.send_signal(signal.SIGKILL)
    emu.proc.wait()
    dep.emulator(FIXED_CONTEXT | {"--request-log": str(second_log)}, port=port)

    dry = tokenmill(["retry", RUN, "--reason", "context length", "--dry-run"], dep.env)
    assert dry.returncode == 0, dry.stderr
    assert f"run {RUN}: would re-queue 24 failed items with fresh attempts" in dry.stdout
    assert dep.counts().failed == 24  # a dry run changes nothing
    none = tokenmill(["retry", RUN, "--reason", "no such reason"], dep.env)
    assert f"run {RUN}: no failed items to retry matching reason=no such reason" in none.stdout

    retried = tokenmill(["retry", RUN, "--reason", "CONTEXT LENGTH"], dep.env)
    assert retried.returncode == 0, retried.stderr
    assert f"run {RUN}: re-queued 24 failed items with fresh attempts" in retried.stdout
    assert "24  HTTP 400: Requested token count exceeds" in retried.stdout
    # no beat, no reconcile: the retry's own messages bring the items to the worker
    dep.wait("the retried items done", lambda: dep.counts().done == ITEMS, 120)

    after = outputs(dep.db)
    assert {i: o for i, o in after.items() if i in done_before} == {
        i: o for i, o in before.items() if i in done_before
    }, "a done item changed"
    assert sorted(generated(second_log)) == sorted(set(before) - done_before)
    # every output is what the emulator generates for its prompt (the context length aside)
    dep.audit({"gpu-a": emulator_config(BASE_FLAGS | FIXED_CONTEXT)})
    # a busy server is refused, naming its worker; a stray is removed
    busy = tokenmill(["servers", "remove", "gpu-a"], dep.env)
    assert busy.returncode == 2, busy.stderr
    assert "server gpu-a is not removed: workers wa@" in busy.stderr
    assert tokenmill(["servers", "add", "gpu-typo", "http://127.0.0.1:1"], dep.env).returncode == 0
    gone = tokenmill(["servers", "remove", "gpu-typo"], dep.env)
    assert gone.returncode == 0, gone.stderr
    assert "server gpu-typo at http://127.0.0.1:1 removed" in gone.stderr

    # the worker's failures: a WARNING and an event for the first, the rest summed (at the
    # latest when the worker stops) over the items still failed: a sum due after the retry
    # put them back says nothing, and every event names the run by name
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=60)
    events = json.loads(tokenmill(["events", "--run", RUN, "--json"], dep.env).stdout)
    kinds = [e["kind"] for e in events]
    retried_at = kinds.index("retried")
    failed_events = [e for e in events if e["kind"] == "item_failed"]
    assert failed_events and all(
        f" of run {RUN} failed on gpu-a" in e["message"] for e in failed_events
    )
    assert [e for e in events[retried_at:] if e["kind"] == "item_failed"] == []
    # the first at once; the 23 others summed in one event if its minute ended before the retry
    assert sum(e["details"]["count"] for e in failed_events) in (1, 24), failed_events
    assert len(failed_events) <= 2, failed_events  # summed per reason, not one per item
    log = dep.log_tail("wa", lines=100000)
    assert "WARNING" in log and "failed on gpu-a: permanent: HTTP 400" in log


def test_a_worker_at_a_wrong_port_warns_and_takes_its_registration_back(
    dep: Deployment,
) -> None:
    wrong = f"http://127.0.0.1:{free_port()}"
    worker = dep.worker("wx", "gpu-x", wrong)
    wait_for("the worker's warning", lambda: "nothing answers" in dep.log_tail("wx"), 60)
    assert "gpu-x" in [
        s["name"] for s in json.loads(tokenmill(["servers", "--json"], dep.env).stdout)
    ]
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=60)
    names = [s["name"] for s in json.loads(tokenmill(["servers", "--json"], dep.env).stdout)]
    assert "gpu-x" not in names, dep.log_tail("wx")


def test_a_tokenmill_run_takes_its_retried_items_when_run_again(
    pg_url: str, pg_engine: Engine, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(prompt_lines(12, long_every=3, long_words=40)))
    env = clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=pg_url)
    logs = [tmp_path / "first.jsonl", tmp_path / "second.jsonl"]
    argv = ["run", str(prompts), "--run", "tr", "--tokenizer", str(kimi_tokenizer_dir)]
    argv += ["--max-new-tokens", str(MAX_NEW_TOKENS), "--seed", "1", "--json"]
    results = []
    for context, log in zip(("200", "4096"), logs, strict=True):
        emulator = start_emulator(
            [*("--context-length", context, "--request-log", str(log), "--step-ms", "1")]
        )
        try:
            results.append(tokenmill([*argv, "--server", emulator.url], env, tmp_path))
        finally:
            emulator.stop()
        if context == "200":
            assert json.loads(results[0].stdout)["failed"] == 4, results[0].stderr
            retried = tokenmill(["retry", "tr"], env, tmp_path)
            assert "run tr: re-queued 4 failed items with fresh attempts" in retried.stdout
    assert results[1].returncode == 0, results[1].stderr
    final = json.loads(results[1].stdout)
    assert (final["done"], final["failed"]) == (12, 0)
    first, second = generated(logs[0]), generated(logs[1])
    assert len(first) == 8 and len(second) == 4 and not set(first) & set(second)

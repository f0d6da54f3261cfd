"""tokenmill against SGLang 0.5.23's own HTTP server (tests/support/sglang_http): the wheel's
FastAPI app, TokenizerManager and DetokenizerManager, only the scheduler replaced by a fake
that speaks SGLang's IPC messages. One server for the session (`sglang_server`), and a
server of its own restarted into a smaller context length."""

from __future__ import annotations

import json
import shlex
import signal
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from app.core.settings import Settings
from app.ledger import event_log, run_queries
from app.sglang.client import client_for
from tests.support.procs import clean_env, tokenmill
from tests.support.run_pins import NoImages
from tests.support.runs import add_item, make_run
from tests.support.sglang_http import harness
from tests.support.sglang_http.harness import SGLangServer
from workers.engine.run_pins import RunPins

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


def test_update_weights_in_place(sglang_server: SGLangServer, tmp_path: Path) -> None:
    """`tokenmill update-weights` on SGLang's server: /update_weights_from_disk reaches the
    scheduler, the server reports the new version, new weights draw other tokens; loading
    the first weights back draws as before."""
    env = clean_env(tmp_path / "data")
    url = sglang_server.base_url
    assert tokenmill(["servers", "add", "gpu-a", url], env, tmp_path).returncode == 0
    body = {"input_ids": [300, 301, 302], "sampling_params": {"max_new_tokens": 16}}
    before = _generate(sglang_server, body).json()["output_ids"]
    first = httpx.get(f"{url}/model_info", timeout=10).json()["model_path"]
    (tmp_path / "ckpt-2").mkdir()
    for path, version in ((str(tmp_path / "ckpt-2"), "v2"), (first, "default")):
        argv = ["update-weights", "gpu-a", "--model-path", path, "--weight-version", version]
        update = tokenmill(argv, env, tmp_path)
        assert update.returncode == 0, update.stderr
        info = httpx.get(f"{url}/model_info", timeout=10).json()
        assert (info["model_path"], info["weight_version"]) == (path, version)
        answer = _generate(sglang_server, body).json()
        assert answer["meta_info"]["weight_version"] == version
        assert (answer["output_ids"] == before) == (version == "default")


def test_update_weights_to_a_missing_path_pauses_nothing(
    sglang_server: SGLangServer, tmp_path: Path
) -> None:
    """A checkpoint path missing on the machine SGLang's server runs on: refused before the
    server is paused or its requests aborted; the server keeps its weights."""
    env = clean_env(tmp_path / "data")
    url = sglang_server.base_url
    assert tokenmill(["servers", "add", "gpu-a", url], env, tmp_path).returncode == 0
    before = httpx.get(f"{url}/model_info", timeout=10).json()
    missing = str(tmp_path / "ckpt-typo")
    argv = ["update-weights", "gpu-a", "--model-path", missing, "--weight-version", "v3"]

    update = tokenmill(argv, env, tmp_path)

    assert update.returncode == 1, update.stderr
    assert f"--model-path {missing} does not exist on gpu-a" in update.stderr
    assert "nothing was paused" in update.stderr
    # the same command would fail the same way: it is not offered to run again
    assert "To update again" not in update.stderr and shlex.join(argv) not in update.stderr
    after = httpx.get(f"{url}/model_info", timeout=10).json()
    assert (after["model_path"], after["weight_version"]) == (
        before["model_path"],
        before["weight_version"],
    )
    listed = json.loads(tokenmill(["servers", "--json"], env, tmp_path).stdout)
    assert [s["paused"] for s in listed] == [False]
    events = json.loads(tokenmill(["events", "--json"], env, tmp_path).stdout)
    assert not [e for e in events if e["kind"] in ("paused", "weights_update")], events


@pytest.fixture(scope="module")
def one_slot_server(
    tmp_path_factory: pytest.TempPathFactory, kimi_tokenizer_dir: Path
) -> Iterator[SGLangServer]:
    """A server that runs 1 request and queues 1, at 100 ms a token."""
    folder = tmp_path_factory.mktemp("sglang-one-slot")
    model = harness.model_folder(kimi_tokenizer_dir, folder / "model")
    flags = ("--max-running-requests", "1", "--max-queued-requests", "1")
    env = harness.server_env(HARNESS_STEP_S="0.1")
    with harness.running_sglang_server(model, folder / "server.log", *flags, env=env) as server:
        yield server


def _loads(server: SGLangServer) -> tuple[int, int]:
    load = httpx.get(f"{server.base_url}/v1/loads", timeout=10).json()["loads"][0]
    return load["num_running_reqs"], load["num_waiting_reqs"]


def _wait_loads(server: SGLangServer, expected: tuple[int, int]) -> None:
    for _ in range(200):
        if _loads(server) == expected:
            return
        time.sleep(0.05)
    raise AssertionError(f"/v1/loads never showed {expected}: {_loads(server)}")


def test_queue_limit_abort_and_loads(one_slot_server: SGLangServer) -> None:
    """--max-queued-requests: the request past the queue is SGLang's 503 "The request queue
    is full."; /v1/loads shows the scheduler's running and waiting requests; /abort_request
    ends the running one, and the queued one then runs to its end."""
    long = {"max_new_tokens": 120, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(
            _generate,
            one_slot_server,
            {"rid": "blocker", "input_ids": [5], "sampling_params": long},
        )
        _wait_loads(one_slot_server, (1, 0))
        queued = pool.submit(
            _generate, one_slot_server, {"input_ids": [6], "sampling_params": {"max_new_tokens": 4}}
        )
        _wait_loads(one_slot_server, (1, 1))
        full = _generate(one_slot_server, {"input_ids": [7], "sampling_params": long})
        assert full.status_code == 503
        assert full.json()["message"] == "The request queue is full."
        abort = httpx.post(
            f"{one_slot_server.base_url}/abort_request", json={"rid": "blocker"}, timeout=10
        )
        assert abort.status_code == 200
        ended = blocker.result(timeout=60).json()["meta_info"]["finish_reason"]
        assert ended["type"] == "abort"
        answer = queued.result(timeout=60)
        assert answer.status_code == 200 and 1 <= len(answer.json()["output_ids"]) <= 4
    flush = httpx.post(f"{one_slot_server.base_url}/flush_cache", timeout=10)
    assert flush.status_code == 200 and flush.text.startswith("Cache flushed.")


def test_sigterm_drains_then_exits(one_slot_server: SGLangServer) -> None:
    """SIGTERM to the server (what `systemctl stop` sends): SGLang answers /health 503 while
    its in-flight request runs to its end, then the scheduler gets ShutdownReq and all exit.
    Last in this module: it ends the module's server."""
    body = {"input_ids": [8], "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_generate, one_slot_server, body)
        _wait_loads(one_slot_server, (1, 0))
        one_slot_server.popen.send_signal(signal.SIGTERM)
        health = _wait_health(one_slot_server, 503)
        assert health == 503
        done = answer.result(timeout=60)
    assert done.status_code == 200 and len(done.json()["output_ids"]) == 60
    assert one_slot_server.popen.wait(timeout=60) == 0


def _wait_health(server: SGLangServer, expected: int) -> int:
    status = 0
    for _ in range(100):
        status = httpx.get(f"{server.base_url}/health", timeout=10).status_code
        if status == expected:
            break
        time.sleep(0.05)
    return status


def test_a_restart_into_a_smaller_context_is_read_and_the_run_left(
    tmp_path: Path, kimi_tokenizer_dir: Path, pg_engine: Engine
) -> None:
    """SGLang's server restarted with `--context-length 1024` (from 8192): a worker reads the
    new limits from its /server_info and no longer serves a run whose largest request (2,000
    prompt tokens + 100) they do not admit, saying why; the limits of 8192 admitted it."""
    model = harness.model_folder(kimi_tokenizer_dir, tmp_path / "model")
    port = harness.free_port()
    url = f"http://127.0.0.1:{port}"
    with pg_engine.begin() as conn:
        run = make_run(conn, "r1", max_new_tokens=100)
        add_item(conn, run.id, "long", status="pending", prompt_tokens=2000)

    def pins() -> RunPins:
        return RunPins(
            pg_engine,
            "gpu-a",
            only_run=None,
            new_client=lambda: client_for(url, Settings()),
            images=NoImages(),  # type: ignore[arg-type]
            on_fingerprint_read=lambda: None,
            on_auth=lambda error: None,
            on_weights_noted=lambda: None,
        )

    for context, served in (("8192", True), ("1024", False)):
        log = tmp_path / f"server-{context}.log"
        with harness.running_sglang_server(model, log, "--context-length", context, port=port):
            worker = pins()
            assert worker.run_matches_server(run.id) is served
            limits = worker.server_fingerprint().limits or {}
        assert limits["context_length"] == int(context), limits
        assert {"max_req_input_len", "max_total_num_tokens"} <= set(limits), limits
    with pg_engine.connect() as conn:
        pinned = run_queries.get_run(conn, "r1").fingerprint or {}
        refused = event_log.runs_refused(conn, [run.id])
    assert pinned["limits"]["context_length"] == 8192  # what the run pinned stays
    said = refused["gpu-a"][run.id]
    assert "its limits do not admit the run's largest request: context_length 1024 < 2100" in said
    assert "context_length: 8192 → 1024" in said

"""The SGLang emulator over HTTP as a client sees it: routes, errors, batching, faults, startup.

Each emulator runs as `python -m emulator --port 0` in a subprocess (tests/support/emulator.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from emulator.config import KIMI_IM_END_ID, EmulatorConfig
from emulator.model import generate_output
from emulator.server import EmulatorServer
from tests.support.emulator import EmulatorProcess, free_port, running_emulator
from tests.support.sglang_contract import validate_request

BASIC = EmulatorConfig(
    port=0, step_ms=2, max_running=8, median_tokens=20, context_length=4096, max_queued=None
)
Json = dict[str, Any]
# one pooled client for the whole module: a new httpx client per call costs ~20 ms of TLS setup
HTTP = httpx.Client(timeout=20.0, limits=httpx.Limits(max_connections=64))


def post(emu: EmulatorProcess, body: Any, timeout_s: float = 20.0) -> httpx.Response:
    """POST /generate; bodies meant to be valid go through SGLang's contract first."""
    return HTTP.post(f"{emu.url}/generate", json=body, timeout=timeout_s)


def generate(emu: EmulatorProcess, body: Json, timeout_s: float = 20.0) -> Any:
    validate_request(body)
    response = post(emu, body, timeout_s)
    assert response.status_code == 200, response.text
    return response.json()


def get(emu: EmulatorProcess, path: str, timeout_s: float = 5.0) -> httpx.Response:
    return HTTP.get(f"{emu.url}{path}", timeout=timeout_s)


def stats(emu: EmulatorProcess) -> Json:
    result: Json = get(emu, "/emulator/stats").json()
    return result


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 10.0, watch: Future[Any] | None = None
) -> None:
    """Poll until true; a watched request that already failed fails the test at once."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if watch is not None and watch.done():
            watch.result()
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


def long_body(rid: str, tokens: int = 3000) -> Json:
    """A request that runs for `tokens` steps unless aborted."""
    return {
        "rid": rid,
        "input_ids": [11, 12, 13],
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
    }


@pytest.fixture(scope="module")
def emu() -> Iterator[EmulatorProcess]:
    with running_emulator(BASIC) as process:
        yield process


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as executor:
        yield executor


# --- /generate ------------------------------------------------------------------------


def test_generate_answers_what_the_model_says(emu: EmulatorProcess) -> None:
    sampling = {"max_new_tokens": 200, "temperature": 0.6, "sampling_seed": 3}
    body = {"rid": "one", "input_ids": [163587, 900, 163601], "sampling_params": sampling}
    answer = generate(emu, body)
    expected_ids, expected_finish = generate_output(body["input_ids"], sampling, BASIC)
    assert answer["output_ids"] == expected_ids
    meta = answer["meta_info"]
    assert meta["id"] == "one"
    assert meta["finish_reason"] == expected_finish
    assert meta["prompt_tokens"] == 3
    assert meta["completion_tokens"] == len(expected_ids)
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0
    assert "prompt_token_ids" not in answer
    assert answer["text"] == " ".join(str(t) for t in expected_ids[:-1] if t != 163607)


def test_the_same_request_twice_gives_the_same_output(emu: EmulatorProcess) -> None:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 64}}
    first, second = generate(emu, body), generate(emu, body)
    assert first["output_ids"] == second["output_ids"]
    assert first["meta_info"]["id"] != second["meta_info"]["id"]  # fresh ids when none is sent


def test_truncated_and_prompt_ids_echoed(emu: EmulatorProcess) -> None:
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
        "return_prompt_token_ids": True,
    }
    answer = generate(emu, body)
    assert answer["prompt_token_ids"] == [1, 2, 3]
    assert len(answer["output_ids"]) == 5
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_a_batch_answers_a_list_in_order_with_expanded_rids(emu: EmulatorProcess) -> None:
    prompts = [[1, 2], [3, 4, 5], [6]]
    samplings = [{"max_new_tokens": n, "temperature": 0} for n in (10, 20, 30)]
    answers = generate(emu, {"rid": "job", "input_ids": prompts, "sampling_params": samplings})
    assert [a["meta_info"]["id"] for a in answers] == ["job_0", "job_1", "job_2"]
    for answer, prompt, sampling in zip(answers, prompts, samplings, strict=True):
        assert answer["output_ids"] == generate_output(prompt, sampling, BASIC)[0]
        assert answer["meta_info"]["prompt_tokens"] == len(prompt)
    listed = generate(emu, {"rid": ["a", "b"], "input_ids": prompts[:2]})
    assert [a["meta_info"]["id"] for a in listed] == ["a", "b"]
    # a batch of one is still a batch
    assert isinstance(generate(emu, {"input_ids": [[9, 9]]}), list)


def test_n_samples_come_back_as_a_list_with_fresh_ids(emu: EmulatorProcess) -> None:
    body = {"rid": "s", "input_ids": [4, 4], "sampling_params": {"n": 3, "max_new_tokens": 40}}
    answers = generate(emu, body)
    assert len(answers) == 3
    assert len({a["meta_info"]["id"] for a in answers}) == 3
    assert len({tuple(a["output_ids"]) for a in answers}) == 3


def test_stream_sends_cumulative_output_ids_then_done(emu: EmulatorProcess) -> None:
    body = {
        "rid": "st",
        "input_ids": [7, 7],
        "stream": True,
        "sampling_params": {"max_new_tokens": 12, "ignore_eos": True},
    }
    validate_request(body)
    with httpx.stream("POST", f"{emu.url}/generate", json=body, timeout=20) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    for earlier, later in itertools.pairwise(events):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert events[-1]["output_ids"] == generate_output([7, 7], body["sampling_params"], BASIC)[0]


def test_a_batch_stream_tags_events_with_their_index(emu: EmulatorProcess) -> None:
    body = {"input_ids": [[1], [2]], "stream": True, "sampling_params": {"max_new_tokens": 4}}
    validate_request(body)
    with httpx.stream("POST", f"{emu.url}/generate", json=body, timeout=20) as response:
        lines = [line for line in response.iter_lines() if line]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    assert set(finals) == {0, 1}
    assert lines[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"input_ids": [1], "sampling_params": {"max_tokens": 5}}, "unknown field `max_tokens`"),
        ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, 'string "hot"'),
        ({"input_ids": [1, "x"]}, "expected i64"),
        ({"input_ids": [1], "stream": "yes"}, "expected a boolean"),
        ([1, 2, 3], "expected struct GenerateRequest"),
    ],
)
def test_schema_violations_are_400_with_a_text_error(
    emu: EmulatorProcess, body: Any, text: str
) -> None:
    response = post(emu, body)
    assert response.status_code == 400
    assert text in response.json()["error"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
        ({"text": "hello"}, "cannot accept text prompts"),
        (
            {"input_ids": list(range(4096))},
            "The input (4096 tokens) is longer than the model's context length (4096 tokens).",
        ),
        (
            {"input_ids": list(range(4000)), "sampling_params": {"max_new_tokens": 100}},
            "Requested token count exceeds the model's maximum context length of 4096 tokens. "
            "You requested a total of 4100 tokens: 4000 tokens from the input messages and 100 "
            "tokens for the completion.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"temperature": -1}},
            "temperature must be a non-negative finite number, got -1.",
        ),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0."),
        (
            {"input_ids": [[1], [2]], "rid": ["only-one"]},
            "The specified rids length mismatch with the batch_size for batch processing.",
        ),
    ],
)
def test_invalid_requests_are_400_with_an_error_message(
    emu: EmulatorProcess, body: Json, message: str
) -> None:
    response = post(emu, body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_a_body_that_is_not_json_is_a_400(emu: EmulatorProcess) -> None:
    response = HTTP.post(f"{emu.url}/generate", content=b"{nope", timeout=5)
    assert response.status_code == 400
    assert response.json()["object"] == "error"


# --- information and health -----------------------------------------------------------


def test_information_routes(emu: EmulatorProcess) -> None:
    for path in ("/model_info", "/get_model_info"):
        info = get(emu, path).json()
        assert info["model_path"] == "moonshotai/Kimi-K2.5"
        assert info["weight_version"] == "default"
        assert info["reasoning_parser"] is None
        assert info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        server = get(emu, path).json()
        assert server["version"] == "0.5.23"
        assert server["context_length"] == 4096
        assert server["max_running_requests"] == 8
        assert server["port"] == emu.port
        assert server["internal_states"][0]["effective_max_running_requests_per_dp"] == 8
    models = get(emu, "/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "moonshotai/Kimi-K2.5"
    assert models["data"][0]["max_model_len"] == 4096


def test_health_routes_are_200_when_serving(emu: EmulatorProcess) -> None:
    for path in ("/health", "/health_generate", "/ready"):
        response = get(emu, path)
        assert response.status_code == 200
        assert response.content == b""


def test_stats_count_requests_and_report_capacity(emu: EmulatorProcess) -> None:
    before = stats(emu)
    generate(emu, {"input_ids": [3, 1, 4], "sampling_params": {"max_new_tokens": 9}})
    after = stats(emu)
    assert after["requests"] == before["requests"] + 1
    assert after["generated_tokens"] >= before["generated_tokens"] + 1
    assert after["busy_steps"] > before["busy_steps"]
    assert after["capacity_tokens_per_s"] == 8 * 1000 / 2
    assert after["uptime_s"] > before["uptime_s"]
    assert after["running"] == after["waiting"] == 0


def test_a_repeated_prompt_reports_cached_tokens(emu: EmulatorProcess) -> None:
    body = {"input_ids": list(range(2000, 2200)), "sampling_params": {"max_new_tokens": 2}}
    assert generate(emu, body)["meta_info"]["cached_tokens"] == 0
    # every prompt token but the last, which SGLang always computes
    assert generate(emu, body)["meta_info"]["cached_tokens"] == 199


# --- abort, flush, pause --------------------------------------------------------------


def test_abort_by_rid_answers_200_with_an_abort_finish(
    emu: EmulatorProcess, pool: ThreadPoolExecutor
) -> None:
    pending = pool.submit(generate, emu, long_body("victim"))
    wait_until(lambda: stats(emu)["running"] == 1, watch=pending)
    assert HTTP.post(f"{emu.url}/abort_request", json={"rid": "victim"}).status_code == 200
    answer = pending.result(timeout=10)
    assert answer["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert 0 < len(answer["output_ids"]) < 3000
    assert answer["meta_info"]["completion_tokens"] == len(answer["output_ids"])


def test_abort_of_a_waiting_request_and_abort_all(
    emu: EmulatorProcess, pool: ThreadPoolExecutor
) -> None:
    batch = {"rid": "w", "input_ids": [[i + 1] for i in range(9)], "sampling_params": {
        "max_new_tokens": 3000, "ignore_eos": True}}  # fmt: skip
    pending = pool.submit(generate, emu, batch)
    wait_until(lambda: stats(emu)["running"] == 8 and stats(emu)["waiting"] == 1, watch=pending)
    HTTP.post(f"{emu.url}/abort_request", json={"rid": "w_8"})
    wait_until(lambda: stats(emu)["waiting"] == 0)
    HTTP.post(f"{emu.url}/abort_request", json={"abort_all": True})
    answers = pending.result(timeout=10)
    assert answers[8]["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Abort in waiting queue",
    }
    assert answers[8]["output_ids"] == []
    assert all(a["meta_info"]["finish_reason"]["message"] == "Aborted" for a in answers[:8])


def test_flush_cache_is_refused_while_requests_run(
    emu: EmulatorProcess, pool: ThreadPoolExecutor
) -> None:
    assert HTTP.post(f"{emu.url}/flush_cache").status_code == 200
    pending = pool.submit(generate, emu, long_body("busy"))
    wait_until(lambda: stats(emu)["running"] == 1, watch=pending)
    refused = HTTP.post(f"{emu.url}/flush_cache")
    assert refused.status_code == 400
    HTTP.post(f"{emu.url}/abort_request", json={"rid": "busy"})
    pending.result(timeout=10)
    assert HTTP.get(f"{emu.url}/flush_cache").status_code == 200


def test_pause_in_place_holds_requests_until_continue(
    emu: EmulatorProcess, pool: ThreadPoolExecutor
) -> None:
    paused = HTTP.post(f"{emu.url}/pause_generation", json={"mode": "in_place"})
    assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    assert get(emu, "/ready").status_code == 503
    pending = pool.submit(
        generate, emu, {"input_ids": [8], "sampling_params": {"max_new_tokens": 3}}
    )
    time.sleep(0.3)
    assert not pending.done()
    resumed = HTTP.post(f"{emu.url}/continue_generation", json={})
    assert resumed.json()["status"] == "ok"
    assert pending.result(timeout=10)["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert get(emu, "/ready").status_code == 200


def test_pause_abort_aborts_what_runs(emu: EmulatorProcess, pool: ThreadPoolExecutor) -> None:
    running = pool.submit(generate, emu, long_body("p1"))
    wait_until(lambda: stats(emu)["running"] == 1, watch=running)
    HTTP.post(f"{emu.url}/pause_generation", json={})
    assert running.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"
    held = pool.submit(generate, emu, {"input_ids": [8], "sampling_params": {"max_new_tokens": 2}})
    time.sleep(0.2)
    assert not held.done()
    HTTP.post(f"{emu.url}/continue_generation")
    assert held.result(timeout=10)["meta_info"]["finish_reason"]["type"] != "abort"


def test_a_client_that_goes_away_frees_its_slot(emu: EmulatorProcess) -> None:
    with pytest.raises(httpx.ReadTimeout):
        post(emu, long_body("gone"), timeout_s=0.3)
    wait_until(lambda: stats(emu)["running"] == 0, timeout_s=5)


# --- batching timing ------------------------------------------------------------------


def test_continuous_batching_shares_steps_up_to_max_running(pool: ThreadPoolExecutor) -> None:
    cfg = EmulatorConfig(port=0, step_ms=10, max_running=4, prefill_ms_per_1k_tokens=0)
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
    with running_emulator(cfg) as process:

        def wave(count: int) -> float:
            started = time.perf_counter()
            futures = [pool.submit(generate, process, body) for _ in range(count)]
            for future in futures:
                future.result(timeout=30)
            return time.perf_counter() - started

        one, four, eight = wave(1), wave(4), wave(8)
        utilization = stats(process)
    # 30 steps of 10 ms; four requests share the steps, eight need two rounds of slots
    assert one >= 0.3 * 0.9
    assert four / one < 1.6
    assert 1.5 < eight / four < 3.0
    assert utilization["generated_tokens"] == 30 * 13
    assert utilization["capacity_tokens_per_s"] == 400


def test_prefill_costs_time_and_the_prefix_cache_saves_it() -> None:
    cfg = EmulatorConfig(port=0, step_ms=2, prefill_ms_per_1k_tokens=50, context_length=8192)
    long_prompt = {"input_ids": list(range(300, 6300)), "sampling_params": {"max_new_tokens": 1}}
    short_prompt = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    with running_emulator(cfg) as process:
        short = generate(process, short_prompt)["meta_info"]["e2e_latency"]
        cold = generate(process, long_prompt)["meta_info"]
        warm = generate(process, long_prompt)["meta_info"]
    # 6000 prompt tokens at 50 ms per 1k: 300 ms of prefill, unless cached
    assert cold["e2e_latency"] > short + 0.2
    assert warm["cached_tokens"] == 5999  # all but the last prompt token
    assert warm["e2e_latency"] < cold["e2e_latency"] - 0.15


# --- faults ---------------------------------------------------------------------------


def test_error_and_drop_faults_hit_their_share_of_requests() -> None:
    cfg = EmulatorConfig(port=0, step_ms=1, error_rate=0.3, drop_rate=0.3, fault_seed=7)
    outcomes = {"ok": 0, "error": 0, "drop": 0}
    with running_emulator(cfg) as process:
        for i in range(60):
            try:
                response = post(
                    process, {"input_ids": [i + 1], "sampling_params": {"max_new_tokens": 2}}
                )
            except httpx.RemoteProtocolError:
                outcomes["drop"] += 1
                continue
            if response.status_code == 500:
                assert response.headers["content-type"].startswith("text/plain")
                assert response.text == "Internal Server Error"
                outcomes["error"] += 1
            else:
                assert response.status_code == 200
                outcomes["ok"] += 1
        counted = stats(process)
        # a bad request is answered 400 whatever the dice say
        assert post(process, {"input_ids": []}).status_code == 400
    assert all(5 <= count <= 35 for count in outcomes.values()), outcomes
    assert counted["injected_errors"] == outcomes["error"]
    assert counted["injected_drops"] == outcomes["drop"]


def test_a_full_waiting_queue_answers_503(pool: ThreadPoolExecutor) -> None:
    cfg = EmulatorConfig(port=0, step_ms=2, max_running=1, max_queued=1)
    with running_emulator(cfg) as process:
        # one at a time: two arrivals within one step would both count as waiting
        first = pool.submit(generate, process, long_body("a"))
        wait_until(lambda: stats(process)["running"] == 1, watch=first)
        second = pool.submit(generate, process, long_body("b"))
        wait_until(lambda: stats(process)["waiting"] == 1, watch=second)
        refused = post(process, {"input_ids": [1]})
        assert refused.status_code == 503
        assert refused.json() == {
            "object": "error",
            "message": "The request queue is full.",
            "type": "503",
            "param": None,
            "code": 503,
        }
        streamed = post(process, {"input_ids": [1], "stream": True})
        assert streamed.status_code == 200
        event = json.loads(streamed.text.split("\n\n")[0].removeprefix("data: "))
        assert event["meta_info"]["finish_reason"]["status_code"] == 503
        HTTP.post(f"{process.url}/abort_request", json={"abort_all": True})
        assert first.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"
        assert second.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"
        assert stats(process)["rejected_queue_full"] == 2


def test_a_hung_scheduler_keeps_health_200_but_fails_health_generate() -> None:
    cfg = EmulatorConfig(port=0, step_ms=2, hang_after_s=0.3, health_timeout_s=0.5)
    with running_emulator(cfg) as process:
        wait_until(lambda: stats(process)["hung"], timeout_s=5)
        assert get(process, "/health").status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            post(process, {"input_ids": [1]}, timeout_s=0.5)
        started = time.perf_counter()
        assert get(process, "/health_generate").status_code == 503
        assert time.perf_counter() - started >= 0.45
        assert get(process, "/ready").status_code == 503
        assert get(process, "/model_info").status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            get(process, "/server_info", timeout_s=0.3)  # it asks the hung scheduler
        # a hung server does not wait for its stuck requests on SIGTERM
        assert process.stop(timeout_s=5) == 0


def test_a_scheduler_hangs_when_its_nth_request_arrives() -> None:
    cfg = EmulatorConfig(port=0, step_ms=1, median_tokens=4, hang_after_requests=3)
    with running_emulator(cfg) as process:
        for _ in range(2):  # served as usual
            generate(process, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}})
        assert not stats(process)["hung"]
        with pytest.raises(httpx.ReadTimeout):
            post(process, {"input_ids": [3]}, timeout_s=0.5)  # the third freezes it
        assert stats(process)["hung"] and stats(process)["requests"] == 3
        assert get(process, "/health").status_code == 200
        assert process.stop(timeout_s=5) == 0


# --- startup and shutdown -------------------------------------------------------------


def test_startup_keeps_the_port_closed_then_answers_503_while_loading() -> None:
    port = free_port()
    cfg = EmulatorConfig(port=port, step_ms=2, startup_delay_s=0.8, loading_s=0.8)
    started = time.monotonic()
    with running_emulator(cfg, wait="none") as process:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
        process.wait_listening()
        assert time.monotonic() - started >= 0.75
        loading = [get(process, p) for p in ("/health", "/health_generate", "/ready")]
        assert [r.status_code for r in loading] == [503, 503, 503]
        refused = post(process, {"input_ids": [1]})
        assert (refused.status_code, refused.content) == (503, b"")
        assert get(process, "/model_info").status_code == 200
        process.wait_for_line("The server is fired up and ready to roll!", stderr=True)
        assert get(process, "/health").status_code == 200
        assert generate(process, {"input_ids": [1]})["output_ids"]


def test_sigterm_while_loading_weights_exits_0_without_binding() -> None:
    port = free_port()
    with running_emulator(EmulatorConfig(port=port, startup_delay_s=60), wait="none") as process:
        process.wait_for_line("port closed", stderr=True)
        assert process.stop(timeout_s=5) == 0
    assert not any(line.startswith("listening on") for line in process.stdout)


def test_the_server_also_runs_in_process() -> None:
    async def scenario() -> tuple[int, Json]:
        cfg = EmulatorConfig(port=0, step_ms=1, median_tokens=10)
        async with EmulatorServer(cfg) as server, httpx.AsyncClient() as client:
            response = await client.post(f"{server.base_url}/generate", json={"input_ids": [3]})
            return response.status_code, response.json()

    status, answer = asyncio.run(scenario())
    assert status == 200
    assert answer["meta_info"]["finish_reason"]["type"] == "stop"


def test_the_request_log_holds_what_each_finished_request_was_sent_and_generated(
    tmp_path: Path,
) -> None:
    """One line per finished request, with its ids in and out (whole answers and step_ms 0's
    at-once answers alike); a request aborted by its client writes none."""
    log = tmp_path / "requests.jsonl"
    batch = {"rid": "b", "input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 8}}

    async def scenario(cfg: EmulatorConfig) -> list[Json]:
        async with EmulatorServer(cfg) as server, httpx.AsyncClient() as client:
            url = f"{server.base_url}/generate"
            if cfg.step_ms:  # at once (step_ms 0) nothing runs long enough to walk away from
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(url, json=long_body("gone"), timeout=0.2)
            answers: list[Json] = (await client.post(url, json=batch)).json()
            return answers

    for cfg in (
        EmulatorConfig(port=0, step_ms=2, median_tokens=5, request_log=str(log)),
        EmulatorConfig(port=0, step_ms=0, median_tokens=5, request_log=str(log)),
    ):
        log.unlink(missing_ok=True)
        before = time.time()
        answers = asyncio.run(scenario(cfg))
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert sorted(r["rid"] for r in lines) == ["b_0", "b_1"]
        by_rid = {r["rid"]: r for r in lines}
        for rid, ids, answer in zip(("b_0", "b_1"), batch["input_ids"], answers, strict=True):
            record = by_rid[rid]
            assert record["input_ids"] == ids
            assert record["output_ids"] == answer["output_ids"]
            assert record["completion_tokens"] == len(answer["output_ids"])
            assert before <= record["received_at"] <= time.time()


def test_sigterm_drains_in_flight_requests_then_exits_0(pool: ThreadPoolExecutor) -> None:
    cfg = EmulatorConfig(port=0, step_ms=5)
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
    with running_emulator(cfg) as process:
        in_flight = pool.submit(generate, process, body)
        wait_until(lambda: stats(process)["running"] == 1, watch=in_flight)
        process.terminate()
        wait_until(lambda: get(process, "/health").status_code == 503, timeout_s=5)
        assert get(process, "/health_generate").status_code == 503
        # as SGLang: /generate still serves while draining, and the drain waits for it too
        late = pool.submit(generate, process, body)
        wait_until(lambda: stats(process)["running"] == 2, watch=late)
        assert process.popen.poll() is None
        assert in_flight.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "length"
        assert late.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "length"
        assert process.popen.wait(timeout=10) == 0
    assert any("Draining" in line for line in process.stderr)


def test_step_ms_zero_answers_at_once_and_flags_come_from_the_environment() -> None:
    env = {
        "TOKENMILL_EMULATOR_STEP_MS": "0",
        "TOKENMILL_EMULATOR_MODEL_PATH": "org/other-model",
        "TOKENMILL_EMULATOR_WEIGHT_VERSION": "v7",
        "TOKENMILL_EMULATOR_REASONING_PARSER": "kimi_k2",
    }
    # the outputs are those of the weights it runs (v7)
    immediate = EmulatorConfig(step_ms=0, weight_version="v7")
    with running_emulator(env=env) as process:
        info = get(process, "/model_info").json()
        assert (info["model_path"], info["weight_version"]) == ("org/other-model", "v7")
        assert info["reasoning_parser"] == "kimi_k2"
        sampling = {"max_new_tokens": 300}
        with httpx.Client(base_url=process.url) as client:
            for i in range(300):
                answer = client.post(
                    "/generate", json={"input_ids": [i + 1], "sampling_params": sampling}
                )
                assert answer.status_code == 200
        assert answer.json()["output_ids"] == generate_output([300], sampling, immediate)[0]
        assert answer.json()["meta_info"]["weight_version"] == "v7"
        streamed = post(process, {"input_ids": [5], "stream": True})
        assert streamed.text.endswith("data: [DONE]\n\n")
        assert get(process, "/health_generate").status_code == 200
        counted = stats(process)
    assert counted["busy_steps"] == 0  # answered at once: the batching scheduler never stepped
    assert counted["requests"] == 301
    assert counted["capacity_tokens_per_s"] is None


def test_a_taken_port_exits_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "emulator", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 1
    assert "cannot listen" in result.stderr


def test_the_click_command_names_every_flag_and_its_env_var() -> None:
    from ops.emulator_cmd import emulator

    assert emulator.name == "emulator"
    result = CliRunner().invoke(emulator, ["--help"], terminal_width=200)
    assert result.exit_code == 0
    flags = ("--port", "--step-ms", "--max-running", "--hang-after-s", "--hang-after-requests")
    for flag in (*flags, "--max-queued"):
        assert flag in result.output
    assert "TOKENMILL_EMULATOR_STEP_MS" in result.output
    refused = CliRunner().invoke(emulator, ["--token-min", "900", "--token-max", "800"])
    assert refused.exit_code == 2
    assert "token_min < token_max" in refused.output


def test_eos_matches_the_kimi_im_end_token(emu: EmulatorProcess) -> None:
    answer = generate(emu, {"input_ids": [42], "sampling_params": {"max_new_tokens": 4000}})
    assert answer["output_ids"][-1] == KIMI_IM_END_ID
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": KIMI_IM_END_ID}

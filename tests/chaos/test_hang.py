"""Chaos: a server whose scheduler freezes mid-run (`--hang-after-s`): /generate stops
answering, plain /health stays 200, /health_generate answers 503 after `--health-timeout-s`.
The watchdog (probing every second, client timeout above the server's) must mark it down and
pause it; its worker gives back the requests stuck on it; a second, healthy server finishes
them. No operator, no failed item, no attempt spent."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.chaos.conftest import Deployment, http_status

pytestmark = pytest.mark.chaos

ITEMS = 250
HANG_AFTER_S = 8.0


def test_hung_server_is_paused_and_its_items_finish_elsewhere(
    deployment: Deployment, kimi_tokenizer_dir: Path
) -> None:
    dep = deployment
    dep.env |= {"TOKENMILL_PROBE_TIMEOUT_S": "5", "TOKENMILL_STALL_S": "4"}
    dep.enqueue(kimi_tokenizer_dir, ITEMS)
    slow = {"--step-ms": "20"}  # the run must outlast the hang
    hung = dep.emulator(slow | {"--hang-after-s": str(HANG_AFTER_S), "--health-timeout-s": "2"})
    hangs_at = time.monotonic() + HANG_AFTER_S
    steady = dep.emulator(slow)
    dep.worker("wa", "gpu-a", hung.url)
    dep.worker("wb", "gpu-b", steady.url)
    dep.beat()

    dep.wait("gpu-a doing work", lambda: dep.counts().done > 10, 30)
    remaining = hangs_at - time.monotonic()
    assert remaining > 0, "the server hung before the run got going; raise HANG_AFTER_S"
    dep.wait("gpu-a paused by the watchdog", lambda: dep.server("gpu-a").paused, 60)
    paused_s = time.monotonic() - hangs_at
    a = dep.server("gpu-a")
    assert a.state == "down" and a.paused_by == "watchdog", a
    # the emulator really is hung the way SGLang hangs: liveness fine, generation not
    assert http_status(hung.url + "/health") == 200
    assert http_status(hung.url + "/health_generate", timeout_s=5) == 503

    try:
        dep.wait_finished(30)
    finally:
        finished_s = time.monotonic() - hangs_at
        dep.summary_now("hang", finished_s)
        print(f"CHAOS hang detail: paused_after_hang_s={paused_s:.1f}")
    stored = dep.audit({"gpu-a": hung.config, "gpu-b": steady.config})
    assert [s for s in stored if s.status != "done"] == [], "a hung server failed items"
    assert {s.attempts for s in stored} == {1}, "a hung server cost attempts"
    servers = {s.server for s in stored}
    assert servers == {"gpu-a", "gpu-b"}, servers
    log = dep.log_tail("wa", lines=100000)
    assert "gave back" in log, "the hung server's in-flight items were not given back"
    dep.summary("hang", stored, recover_s=finished_s)

"""Chaos: a server whose scheduler freezes mid-run (`--hang-after-requests`): /generate stops
answering, plain /health stays 200, /health_generate answers 503 after `--health-timeout-s`.
The watchdog (probing every second, client timeout above the server's) must mark it down and
pause it; its worker gives back the requests stuck on it; a second, healthy server finishes
them. No operator, no failed item, no attempt spent."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from tests.chaos.conftest import Deployment, http_status

pytestmark = pytest.mark.chaos

ITEMS = 250
# the hung server freezes once it has been sent this many requests: placed by the work done,
# not by the clock, so it hangs mid-run however long a loaded machine takes to start workers
HANG_AFTER_REQUESTS = 40


def hung_now(url: str) -> bool:
    """The emulator's scheduler froze (its `--hang-after-requests` arrived)."""
    with urllib.request.urlopen(url + "/emulator/stats", timeout=5) as resp:
        return bool(json.load(resp)["hung"])


def test_hung_server_is_paused_and_its_items_finish_elsewhere(
    deployment: Deployment, kimi_tokenizer_dir: Path
) -> None:
    dep = deployment
    dep.env |= {"TOKENMILL_PROBE_TIMEOUT_S": "5", "TOKENMILL_STALL_S": "4"}
    dep.enqueue(kimi_tokenizer_dir, ITEMS)
    slow = {"--step-ms": "20"}  # the run must outlast the hang
    hung = dep.emulator(
        slow | {"--hang-after-requests": str(HANG_AFTER_REQUESTS), "--health-timeout-s": "2"}
    )
    steady = dep.emulator(slow)
    dep.worker("wa", "gpu-a", hung.url)
    dep.worker("wb", "gpu-b", steady.url)
    dep.beat()

    dep.wait("gpu-a hung", lambda: hung_now(hung.url), 120)
    hangs_at = time.monotonic()
    assert dep.counts().done < ITEMS // 2, "the run was nearly over when gpu-a hung"
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

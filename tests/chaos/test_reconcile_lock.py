"""Chaos: a worker SIGKILLed while it runs the periodic reconcile. Reconcile runs under a
Redis lock (`tokenmill:lock:reconcile`, TTL twice the reconcile interval) so that two rarely
overlap; the dead worker never releases it. Reconcile is what brings a dead worker's expired
leases back, so it must run again within a few intervals, not after ten minutes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis

from app.core.constants import REDIS_PREFIX
from tests.chaos.conftest import Deployment, RedisServer

pytestmark = pytest.mark.chaos

LOCK_KEY = f"{REDIS_PREFIX}lock:reconcile"


def kill_inside_reconcile(dep: Deployment, broker: RedisServer, url: str) -> int:
    """SIGKILL the only worker while it holds the reconcile lock; return the lock's ms left."""
    client = redis.Redis.from_url(broker.url)
    try:
        for _ in range(5):
            worker = dep.worker("wa", "gpu-a", url)
            deadline = time.monotonic() + 30
            while client.get(LOCK_KEY) is None:
                assert time.monotonic() < deadline, "reconcile never ran"
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            left = int(client.pttl(LOCK_KEY))
            if left > 0:
                return left
            # it released the lock just before the kill landed: try again
        raise AssertionError("could not kill a worker inside reconcile in 5 tries")
    finally:
        client.close()


def test_worker_killed_inside_reconcile_does_not_block_reconcile(
    deployment: Deployment, broker: RedisServer, kimi_tokenizer_dir: Path
) -> None:
    dep = deployment
    dep.enqueue(kimi_tokenizer_dir, 60)
    emu = dep.emulator({"--step-ms": "20"})
    dep.beat()
    left_ms = kill_inside_reconcile(dep, broker, emu.url)
    killed_at = time.monotonic()
    worker = dep.worker("wa", "gpu-a", emu.url)

    # reconcile runs every 2 s: within 20 s one must really run again (not be skipped)
    def restarted_log() -> str:
        return dep.log_tail("wa", 100000).split("\n--- ")[-1]

    try:
        dep.wait(
            "a reconcile that is not skipped", lambda: "'broker_checked'" in restarted_log(), 20
        )
    finally:
        log = restarted_log()
        print(
            f"\nCHAOS reconcile_lock detail: lock_left_s={left_ms / 1000:.0f} "
            f"skipped_reconciles={log.count(chr(39) + 'skipped' + chr(39))} "
            f"waited_s={time.monotonic() - killed_at:.1f}"
        )
    assert worker.poll() is None

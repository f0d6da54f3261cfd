"""Chaos: the broker (a private redis-server without persistence) is SIGKILLed mid-run and a
fresh, empty one starts on the same port: every queued and unacknowledged message is gone.
Workers and beat must reconnect (broker_connection_max_retries=None), and the periodic
reconcile must find the items the ledger has as queued that no message carries any more and
queue them again. The run finishes without an operator, nothing lost, nothing twice.

celery.md notes a possible Celery 5.7.0 regression (a worker exiting with
`AttributeError: 'NoneType' object has no attribute 'hostname'` in restore_unacked when Redis
restarts): if a worker process exits, the assertion message carries its log tail."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.chaos.conftest import Deployment, RedisServer

pytestmark = pytest.mark.chaos

ITEMS = 300


def test_broker_lost_and_replaced_empty_run_still_finishes(
    deployment: Deployment, broker: RedisServer, kimi_tokenizer_dir: Path
) -> None:
    dep = deployment
    dep.enqueue(kimi_tokenizer_dir, ITEMS)
    a = dep.emulator({"--step-ms": "15"})
    b = dep.emulator({"--step-ms": "15"})
    wa = dep.worker("wa", "gpu-a", a.url)
    wb = dep.worker("wb", "gpu-b", b.url)
    dep.beat()
    dep.wait("work under way", lambda: dep.counts().done >= 60, 60)

    broker.kill()
    lost_at = time.monotonic()
    time.sleep(2)  # workers notice the broken connection
    broker.start()  # same port, empty
    dep.wait_finished(90)
    recover_s = time.monotonic() - lost_at

    for name, proc in (("wa", wa), ("wb", wb)):
        assert proc.poll() is None, (
            f"worker {name} exited with {proc.returncode} after the Redis restart:\n"
            + dep.log_tail(name)
        )
    stored = dep.audit({"gpu-a": a.config, "gpu-b": b.config})
    assert [s for s in stored if s.status != "done"] == [], "a broker loss failed items"
    assert {s.attempts for s in stored} == {1}, "a broker loss cost attempts"
    reconciled = [
        line
        for line in (dep.log_tail("wa", 100000) + dep.log_tail("wb", 100000)).splitlines()
        if "reconcile re-queued" in line
    ]
    assert reconciled, "nothing was re-queued: the broker loss cost nothing?"
    dep.summary("redis_lost", stored, recover_s=recover_s)
    print(f"CHAOS redis_lost detail: {reconciled[-1].split('] ', 1)[-1]}")

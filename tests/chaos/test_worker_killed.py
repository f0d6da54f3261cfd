"""Chaos: a worker SIGKILLed mid-run, twice, and started again each time, while a second
server's worker keeps going. The dead worker's leases expire (TOKENMILL_LEASE_S=5) and beat's
periodic reconcile (every 2 s) queues those items again. The run must finish without an
operator, every item done once with the emulator's output.

What the ledger guarantees about attempts: an attempt is counted only when an outcome is
written (done, failed, or a retryable error). A request cut off by the SIGKILL wrote nothing,
so its item is sent again without having spent an attempt: with healthy servers every item ends
done with attempts == 1, including those the dead worker held.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.chaos.conftest import Deployment

pytestmark = pytest.mark.chaos

ITEMS = 300
# slower decode steps than the rest of the suite so that the kills land mid-run
SLOW = {"--step-ms": "25"}
# lease 5 s + reconcile every 2 s (+ grace 3 s for broker-lost items): 30 s is ample
RECOVER_WITHIN_S = 25


def test_worker_sigkilled_twice_loses_and_duplicates_nothing(
    deployment: Deployment, kimi_tokenizer_dir: Path
) -> None:
    dep = deployment
    dep.enqueue(kimi_tokenizer_dir, ITEMS)
    a = dep.emulator(SLOW)
    b = dep.emulator(SLOW)
    victim = dep.worker("wa", "gpu-a", a.url)
    dep.worker("wb", "gpu-b", b.url)
    dep.beat()

    recoveries: list[float] = []
    orphans = 0
    kills: list[tuple[float, set[int]]] = []
    for kill_at in (40, 100):
        # each kill lands while the victim holds leases: requests in flight, and items its task
        # threads claimed and hold while they wait for room in its full window (they claim
        # before waiting, so nothing hides in an unacknowledged message)
        def busy(k: int = kill_at, pid: int = victim.pid) -> bool:
            return dep.counts().done >= k and bool(dep.leased_by_pid(pid))

        dep.wait(f"{kill_at} items done, the victim busy", busy, 60)
        held = dep.leased_by_pid(victim.pid)
        victim.kill()
        killed_at = time.monotonic()
        victim.wait()
        orphans += len(held)
        victim = dep.worker("wa", "gpu-a", a.url)  # restarted at once, as systemd would
        kills.append((killed_at, held))
    # the leases the dead workers held expire and come back through reconcile
    for killed_at, held in kills:

        def back(h: set[int] = held) -> bool:
            return dep.finished_ids(h) == h

        dep.wait(f"the {len(held)} items a dead worker held finished", back, RECOVER_WITHIN_S)
        recoveries.append(time.monotonic() - killed_at)

    try:
        dep.wait_finished(RECOVER_WITHIN_S)
    finally:
        dep.summary_now("worker_killed", max(recoveries))
        print(
            f"CHAOS worker_killed detail: kills=2 orphaned_leases={orphans} "
            f"recover_s_each={[round(r, 1) for r in recoveries]}"
        )
    stored = dep.audit({"gpu-a": a.config, "gpu-b": b.config})
    assert [s for s in stored if s.status != "done"] == [], "a worker crash failed an item"
    assert {s.attempts for s in stored} == {1}
    assert victim.poll() is None, "the restarted worker died:\n" + dep.log_tail("wa")

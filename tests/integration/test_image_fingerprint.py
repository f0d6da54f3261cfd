"""Image settings in the fingerprint, through the watchdog on a real ledger: a server that
comes back from a restart with another image setting stays paused by "fingerprint", naming
the setting, and is resumed once it is fixed; a pause for token drift on image items stays
until the operator lifts it, however healthy the server is."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.core.constants import PAUSED_BY_IMAGES
from app.core.contracts import SamplingParams, ServerFingerprint
from app.core.settings import Settings
from app.ledger import queue, registry, run_queries
from workers.control.pausing import pause_server
from workers.control.watchdog import Probe, run_watchdog

SETTINGS = {"mm_process_config": {"image": {"in_patch_limit": 16384}}}
PINNED = ServerFingerprint("moonshotai/Kimi-K2.5", "default", None, "0.5.23", images=SETTINGS)


class ScriptedProber:
    def __init__(self) -> None:
        self.ok = True
        self.fingerprint_now = PINNED

    def probe(self, server: registry.ServerInfo) -> Probe:
        return Probe(self.ok, 0.01, None if self.ok else "connection refused")

    def fingerprint(self, server: registry.ServerInfo) -> ServerFingerprint:
        return self.fingerprint_now


class NoControl:
    def cancel_consumer(self, workers: list[str]) -> None:
        pass

    def add_consumer(self, workers: list[str]) -> None:
        pass


@pytest.fixture
def fleet(db: Engine, tmp_path: Path) -> tuple[Engine, Settings]:
    with db.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://a:30000")
        spec = run_queries.RunSpec(
            "r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2]
        )
        run, _ = run_queries.get_or_create_run(conn, spec)
        run_queries.pin_fingerprint(conn, run.id, PINNED.to_json())
        queue.insert_items(conn, run.id, [queue.NewItem("k", 0, 1, None, [1])])
    return db, Settings(data_dir=tmp_path, stall_s=60)


def paused(db: Engine) -> tuple[bool, str | None, str | None]:
    with db.connect() as conn:
        server = registry.get_server(conn, "gpu-a")
    return server.paused, server.paused_by, server.pause_reason


def test_a_restart_with_another_image_setting_stays_paused_naming_it(
    fleet: tuple[Engine, Settings],
) -> None:
    db, settings = fleet
    prober, control = ScriptedProber(), NoControl()
    prober.ok = False
    for _ in range(3):
        run_watchdog(db, settings, control, prober)
    assert paused(db)[1] == "watchdog"
    prober.ok = True
    prober.fingerprint_now = ServerFingerprint(
        "moonshotai/Kimi-K2.5",
        "default",
        None,
        "0.5.23",
        images={"mm_process_config": {"image": {"in_patch_limit": 4096}}},
    )
    for _ in range(3):
        run_watchdog(db, settings, control, prober)
    is_paused, by, reason = paused(db)
    assert is_paused and by == "fingerprint"
    assert "images.mm_process_config: {'image': {'in_patch_limit': 16384}} → " in (reason or "")
    prober.fingerprint_now = PINNED
    run_watchdog(db, settings, control, prober)
    assert not paused(db)[0]


def test_a_token_drift_pause_is_the_operators_to_lift(fleet: tuple[Engine, Settings]) -> None:
    db, settings = fleet
    control = NoControl()
    pause_server(db, control, "gpu-a", by=PAUSED_BY_IMAGES, reason="token drift: ...")
    prober = ScriptedProber()
    prober.ok = False
    for _ in range(3):  # down and back: a restart does not lift it either
        run_watchdog(db, settings, control, prober)
    prober.ok = True
    for _ in range(3):
        run_watchdog(db, settings, control, prober)
    assert paused(db)[:2] == (True, "images")

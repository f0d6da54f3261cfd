"""A draft change is a fingerprint change: a run pins the speculative settings an emulated
server reports in /server_info, and when that server comes back with another draft the watchdog
keeps it paused and says what changed."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine

from app.core.constants import PAUSED_BY_FINGERPRINT
from app.core.contracts import SamplingParams
from app.core.settings import Settings
from app.ledger import queue, registry, run_queries
from app.sglang.client import client_for
from emulator.config import EmulatorConfig
from tests.support.emulator import free_port, running_emulator
from workers.control.watchdog import HttpProber, run_watchdog


class NoControl:
    def cancel_consumer(self, workers: list[str]) -> None:
        pass

    def add_consumer(self, workers: list[str]) -> None:
        pass


def draft(port: int, path: str) -> EmulatorConfig:
    return EmulatorConfig(
        port=port,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=path,
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    )


def test_another_draft_keeps_the_server_paused(pg_engine: Engine, tmp_path: Path) -> None:
    db = pg_engine
    settings = Settings(data_dir=tmp_path, stall_s=600)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_emulator(draft(port, "/drafts/a")), client_for(url, settings) as client:
        pinned = client.fingerprint().to_json()
    assert pinned["speculative"] == {
        "algorithm": "EAGLE3",
        "draft_model_path": "/drafts/a",
        "num_draft_tokens": 4,
        "num_steps": 3,
        "eagle_topk": 1,
    }
    with db.begin() as conn:
        registry.upsert_server(conn, "gpu-a", url)
        spec = run_queries.RunSpec(
            "r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2]
        )
        run, _ = run_queries.get_or_create_run(conn, spec)
        run_queries.pin_fingerprint(conn, run.id, pinned)
        queue.insert_items(conn, run.id, [queue.NewItem("k", 0, 1, None, [1])])
    with running_emulator(draft(port, "/drafts/b")):
        for _ in range(3):
            run_watchdog(db, settings, NoControl(), HttpProber(settings))
    with db.connect() as conn:
        gpu = registry.get_server(conn, "gpu-a")
    assert gpu.paused and gpu.paused_by == PAUSED_BY_FINGERPRINT
    assert "'draft_model_path': '/drafts/a'" in (gpu.pause_reason or "")
    assert "'draft_model_path': '/drafts/b'" in (gpu.pause_reason or "")

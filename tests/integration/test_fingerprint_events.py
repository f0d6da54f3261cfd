"""The `fingerprint_pinned` event: once per run and server, however many of its worker
threads meet the run at once, however many of its workers serve it, and after a resume."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, select

from app.core.constants import EVENT_FINGERPRINT_PINNED
from app.core.settings import Settings
from app.ledger import common, run_queries
from ops.emulator_proc import EmulatorProcess, start_emulator
from tests.support.done_runs import spec
from workers.engine.runtime import WorkerRuntime


@pytest.fixture
def emulator() -> Iterator[EmulatorProcess]:
    emu = start_emulator(["--step-ms", "1"])
    yield emu
    emu.stop()


def runtime(db: Engine, emulator: EmulatorProcess, name: str) -> WorkerRuntime:
    return WorkerRuntime(
        Settings(inflight=4),
        db=db,
        server_url=emulator.url,
        server_name=name,
        on_released=lambda ids, wait_s: None,
    )


def pinned_events(db: Engine) -> list[tuple[int | None, str | None]]:
    with db.connect() as conn:
        rows = conn.execute(
            select(common.events.c.run_id, common.events.c.server).where(
                common.events.c.kind == EVENT_FINGERPRINT_PINNED
            )
        )
        return [(r.run_id, r.server) for r in rows]


def test_one_event_per_run_and_server(db: Engine, emulator: EmulatorProcess) -> None:
    with db.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec("fp"))
        other, _ = run_queries.get_or_create_run(conn, spec("fp2"))
    first = runtime(db, emulator, "gpu-a")
    answers: list[bool] = []
    threads = [
        threading.Thread(target=lambda: answers.append(first.pins.run_matches_server(run.id)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [True] * 4
    first.pins.forget_run(run.id)  # a resume: checked again
    assert first.pins.run_matches_server(run.id)
    assert runtime(db, emulator, "gpu-a").pins.run_matches_server(run.id)  # its second worker
    assert runtime(db, emulator, "gpu-b").pins.run_matches_server(run.id)  # another server
    assert first.pins.run_matches_server(other.id)
    assert sorted(pinned_events(db)) == sorted(
        [(run.id, "gpu-a"), (run.id, "gpu-b"), (other.id, "gpu-a")]
    )

"""A run pins its storage and its servers, as a worker sees them: image items are read from the
run's storage whatever the worker's own setting; a worker that does not reach it gives them
back (one WARNING, nothing failed); runs bound to other servers or driven by `tokenmill run`
are left unclaimed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sqlalchemy import Engine, update

from app.core.images import ImageRef
from app.core.models import runs
from app.ledger import run_queries
from app.storage import run_store
from app.storage.image_store import put_image
from app.storage.shards import open_location
from tests.integration.test_image_items import (
    PAD,
    FakeServer,
    add,
    image_run,
    png,
    row,
    runtimes,
    start,
)
from workers.engine.generate import handle_message
from workers.engine.runtime import WorkerRuntime

__all__ = ["runtimes"]  # the fixture, used by name

pytestmark = pytest.mark.parametrize("db", ["sqlite", "postgres"], indirect=True)


def pin(db: Engine, run: run_queries.RunInfo, **values: object) -> None:
    with db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run.id).values(**values))


def stored_in(folder: Path) -> tuple[str, ImageRef]:
    url = folder.as_uri()
    return url, put_image(open_location(url, {}), png(40, 30, (9, 9, 200)), "blue.png")


def test_image_items_are_read_from_the_runs_storage_not_the_workers(
    db: Engine, tmp_path: Path, runtimes: list[WorkerRuntime]
) -> None:
    run = image_run(db)
    url, blue = stored_in(tmp_path / "enqueue-folder" / "storage")
    run_store.write_marker(open_location(url, {}), run.id, run.name)
    pin(db, run, storage_url=url)
    item = add(db, run, "p", [1, PAD, 3], [blue])
    # the worker's own TOKENMILL_STORAGE_URL is its folder's, which holds no images
    rt = start(db, (tmp_path / "worker-folder").as_uri(), runtimes, "gpu-a", FakeServer())
    handle_message(rt, [item], requeue=lambda ids, wait_s: None)
    _wait_done(db, item)
    assert row(db, item).image_token_counts == [12]


def test_a_worker_that_does_not_reach_the_runs_storage_gives_image_items_back_once_said(
    db: Engine, tmp_path: Path, runtimes: list[WorkerRuntime], caplog: pytest.LogCaptureFixture
) -> None:
    run = image_run(db)
    # the enqueue's folder on another machine: here, a folder without the run's marker
    url, blue = stored_in(tmp_path / "other-machine" / "storage")
    pin(db, run, storage_url=url)
    first = add(db, run, "a", [1, PAD], [blue])
    second = add(db, run, "b", [2, PAD], [blue])
    text = add(db, run, "t", [5, 6], [])
    server = FakeServer()
    rt = start(db, url, runtimes, "gpu-a", server)
    requeued: list[tuple[list[int], float]] = []
    with caplog.at_level(logging.WARNING):
        handle_message(rt, [first, text], requeue=lambda ids, s: requeued.append((ids, s)))
        handle_message(rt, [second], requeue=lambda ids, s: requeued.append((ids, s)))
    _wait_done(db, text)
    assert [row(db, i).status for i in (first, second)] == ["queued", "queued"]
    assert row(db, first).attempts == 0 and row(db, first).error is None
    assert sorted(i for ids, _ in requeued for i in ids) == [first, second]
    assert all(wait_s > 0 for _, wait_s in requeued)
    said = [r for r in caplog.records if "does not reach" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert run.name in said[0].getMessage() and url in said[0].getMessage()
    assert all(r["image_data"] is None for r in server.requests)


def test_runs_bound_elsewhere_or_driven_by_tokenmill_run_are_left_unclaimed(
    db: Engine, tmp_path: Path, runtimes: list[WorkerRuntime]
) -> None:
    bound = image_run(db, "bound")
    driven = image_run(db, "driven")
    pin(db, bound, servers=["gpu-b"])
    pin(db, driven, driver=run_queries.DRIVER_RUN)
    ids = [add(db, bound, "b", [1, 2], []), add(db, driven, "d", [3, 4], [])]
    rt = start(db, (tmp_path / "s").as_uri(), runtimes, "gpu-a", FakeServer())
    requeued: list[list[int]] = []
    result = handle_message(rt, ids, requeue=lambda i, s: requeued.append(i))
    assert result["claimed"] == 0
    assert requeued == [[ids[0]]]  # the bound run's item back to the queue; the other dropped
    assert [row(db, i).status for i in ids] == ["pending", "pending"]
    with db.connect() as conn:
        info = run_queries.get_run(conn, "bound")
    assert info.binding() == "gpu-b (enqueue --servers)"
    assert info.served_by("gpu-b") and not info.served_by("gpu-a")


def _wait_done(db: Engine, item: int) -> None:
    from tests.support.procs import wait_for

    wait_for(f"item {item} done", lambda: row(db, item).status == "done", 30)

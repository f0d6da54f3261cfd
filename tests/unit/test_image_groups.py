"""Prefix-cache affinity of image items: the boundary samples of a conversation with images go
through the window's conversation grouping as text ones do (one at a time, shortest first,
each with its images), and a capable server claims such a conversation whole, while a server
that reads no images leaves every item of it, and every sample of an image prompt, queued
together for one that does."""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator

import pytest
from sqlalchemy import Engine, update

from app.core.images import ImageRef
from app.ledger import claims, common, queue, reads, run_queries
from workers.engine.fake_client import FakePolicy, FakeServer, LogEntry
from workers.engine.window import InflightWindow, WindowConfig
from workers.engine.window_types import Checked

PAD = 163605
PICTURE = ImageRef("c" * 64, "images/" + "c" * 64 + ".png", 64, 48, "PNG", 100, "cat.png")


def grouped(run_id: int, key: str) -> Hashable | None:
    return (run_id, key) if key.startswith("conv") else None


@pytest.fixture
def windows() -> Iterator[list[InflightWindow]]:
    made: list[InflightWindow] = []
    yield made
    for window in made:
        window.stop(drain_timeout_s=1)


def with_images(engine: Engine, run: run_queries.RunInfo, key: str, turns: list[int]) -> None:
    with engine.begin() as conn:
        conn.execute(
            update(common.items)
            .where(
                common.items.c.run_id == run.id,
                common.items.c.item_key == key,
                common.items.c.turn_index.in_(turns),
            )
            .values(images=[PICTURE.to_json()])
        )


def test_a_conversation_with_images_goes_out_one_at_a_time_with_its_images(
    sqlite_engine: Engine, run: run_queries.RunInfo, windows: list[InflightWindow]
) -> None:
    log: list[LogEntry] = []
    window = InflightWindow(
        WindowConfig("fake", 4, 60, 0.2, 3, 0.01, 0.05, 0.05, backlog=4),
        db=sqlite_engine,
        owner="owner-1",
        policy=FakePolicy(
            FakeServer(lambda ids, call: 0.03, eos=2, log=log),
            conversation_of=grouped,
            images=lambda item: [f"data:image/png;base64,{item.images[0].sha256[:4]}"],
            checks=lambda item, result: Checked(image_token_counts=(24,) if item.images else None),
        ),
    )
    windows.append(window)
    window.start()
    # history grows turn by turn; the image is in the first user turn, so every turn has it
    new = [
        queue.NewItem("conv-a", 0, 1, None, [1000 + turn, PAD] + [7] * (10 * turn), turn)
        for turn in (2, 0, 1)
    ]
    new += [queue.NewItem("single", s, 2, None, [2000 + s, PAD], 0) for s in range(2)]
    with sqlite_engine.begin() as conn:
        queue.insert_items(conn, run.id, new)
    with_images(sqlite_engine, run, "conv-a", [0, 1, 2])
    with_images(sqlite_engine, run, "single", [0])
    with sqlite_engine.begin() as conn:
        ids = queue.pending_ids(conn, run.id)
        claimed = claims.claim_items(conn, ids, owner="owner-1", server="fake", lease_s=60)
    assert all(c.images == (PICTURE,) for c in claimed)
    assert window.units(claimed) == 3  # the conversation is one unit, as a text one is
    window.submit(claimed)
    deadline = time.monotonic() + 30
    while not window.idle():
        assert time.monotonic() < deadline, "window never settled"
        time.sleep(0.01)
    conv = [(what, first - 1000, images) for what, first, images, _ in log if first < 2000]
    assert [turn for what, turn, _ in conv if what == "sent"] == [0, 1, 2]
    assert [what for what, _, _ in conv] == ["sent", "done"] * 3
    assert all(
        images == ["data:image/png;base64,cccc"] for what, _, images, _ in log if what == "sent"
    )
    with sqlite_engine.connect() as conn:
        stored = list(reads.iter_items(conn, run.id))
    assert len(stored) == 5


def test_an_image_conversation_is_claimed_whole_or_not_at_all(
    sqlite_engine: Engine, run: run_queries.RunInfo
) -> None:
    new = [queue.NewItem("conv-a", 0, 1, None, [1, 2] + [3] * turn, turn) for turn in range(3)]
    with sqlite_engine.begin() as conn:
        queue.insert_items(conn, run.id, new)
    with_images(sqlite_engine, run, "conv-a", [2])  # an image in its last user turn only
    with sqlite_engine.begin() as conn:
        nothing = claims.claim_next_groups(
            conn, owner="text", server="t", lease_s=60, limit=4, run_id=run.id, text_only=True
        )
        whole = claims.claim_next_groups(
            conn, owner="mm", server="m", lease_s=60, limit=4, run_id=run.id
        )
    assert nothing == []  # its text turns wait with it: one server caches its history
    assert sorted(c.turn_index for c in whole) == [0, 1, 2]

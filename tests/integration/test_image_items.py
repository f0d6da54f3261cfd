"""Image items through the ledger and a worker, on Postgres and SQLite: claims that carry the
images (a server that reads none claims text items only), the done write of the image token
counts, the run's count per image (first server wins), and a worker runtime against a fake
SGLang that answers as 0.5.23 does (sglang.md, "Images on /generate"): an honest expansion is
written with its counts; a re-tokenized prompt, a wrong prompt_tokens, or an image counted
differently than on another server is token drift (nothing written, no attempt spent, the
server paused by "images"); an image missing from the store fails the item, naming it."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from sqlalchemy import Engine, select, update

from app.core.constants import EVENT_IMAGE_DRIFT, PAUSED_BY_IMAGES
from app.core.contracts import GenerateResult, ServerFingerprint
from app.core.errors import ConfigurationError
from app.core.images import FAMILIES, ImagePins, ImageRef, expand_placeholders
from app.core.models import run_image_tokens
from app.core.settings import Settings
from app.ledger import claims, common, image_tokens, queue, registry, run_queries
from app.ledger import outcomes as ledger_outcomes
from app.storage.image_store import put_image
from app.storage.shards import open_location
from ops.emulator_proc import start_emulator
from tests.conftest import migrated_sqlite
from tests.support.procs import clean_env, tokenmill
from tests.support.runs import make_run
from workers.engine import fake_client
from workers.engine.fake_client import FakeGenerateClient
from workers.engine.generate import handle_message
from workers.engine.image_checks import ImageChecks
from workers.engine.image_data import ImageData
from workers.engine.runner import EmbeddedRunner
from workers.engine.runtime import WorkerRuntime

PAD = 163605  # Kimi-K2.5's <|media_pad|> (config.json media_placeholder_token_id)
PINS = ImagePins("kimi", FAMILIES["kimi"][0], PAD, FAMILIES["kimi"][1])
OWNER = "owner-1"


def png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def store(tmp_path: Path) -> str:
    return (tmp_path / "storage").as_uri()


@pytest.fixture
def pictures(store: str) -> list[ImageRef]:
    loc = open_location(store, {})
    return [
        put_image(loc, png(64, 48, (200, 10, 10)), "red.png"),
        put_image(loc, png(30, 20, (10, 200, 10)), "green.png"),
    ]


def image_run(db: Engine, name: str = "img") -> run_queries.RunInfo:
    with db.begin() as conn:
        run = make_run(conn, name)
        conn.execute(
            update(common.runs).where(common.runs.c.id == run.id).values(images=PINS.to_json())
        )
    return run


def add(
    db: Engine,
    run: run_queries.RunInfo,
    key: str,
    ids: list[int],
    refs: list[ImageRef],
    *,
    sample: int = 0,
) -> int:
    mine = (
        common.items.c.run_id == run.id,
        common.items.c.item_key == key,
        common.items.c.sample_index == sample,
    )
    with db.begin() as conn:
        queue.insert_items(conn, run.id, [queue.NewItem(key, sample, 1, None, ids)])
        if refs:
            conn.execute(
                update(common.items).where(*mine).values(images=[r.to_json() for r in refs])
            )
        item_id = conn.execute(select(common.items.c.id).where(*mine)).scalar_one()
    return int(item_id)


def row(db: Engine, item_id: int) -> Any:
    with db.connect() as conn:
        return conn.execute(select(common.items).where(common.items.c.id == item_id)).one()


# --- the ledger ------------------------------------------------------------------------------


def test_claims_carry_the_images_and_a_text_only_server_passes_image_items_over(
    db: Engine, pictures: list[ImageRef]
) -> None:
    run = image_run(db)
    text = add(db, run, "t", [1, 2, 3], [])
    pictured = add(db, run, "p", [1, PAD, 3, PAD], pictures)
    with db.begin() as conn:
        claimed = claims.claim_items(
            conn, [text, pictured], owner=OWNER, server="s", lease_s=60, text_only=True
        )
        assert [c.id for c in claimed] == [text]
        assert claimed[0].images == ()
        assert claims.claimable_image_items(conn, [text, pictured]) == [pictured]
        both = claims.claim_items(conn, [text, pictured], owner=OWNER, server="s", lease_s=60)
    assert [c.id for c in both] == [pictured]  # the text item is leased already
    assert both[0].images == tuple(pictures)
    with db.connect() as conn:  # nothing left to claim: other servers may hedge, text only
        hedges = claims.hedge_candidates(conn, server="t", limit=10, text_only=True)
        assert hedges == [(text, run.id)]
        assert len(claims.hedge_candidates(conn, server="t", limit=10)) == 2
    assert row(db, pictured).status == "leased"


def test_a_text_only_feed_leaves_image_items_and_image_conversations_queued(
    db: Engine, pictures: list[ImageRef]
) -> None:
    run = image_run(db)
    add(db, run, "text", [1, 2], [])
    add(db, run, "pic", [1, PAD], pictures[:1])
    with db.begin() as conn:
        # a conversation with an image in a later turn waits, whole, for a server that reads
        queue.insert_items(
            conn,
            run.id,
            [
                queue.NewItem("conv", 0, 1, None, [4, 5], 0),
                queue.NewItem("conv", 0, 1, None, [4, 5, PAD], 1),
            ],
        )
        conn.execute(
            update(common.items)
            .where(common.items.c.item_key == "conv", common.items.c.turn_index == 1)
            .values(images=[pictures[0].to_json()])
        )
        groups = claims.claim_next_groups(
            conn, owner=OWNER, server="s", lease_s=60, limit=10, run_id=run.id, text_only=True
        )
        assert sorted(c.item_key for c in groups) == ["text"]
        assert claims.text_items_left(conn, run.id)  # the conversation's first turn
        singles = claims.claim_next(
            conn, owner=OWNER, server="s", lease_s=60, limit=10, run_id=run.id, text_only=True
        )
        assert [c.item_key for c in singles] == ["conv"]  # its text-only first turn
        assert not claims.text_items_left(conn, run.id)
        rest = claims.claim_next(conn, owner=OWNER, server="s", lease_s=60, limit=10, run_id=run.id)
    assert sorted(c.item_key for c in rest) == ["conv", "pic"]


def result(prompt: list[int], served: list[int]) -> GenerateResult:
    return GenerateResult("r", [7, 2], "stop", 2, len(served), 2, 0, 0.1, prompt_token_ids=served)


def test_done_writes_the_image_token_counts_and_leaves_text_items_null(
    db: Engine, pictures: list[ImageRef]
) -> None:
    run = image_run(db)
    ids = [add(db, run, f"p{i}", [1, PAD], pictures[:1]) for i in range(2)]
    text = add(db, run, "t", [1, 2], [])
    for batch in ([ids[0]], [ids[1], text]):  # one row alone, then a batch (one UPDATE on PG)
        with db.begin() as conn:
            claims.claim_items(conn, batch, owner=OWNER, server="s", lease_s=60)
            outcomes = [
                ledger_outcomes.Done(
                    i,
                    result([1, PAD], [1, PAD, PAD]),
                    image_token_counts=(2,) if i != text else None,
                )
                for i in batch
            ]
            ledger_outcomes.record_outcomes(conn, outcomes, owner=OWNER, lease_s=60)
    assert [row(db, i).image_token_counts for i in ids] == [[2], [2]]
    assert row(db, ids[0]).prompt_tokens == 3
    with db.connect() as conn:
        null = conn.execute(
            select(common.items.c.id).where(common.items.c.image_token_counts.is_(None))
        )
        assert list(null.scalars()) == [text]  # SQL NULL, not JSON null


def test_the_first_servers_count_of_an_image_is_the_runs(db: Engine) -> None:
    run = image_run(db)
    with db.begin() as conn:
        first = image_tokens.note_image_tokens(conn, run.id, {"a" * 64: 414, "b" * 64: 88}, "gpu-a")
        again = image_tokens.note_image_tokens(conn, run.id, {"a" * 64: 500}, "gpu-b")
    assert {sha: (c.token_count, c.server) for sha, c in first.items()} == {
        "a" * 64: (414, "gpu-a"),
        "b" * 64: (88, "gpu-a"),
    }
    assert (again["a" * 64].token_count, again["a" * 64].server) == (414, "gpu-a")
    with db.connect() as conn:
        assert conn.execute(select(run_image_tokens)).all().__len__() == 2


def test_image_settings_join_a_fingerprint_pinned_by_a_text_only_server(db: Engine) -> None:
    run = image_run(db)
    with db.begin() as conn:
        run_queries.pin_fingerprint(conn, run.id, {"model_path": "m", "version": "0.5.23"})
        joined = image_tokens.pin_image_settings(conn, run.id, {"mm_process_config": {"x": 1}})
        kept = image_tokens.pin_image_settings(conn, run.id, {"mm_process_config": {"x": 2}})
    assert (
        joined
        == kept
        == {"model_path": "m", "version": "0.5.23", "images": {"mm_process_config": {"x": 1}}}
    )


# --- a worker against a fake SGLang -----------------------------------------------------------


class FakeServer(FakeGenerateClient):
    """SGLang 0.5.23's /generate for image items, as sglang.md states it: each placeholder
    becomes count(image) copies of itself (by the image's pixel size here), every other id
    kept, prompt_tokens their count; `retokenize` changes an id outside the images (the
    decode + re-tokenize fallback), `count_scale` another processor setting. Health, abort
    and close are the shared fake's."""

    def __init__(
        self, *, reads_images: bool = True, retokenize: bool = False, count_scale: int = 1
    ):
        super().__init__(fake_client.FakeServer(eos=2))
        self.reads_images = reads_images
        self.retokenize = retokenize
        self.count_scale = count_scale
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def count(self, uri: str) -> int:
        data = base64.b64decode(uri.split(",", 1)[1])
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
        return (width // 10) * (height // 10) * self.count_scale

    def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, object],
        rid: str,
        *,
        image_data: list[str] | None = None,
    ) -> GenerateResult:
        with self.lock:
            self.requests.append({"input_ids": input_ids, "image_data": image_data})
        if not image_data:
            return GenerateResult(rid, [7, 2], "stop", 2, len(input_ids), 2, 0, 0.01)
        served = expand_placeholders(input_ids, PAD, [self.count(u) for u in image_data])
        if self.retokenize:
            served = [served[0] + 1, *served[1:]]
        return GenerateResult(
            rid, [7, 2], "stop", 2, len(served), 2, 0, 0.01, prompt_token_ids=served
        )

    def fingerprint(self) -> ServerFingerprint:
        images = {"mm_process_config": {"scale": self.count_scale}} if self.reads_images else None
        return ServerFingerprint(model_path="m", version="0.5.23", images=images)


class FakeRuntime(WorkerRuntime):
    server: FakeServer

    def new_client(self) -> Any:
        return self.server


@pytest.fixture
def runtimes() -> Iterator[list[WorkerRuntime]]:
    made: list[WorkerRuntime] = []
    yield made
    for rt in made:
        rt.stop()


def start(
    db: Engine,
    store: str,
    made: list[WorkerRuntime],
    name: str,
    server: FakeServer,
    *,
    register: bool = True,
) -> FakeRuntime:
    FakeRuntime.server = server  # read by new_client from the constructor on
    rt = FakeRuntime(
        # no hedging: another server's copy would finish an item a test expects refused
        Settings(inflight=2, storage_url=store, drain_timeout_s=2, hedge=False),
        db=db,
        server_url=f"http://{name}:30000",
        server_name=name,
        on_released=lambda ids, wait_s: None,
    )
    rt.server = server
    if register:
        rt.register(None)
    made.append(rt)
    rt.start()
    return rt


def send(db: Engine, rt: WorkerRuntime, ids: list[int]) -> None:
    with db.begin() as conn:
        claimed = claims.claim_items(conn, ids, owner=rt.owner, server=rt.server_name, lease_s=60)
    assert all(rt.pins.run_matches_server(c.run_id) for c in claimed)
    rt.window.submit(claimed)
    deadline = time.monotonic() + 30
    while not rt.window.idle():
        assert time.monotonic() < deadline, "the window never settled"
        time.sleep(0.01)


def test_an_honest_server_writes_the_counts_and_each_image_is_read_once(
    db: Engine, store: str, pictures: list[ImageRef], runtimes: list[WorkerRuntime]
) -> None:
    run = image_run(db)
    red, green = pictures
    prompts = [[1, PAD, 3, PAD, 5], [1, PAD, 9]]
    first = add(db, run, "two", prompts[0], [red, green])
    second = add(db, run, "again", prompts[1], [red])
    server = FakeServer()
    rt = start(db, store, runtimes, "gpu-a", server)
    send(db, rt, [first])
    send(db, rt, [second])  # after the first: its image comes from the worker's cache
    done = [row(db, first), row(db, second)]
    assert [r.status for r in done] == ["done", "done"]
    assert done[0].image_token_counts == [24, 6] and done[1].image_token_counts == [24]
    assert done[0].prompt_tokens == len(expand_placeholders(prompts[0], PAD, [24, 6]))
    request = next(r for r in server.requests if r["input_ids"] == prompts[0])
    red_bytes = png(64, 48, (200, 10, 10))
    assert (
        request["image_data"][0] == "data:image/png;base64," + base64.b64encode(red_bytes).decode()
    )
    assert rt.images.data.reads == 2  # red once for both items, green once
    with db.connect() as conn:
        counts = {
            r.sha256: (r.token_count, r.server) for r in conn.execute(select(run_image_tokens))
        }
    assert counts == {red.sha256: (24, "gpu-a"), green.sha256: (6, "gpu-a")}


def test_a_retokenized_prompt_is_drift_nothing_written_and_the_server_paused(
    db: Engine, store: str, pictures: list[ImageRef], runtimes: list[WorkerRuntime]
) -> None:
    run = image_run(db)
    item = add(db, run, "p", [1, PAD, 3], pictures[:1])
    text = add(db, run, "t", [1, 2, 3], [])
    rt = start(db, store, runtimes, "gpu-a", FakeServer(retokenize=True))
    send(db, rt, [item])
    stored = row(db, item)
    assert (stored.status, stored.attempts, stored.output_ids) == ("queued", 0, None)
    with db.connect() as conn:
        server = registry.get_server(conn, "gpu-a")
        events = [e for e in registry.list_events(conn) if e.kind == EVENT_IMAGE_DRIFT]
    assert server.paused and server.paused_by == PAUSED_BY_IMAGES
    assert "request position 0 (id 1)" in (server.pause_reason or "")
    assert len(events) == 1 and f"item {item}" in events[0].message
    assert rt.paused()
    send(db, rt, [text])  # a paused server sends nothing more
    assert row(db, text).status == "queued"


def test_an_image_counted_differently_on_a_second_server_is_drift(
    db: Engine, store: str, pictures: list[ImageRef], runtimes: list[WorkerRuntime]
) -> None:
    run = image_run(db)
    a = add(db, run, "a", [1, PAD], pictures[:1])
    b = add(db, run, "b", [2, PAD], pictures[:1])
    send(db, start(db, store, runtimes, "gpu-a", FakeServer()), [a])
    other = start(db, store, runtimes, "gpu-b", FakeServer(count_scale=2))
    # the run pinned gpu-a's image settings, so gpu-b is refused by its fingerprint at once
    assert not other.pins.run_matches_server(run.id)
    other.pins.forget_run(run.id)
    text_only = ServerFingerprint(model_path="m", version="0.5.23").to_json()
    with db.begin() as conn:  # a run pinned without them (by a text-only server first, say)
        conn.execute(
            update(common.runs).where(common.runs.c.id == run.id).values(fingerprint=text_only)
        )
    with db.begin() as conn:
        claimed = claims.claim_items(conn, [b], owner=other.owner, server="gpu-b", lease_s=60)
    assert other.pins.run_matches_server(run.id)
    other.window.submit(claimed)
    deadline = time.monotonic() + 30
    while not other.window.idle():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert row(db, b).status == "queued"
    with db.connect() as conn:
        reason = registry.get_server(conn, "gpu-b").pause_reason or ""
    assert f"image {pictures[0].sha256[:12]} expands to 48 tokens here, 24 on gpu-a" in reason


def test_a_wrong_prompt_tokens_is_drift_and_an_unregistered_server_stops_itself(
    db: Engine, store: str, pictures: list[ImageRef], runtimes: list[WorkerRuntime]
) -> None:
    class Miscounting(FakeServer):
        def generate(self, *args: Any, **kwargs: Any) -> GenerateResult:
            answer = super().generate(*args, **kwargs)
            return GenerateResult(
                answer.rid, answer.output_ids, "stop", 2, 2, 2, 0, 0.01,
                prompt_token_ids=answer.prompt_token_ids,
            )  # fmt: skip

    run = image_run(db)
    item = add(db, run, "p", [1, PAD], pictures[:1])
    rt = start(db, store, runtimes, "gpu-a", Miscounting(), register=False)
    send(db, rt, [item])
    assert row(db, item).status == "queued"
    assert rt.paused() and "meta_info.prompt_tokens is 2, but 25 prompt ids" in (
        rt.pauses.local or ""
    )


def test_an_image_missing_from_the_store_fails_the_item_naming_it(
    db: Engine, store: str, pictures: list[ImageRef], runtimes: list[WorkerRuntime]
) -> None:
    run = image_run(db)
    gone = ImageRef("0" * 64, "images/" + "0" * 64 + ".png", 10, 10, "PNG", 5, "gone.png")
    item = add(db, run, "p", [1, PAD], [gone])
    server = FakeServer()
    rt = start(db, store, runtimes, "gpu-a", server)
    send(db, rt, [item])
    stored = row(db, item)
    assert stored.status == "failed" and gone.key in stored.error
    assert server.requests == [] and not rt.paused()


def test_a_text_only_server_is_never_sent_an_image_item(
    db: Engine, store: str, pictures: list[ImageRef], runtimes: list[WorkerRuntime]
) -> None:
    run = image_run(db)
    item = add(db, run, "p", [1, PAD], pictures[:1])
    sample = add(db, run, "p", [1, PAD], pictures[:1], sample=1)
    text = add(db, run, "t", [1, 2], [])
    server = FakeServer(reads_images=False)
    rt = start(db, store, runtimes, "gpu-a", server)
    assert not rt.pins.reads_images()
    sent: list[tuple[list[int], float]] = []
    report = handle_message(
        rt, [item, sample, text], requeue=lambda ids, wait_s: sent.append((ids, wait_s))
    )
    assert report["claimed"] == 1 and report["deferred"] == 2
    # the image prompt's samples go back together, in one message for one server that reads
    assert sent == [([item, sample], rt.settings.unavailable_wait_s)]
    deadline = time.monotonic() + 30
    while not rt.window.idle():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [row(db, i).status for i in (item, sample, text)] == ["pending", "pending", "done"]
    assert [r["image_data"] for r in server.requests] == [None]


def test_tokenmill_run_with_only_text_only_servers_says_why_its_image_items_wait(
    sqlite_engine: Engine, store: str, pictures: list[ImageRef], tmp_path: Path
) -> None:
    run = image_run(sqlite_engine)
    add(sqlite_engine, run, "p", [1, PAD], pictures[:1])
    emulator = start_emulator(["--step-ms", "1"])  # text-only: no has_image_understanding
    settings = Settings(data_dir=tmp_path, storage_url=store, parity_sample=0, hedge=False)
    runner = EmbeddedRunner(sqlite_engine, settings, run, [emulator.url], poll_s=0.01)
    try:
        runner.start()
        with pytest.raises(ConfigurationError, match="1 image items of run img wait for a server"):
            runner.wait(tick_s=0.05)
        assert [view.text_only for view in runner.servers()] == [True]
    finally:
        runner.stop()
        emulator.stop()
    assert row(sqlite_engine, ledger_id(sqlite_engine, run)).status in ("pending", "queued")


def ledger_id(db: Engine, run: run_queries.RunInfo) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                select(common.items.c.id).where(common.items.c.run_id == run.id)
            ).scalar_one()
        )


def test_status_says_why_image_items_wait_when_no_registered_server_reads_images(
    tmp_path: Path, pictures: list[ImageRef], sqlite_template: Path
) -> None:
    engine = migrated_sqlite(sqlite_template, tmp_path / "ledger.sqlite3")
    run = image_run(engine, "pics")
    add(engine, run, "p", [1, PAD], pictures[:1])
    text_only = ServerFingerprint(model_path="m", version="0.5.23").to_json()
    with engine.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://gpu-a:30000")
        registry.set_fingerprint(conn, "gpu-a", text_only)
    said = tokenmill(["status"], clean_env(tmp_path))
    assert said.returncode == 0, said.stderr
    assert "run pics: its image items wait: no registered server understands images" in " ".join(
        said.stderr.split()
    )
    with engine.begin() as conn:
        registry.set_fingerprint(conn, "gpu-a", {**text_only, "images": {}})
    assert "image items wait" not in tokenmill(["status"], clean_env(tmp_path)).stderr


def test_a_run_that_pins_its_images_at_a_later_enqueue_is_read_again(
    db: Engine, store: str
) -> None:
    with db.begin() as conn:
        run = make_run(conn, "late")
    checks = ImageChecks(db, "gpu-a", ImageData(lambda: open_location(store, {})))
    assert checks.pins(run.id) is None  # text only so far
    with db.begin() as conn:
        conn.execute(
            update(common.runs).where(common.runs.c.id == run.id).values(images=PINS.to_json())
        )
    assert checks.pins(run.id) == PINS

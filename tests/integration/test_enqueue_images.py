"""Enqueue of image rows into real Postgres and the local image store: each distinct image read
and stored once under its content address, items recording their images in prompt order with
the store keys in their messages, one placeholder per image in the ids, bad images named per
line, LLaVA rows, boundary samples and chains with images in history, the run's pinned
placeholder. Fixture images are made here with Pillow."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select

from app.core.contracts import SamplingParams
from app.core.errors import ConfigurationError, InputError
from app.core.images import ImagePins
from app.core.models import items, runs
from app.core.settings import get_settings
from app.ledger import claims, outcomes, reads, run_queries
from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from workers.intake.producer import EnqueueOptions, enqueue

MEDIA_PAD = 163605
MEDIA_BEGIN = 163602


@pytest.fixture(scope="module")
def tokenizer(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's image store (the process's settings read again with it)."""
    folder = tmp_path / "store"
    monkeypatch.setenv("TOKENMILL_STORAGE_URL", str(folder))
    get_settings.cache_clear()
    yield folder
    get_settings.cache_clear()


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: Any) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts],
    }


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run_enqueue(
    db: Engine, tokenizer: ChatTokenizer, path: Path, run: str, **extra: Any
) -> tuple[Any, list[InputError]]:
    errors: list[InputError] = []
    options = EnqueueOptions(path, run, SamplingParams(max_new_tokens=16), **extra)
    report = enqueue(db, tokenizer, options, publish=None, on_error=errors.append)
    return report, errors


def stored_items(db: Engine, run: str) -> list[Any]:
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, run).id
        query = (
            select(items.c.item_key, items.c.turn_index, items.c.messages, items.c.prompt_ids)
            .add_columns(items.c.images, items.c.status)
            .where(items.c.run_id == run_id)
            .order_by(items.c.id)
        )
        return list(conn.execute(query))


def test_image_rows_are_stored_once_and_recorded_in_prompt_order(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path, store: Path
) -> None:
    red, blue = png(64, 48), png(30, 20, (0, 0, 255))
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "red.png").write_bytes(red)
    (tmp_path / "blue.png").write_bytes(blue)
    (tmp_path / "broken.png").write_bytes(red[:40])
    data_uri = "data:image/png;base64," + base64.b64encode(blue).decode()
    rows = [
        {"id": "one", "messages": [user("What is this?", image_part("cats/red.png"))]},
        # two images, one a data URI of the same bytes as blue.png, one a file:// URL
        {
            "id": "two",
            "messages": [
                user(image_part(data_uri), "and", image_part((tmp_path / "blue.png").as_uri())),
            ],
        },
        {"id": "missing", "messages": [user("x", image_part("cats/missing.png"))]},
        {"id": "broken", "messages": [user(image_part("broken.png"))]},
        {"id": "video", "messages": [user({"type": "video_url", "video_url": {"url": "v.mp4"}})]},
        # the same image again, in a later turn of the history and in a tool result
        {
            "id": "again",
            "messages": [
                user("first", image_part("cats/red.png")),
                {"role": "assistant", "content": "A red square."},
                {"role": "user", "content": [{"type": "image", "image": "blue.png"}]},
            ],
        },
    ]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    report, errors = run_enqueue(pg_engine, tokenizer, path, "img")

    assert report.inserted == 3
    # red.png (used twice), the data URI, blue.png (by file:// and by path: one source): each
    # read and stored once; the missing and the broken one refused, once each
    assert (report.images_read, report.images_refused) == (3, 2)
    assert report.image_bytes_read == len(red) + 2 * len(blue)
    assert sorted(str(e) for e in errors) == [
        "line 3: messages[0].content[1]: image 'cats/missing.png' cannot be read: "
        "No such file or directory",
        "line 4: messages[0].content[0]: image 'broken.png' is not a usable image: the bytes "
        "are not an image (no format Pillow reads)",
        'line 5: messages[0].content[0] is a "video_url" part; tokenmill takes text and '
        "image parts",
    ]
    red_sha, blue_sha = hashlib.sha256(red).hexdigest(), hashlib.sha256(blue).hexdigest()
    assert sorted(p.name for p in (store / "images").iterdir()) == sorted(
        [f"{red_sha}.png", f"{blue_sha}.png"]
    )
    by_key = {row.item_key: row for row in stored_items(pg_engine, "img")}
    one = by_key["one"]
    assert one.images == [
        {
            "sha256": red_sha,
            "key": f"images/{red_sha}.png",
            "width": 64,
            "height": 48,
            "format": "PNG",
            "bytes": len(red),
            "source": "cats/red.png",
        }
    ]
    assert one.messages[0]["content"][1] == image_part(f"images/{red_sha}.png")
    expected = tokenizer.apply(
        [user("What is this?", image_part("x"))]
    )  # the ids do not depend on the reference
    assert one.prompt_ids == expected and expected.count(MEDIA_PAD) == 1
    two = by_key["two"]
    assert [(i["sha256"], i["source"]) for i in two.images] == [
        (blue_sha, "data:"),
        (blue_sha, (tmp_path / "blue.png").as_uri()),
    ]
    assert two.prompt_ids.count(MEDIA_PAD) == 2
    again = by_key["again"]
    assert [i["sha256"] for i in again.images] == [red_sha, blue_sha]
    assert [
        p
        for t in again.messages
        for p in t["content"]
        if isinstance(p, dict) and p["type"] != "text"
    ] == [
        image_part(f"images/{red_sha}.png"),
        image_part(f"images/{blue_sha}.png"),
    ]
    with pg_engine.connect() as conn:
        pinned = conn.execute(select(runs.c.images).where(runs.c.name == "img")).scalar_one()
    assert ImagePins.from_json(pinned) == tokenizer.image_pins
    assert tokenizer.image_pins is not None and tokenizer.image_pins.placeholder_id == MEDIA_PAD


def test_text_rows_keep_null_images_and_no_pin(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path, store: Path
) -> None:
    path = write_rows(tmp_path / "t.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}])
    report, errors = run_enqueue(pg_engine, tokenizer, path, "text")
    assert (report.inserted, errors) == (1, [])
    with pg_engine.connect() as conn:
        assert conn.execute(select(runs.c.images).where(runs.c.name == "text")).scalar_one() is None
        null_images = conn.execute(select(items.c.id).where(items.c.images.is_(None))).all()
    assert len(null_images) == 1
    assert not store.exists()  # a text input never opens the image store


def test_llava_rows_and_image_root(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path, store: Path
) -> None:
    root = tmp_path / "coco"
    root.mkdir()
    (root / "a.jpg").write_bytes(png(40, 40))
    (root / "b.png").write_bytes(png(20, 60, (0, 255, 0)))
    rows = [
        {
            "id": "llava",
            "image": "a.jpg",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat is in the picture?"},
                {"from": "gpt", "value": "A red square."},
            ],
        },
        {
            "id": "sharegpt4v",
            "images": ["a.jpg", "b.png"],
            "conversations": [{"from": "human", "value": "Compare <image> with <image> please"}],
        },
        {
            "id": "bad-count",
            "images": ["a.jpg"],
            "conversations": [{"from": "human", "value": "<image> and <image>"}],
        },
    ]
    path = write_rows(tmp_path / "llava.jsonl", rows)
    report, errors = run_enqueue(pg_engine, tokenizer, path, "llava", image_root=root)
    assert report.inserted == 2
    assert [str(e) for e in errors] == [
        "line 3: 'conversations' has 2 <image> marker(s) but 'images' gives 1 image(s); each "
        "image needs one marker at its place in the text"
    ]
    by_key = {row.item_key: row for row in stored_items(pg_engine, "llava")}
    content = by_key["sharegpt4v"].messages[0]["content"]
    assert [p["type"] for p in content] == ["text", "image_url", "text", "image_url", "text"]
    assert [p.get("text") for p in content] == ["Compare ", None, " with ", None, " please"]
    assert [i["source"] for i in by_key["sharegpt4v"].images] == ["a.jpg", "b.png"]
    assert by_key["llava"].prompt_ids.count(MEDIA_PAD) == 1
    # the JPEG-named file is a PNG: the store keys it by what it is
    assert by_key["llava"].images[0]["key"].endswith(".png")
    assert (store / by_key["llava"].images[0]["key"]).read_bytes() == (root / "a.jpg").read_bytes()


def test_boundary_samples_and_chains_carry_the_images_of_their_history(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path, store: Path
) -> None:
    (tmp_path / "a.png").write_bytes(png(10, 10))
    (tmp_path / "b.png").write_bytes(png(12, 10, (1, 2, 3)))
    conversation = [
        user("Look", image_part("a.png")),
        {"role": "assistant", "content": "Seen."},
        user("And this", image_part("b.png")),
        {"role": "assistant", "content": "Seen too."},
    ]
    path = write_rows(tmp_path / "conv.jsonl", [{"id": "c", "messages": conversation}])

    report, errors = run_enqueue(pg_engine, tokenizer, path, "each", turns="each")
    assert (report.inserted, errors) == (2, [])
    rows = stored_items(pg_engine, "each")
    assert [len(r.images) for r in rows] == [1, 2]
    assert [r.prompt_ids.count(MEDIA_PAD) for r in rows] == [1, 2]

    report, errors = run_enqueue(pg_engine, tokenizer, path, "all", turns="all")
    assert (report.inserted, errors) == (2, [])
    rows = stored_items(pg_engine, "all")
    assert [(r.status, len(r.images)) for r in rows] == [("pending", 1), ("waiting", 2)]
    # the waiting turn holds its own user turn, its image part pointing at the store
    assert rows[1].messages[-1]["content"][1]["image_url"]["url"] == rows[1].images[1]["key"]


def test_a_tokenizer_without_a_placeholder_refuses_image_rows(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path, store: Path
) -> None:
    import shutil

    folder = tmp_path / "textonly"
    shutil.copytree(tokenizer.path, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["media_placeholder_token_id"]
    (folder / "config.json").write_text(json.dumps(config))
    plain = load_tokenizer(folder)
    assert plain.image_pins is None
    (tmp_path / "a.png").write_bytes(png(10, 10))
    rows = [{"messages": [user("Look", image_part("a.png"))]}, {"prompt": "Plain text"}]
    path = write_rows(tmp_path / "r.jsonl", rows)
    report, errors = run_enqueue(pg_engine, plain, path, "plain")
    assert report.inserted == 1
    assert len(errors) == 1 and "names no image placeholder id" in str(errors[0])
    assert str(errors[0]).startswith("line 1: the row has images")
    # a later enqueue into a run pinned to another placeholder is refused
    run_enqueue(pg_engine, tokenizer, path, "pinned")
    other = ImagePins(
        "qwen", "<|image_pad|>", 151655, "<|vision_start|><|image_pad|><|vision_end|>"
    )
    with pg_engine.begin() as conn:
        conn.execute(runs.update().where(runs.c.name == "pinned").values(images=other.to_json()))
    with pytest.raises(ConfigurationError, match="pins the image placeholder"):
        run_enqueue(pg_engine, tokenizer, path, "pinned")


def test_placeholder_written_as_text_is_refused(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path, store: Path
) -> None:
    rows = [{"messages": [{"role": "user", "content": "see <|media_pad|> here"}]}, {"prompt": "ok"}]
    path = write_rows(tmp_path / "p.jsonl", rows)
    report, errors = run_enqueue(pg_engine, tokenizer, path, "literal")
    assert report.inserted == 1
    assert "holds the image placeholder token <|media_pad|> as text" in str(errors[0])
    assert MEDIA_BEGIN not in stored_items(pg_engine, "literal")[0].prompt_ids


def test_a_chain_advances_with_the_images_of_its_history(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path, store: Path
) -> None:
    from app.core.contracts import GenerateResult
    from workers.chains.advance import advance
    from workers.chains.tokenizers import TokenizerCache

    (tmp_path / "a.png").write_bytes(png(10, 10))
    (tmp_path / "b.png").write_bytes(png(12, 10, (1, 2, 3)))
    conversation = [
        user("Look", image_part("a.png")),
        {"role": "assistant", "content": "Seen."},
        user("And this", image_part("b.png")),
        {"role": "assistant", "content": "Seen too."},
    ]
    path = write_rows(tmp_path / "conv.jsonl", [{"id": "c", "messages": conversation}])
    run_enqueue(pg_engine, tokenizer, path, "chain", turns="all")
    with pg_engine.connect() as conn:
        run_id = run_queries.get_run(conn, "chain").id
        first_id, later_id = [
            i.id for i in reads.iter_items(conn, run_id, statuses=("pending", "waiting"))
        ]
    encode = tokenizer.hf_tokenizer.encode
    output = [*encode("hmm", add_special_tokens=False), tokenizer.think_end_id]
    output += [*encode("A dot.", add_special_tokens=False), tokenizer.eos_token_ids[0]]
    result = GenerateResult("r", output, "stop", None, 10, len(output), 0, 0.1)  # type: ignore[arg-type]
    with pg_engine.begin() as conn:
        claims.claim_items(conn, [first_id], owner="w", server="s", lease_s=60)
        outcomes.record_outcomes(conn, [outcomes.Done(first_id, result)], owner="w", lease_s=60)
    report = advance(pg_engine, TokenizerCache(), prev_ids=[first_id])
    assert report.started == [later_id]
    later = stored_items(pg_engine, "chain")[1]
    assert later.status == "pending" and len(later.images) == 2
    assert later.prompt_ids.count(MEDIA_PAD) == 2
    # its history holds both images, its parts pointing at the store in the images' order
    parts = [p for t in later.messages if isinstance(t["content"], list) for p in t["content"]]
    keys = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert keys == [i["key"] for i in later.images]


def test_images_from_s3_into_an_s3_store(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    from tests.support.moto_s3 import moto_s3

    with moto_s3("imgs") as options:
        monkeypatch.setenv("TOKENMILL_STORAGE_URL", "s3://imgs/store")
        monkeypatch.setenv("TOKENMILL_STORAGE_OPTIONS", json.dumps(options))
        get_settings.cache_clear()
        fs = s3fs.S3FileSystem(**options)
        data = png(16, 16)
        with fs.open("imgs/rows/cat.png", "wb") as stream:
            stream.write(data)
        rows = [
            {"id": "s3", "messages": [user("Cat?", image_part("s3://imgs/rows/cat.png"))]},
            {"id": "gone", "messages": [user("Dog?", image_part("s3://imgs/rows/dog.png"))]},
        ]
        path = write_rows(tmp_path / "s3.jsonl", rows)
        report, errors = run_enqueue(pg_engine, tokenizer, path, "s3")
        assert report.inserted == 1
        assert [str(e) for e in errors] == [
            "line 2: messages[0].content[1]: image 's3://imgs/rows/dog.png' cannot be read: "
            "No such file"
        ]
        [row] = stored_items(pg_engine, "s3")
        key = row.images[0]["key"]
        assert row.images[0]["sha256"] == hashlib.sha256(data).hexdigest()
        assert fs.cat(f"imgs/store/{key}") == data
    get_settings.cache_clear()


def test_pre_tokenized_rows_stay_text_only(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path, store: Path
) -> None:
    rows = [
        {"id": "ids", "input_ids": [1, 2, 3], "image": "a.png"},
        {"id": "pad", "input_ids": [1, MEDIA_PAD, 3]},
    ]
    path = write_rows(tmp_path / "ids.jsonl", rows)
    report, errors = run_enqueue(pg_engine, tokenizer, path, "ids")
    assert report.inserted == 1
    assert [str(e) for e in errors] == [
        f"line 2: 'input_ids'[1] is the image placeholder id {MEDIA_PAD}; pre-tokenized rows "
        "are text only (give images as image parts of turns)"
    ]
    [row] = stored_items(pg_engine, "ids")
    assert row.images is None  # the row's "image" is its metadata, no image of the prompt


def test_the_cli_reads_relative_images_from_image_root(
    pg_engine: Engine, redis_url: str, pg_url: str, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    from tests.support.procs import service_env, tokenmill

    root = tmp_path / "pictures"
    root.mkdir()
    data = png(24, 24)
    (root / "cat.png").write_bytes(data)
    rows = [{"id": "cli", "messages": [user("Cat?", image_part("cat.png"))]}]
    path = write_rows(tmp_path / "cli.jsonl", rows)
    env = service_env(pg_url, redis_url, tmp_path / "data")
    args = ["enqueue", str(path), "--run", "cli", "--tokenizer", str(kimi_tokenizer_dir)]
    proc = tokenmill([*args, "--image-root", str(root), "--json"], env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["inserted"], report["images_read"], report["errors"]) == (1, 1, [])
    assert "1 distinct image sources read, each once" in proc.stderr
    sha = hashlib.sha256(data).hexdigest()
    assert (tmp_path / "data" / "storage" / "images" / f"{sha}.png").read_bytes() == data


def test_a_repeat_enqueue_counts_no_unreadable_image_as_stored(
    pg_engine: Engine, redis_url: str, pg_url: str, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    from tests.support.procs import service_env, tokenmill

    (tmp_path / "cat.png").write_bytes(png(24, 24))
    rows = [
        {"id": "good", "messages": [user("Cat?", image_part("cat.png"))]},
        {"id": "gone", "messages": [user("Dog?", image_part("dog.png"))]},
        {"id": "text", "messages": [user("Bird?", image_part("bird.txt"))]},
    ]
    (tmp_path / "bird.txt").write_text("not an image")
    path = write_rows(tmp_path / "mixed.jsonl", rows)
    env = service_env(pg_url, redis_url, tmp_path / "data")
    args = ["enqueue", str(path), "--run", "mixed", "--tokenizer", str(kimi_tokenizer_dir)]
    args += ["--image-root", str(tmp_path), "--json"]

    first, again = tokenmill(args, env), tokenmill(args, env)

    for proc in (first, again):
        assert proc.returncode == 0, proc.stderr
        assert "2 image sources could not be used, nothing stored for them" in proc.stderr
    before, after = json.loads(first.stdout), json.loads(again.stdout)
    assert (before["inserted"], before["images_read"], before["images_refused"]) == (1, 1, 2)
    assert "1 distinct image sources read, each once" in first.stderr
    # the good row is present, the two others are read again and refused again: none stored
    assert (after["inserted"], after["images_read"], after["images_refused"]) == (0, 0, 2)
    assert "distinct image sources read" not in again.stderr, again.stderr

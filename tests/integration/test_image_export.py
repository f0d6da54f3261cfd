"""Exports of image items (real Postgres, and SQLite for the JSONL paths): the served prompt ids
with their loss mask, the image fields, Parquet columns read back with pyarrow, --with-images
copies and their manifest, and compacted runs exporting the same."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine

from app.core.settings import Settings
from app.outputs import image_rows
from app.outputs.export import export_run
from app.outputs.image_rows import ImageExportError
from app.outputs.parquet_export import check_export, export_parquet
from app.outputs.verify import CHECK_PROMPT, verify_run
from app.prompts.tokenization import ChatTokenizer
from app.storage.image_store import image_uri
from tests.support.image_exports import run_readme_snippet
from tests.support.image_runs import PAD, count_image_reads, make_image_run, served
from tests.support.procs import ROOT
from workers.control.compaction import compact_run


@pytest.fixture(scope="module")
def tokenizer(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


def read_jsonl(path: Path) -> dict[str, dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return {row["id"]: row for row in rows}


def test_specforge_rows_hold_the_served_prompt_and_the_images(db: Engine, tmp_path: Path) -> None:
    built = make_image_run(db, tmp_path, "img-sf")
    out = tmp_path / "sf.jsonl"
    report = export_run(db, built.run, "specforge", out, image_store=built.store)
    rows = read_jsonl(out)
    assert set(rows) == {"one", "two", "tool", "text"}
    for key, (prompt, refs, counts, output) in built.items.items():
        row = rows[key]
        expanded = served(prompt, counts)
        assert row["input_ids"] == expanded + output
        assert row["loss_mask"] == [0] * len(expanded) + [1] * len(output)
        if not refs:
            assert "images" not in row and "image_token_counts" not in row
            continue
        assert row["image_token_counts"] == counts
        assert row["images"] == [
            {
                "sha256": r.sha256,
                "uri": image_uri(built.store, r),
                "width": r.width,
                "height": r.height,
            }
            for r in refs
        ]
    # 414 image tokens where "one" sent one placeholder
    assert rows["one"]["input_ids"].count(PAD) == 414
    assert len(rows["two"]["input_ids"]) == len(built.items["two"][0]) + 414 + 88 - 2 + 3
    assert report.tokens == sum(len(r["input_ids"]) for r in rows.values())
    assert not (tmp_path / "images").exists()  # no copies without --with-images


def test_conversations_point_image_parts_at_the_store(
    db: Engine, tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    built = make_image_run(db, tmp_path, "img-conv")
    out = tmp_path / "conv.jsonl"
    export_run(db, built.run, "conversations", out, tokenizer=tokenizer, image_store=built.store)
    rows = read_jsonl(out)
    a, b, c = built.refs
    two = rows["two"]
    parts = two["conversations"][0]["content"]
    assert parts[0] == {
        "type": "image_url",
        "image_url": {"url": image_uri(built.store, a)},
        "sha256": a.sha256,
    }
    assert parts[1] == {"type": "text", "text": "and"}
    assert parts[2]["image_url"]["url"] == image_uri(built.store, b)
    assert two["images"] == [image_uri(built.store, a), image_uri(built.store, b)]
    assert two["image_token_counts"] == [414, 88]
    assert two["conversations"][-1]["role"] == "assistant"
    tool_turn = rows["tool"]["conversations"][1]
    assert tool_turn["role"] == "tool" and tool_turn["content"][0]["sha256"] == c.sha256
    assert "images" not in rows["text"] and "image_token_counts" not in rows["text"]


def test_with_images_copies_each_image_once_and_lists_it(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = make_image_run(db, tmp_path, "img-copy")
    folder = tmp_path / "dataset"
    folder.mkdir()
    out = folder / "sf.jsonl"
    read = count_image_reads(image_rows, monkeypatch)
    report = export_run(db, built.run, "specforge", out, image_store=built.store, with_images=True)
    assert report.images == 3  # "one" and "two" share an image: read and copied once
    assert sorted(read) == sorted(r.sha256 for r in built.refs)
    copies = sorted(p.name for p in (folder / "images").iterdir())
    assert copies == sorted(Path(r.key).name for r in built.refs)
    rows = read_jsonl(out)
    for entry in rows["two"]["images"]:
        assert entry["uri"].startswith("images/")
        data = (folder / entry["uri"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    manifest = json.loads((folder / "sf.jsonl.manifest.json").read_text())
    listed = {m["sha256"]: m for m in manifest["images"]}
    assert set(listed) == {r.sha256 for r in built.refs}
    for sha, entry in listed.items():
        data = (folder / entry["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha and entry["bytes"] == len(data)


def test_the_trainer_snippet_reads_a_mixed_export(db: Engine, tmp_path: Path) -> None:
    """docs/images.md's trainer snippet, as printed, on an export of text and image rows."""
    built = make_image_run(db, tmp_path, "img-mixed")
    folder = tmp_path / "dataset"
    folder.mkdir()
    out = folder / "mixed.jsonl"
    export_run(db, built.run, "specforge", out, image_store=built.store, with_images=True)
    rows = read_jsonl(out)
    assert "images" not in rows["text"] and len(rows["two"]["images"]) == 2  # mixed
    run_readme_snippet(ROOT / "docs" / "images.md", out)


def test_text_only_leaves_out_every_image_sample(
    db: Engine, tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    built = make_image_run(db, tmp_path, "img-text")
    for fmt in ("specforge", "conversations"):
        out = tmp_path / f"{fmt}.jsonl"
        report = export_run(
            db, built.run, fmt, out, tokenizer=tokenizer, image_store=built.store, text_only=True
        )
        rows = read_jsonl(out)
        assert set(rows) == {"text"} and "images" not in rows["text"], fmt
        assert (report.rows, report.image_rows_left_out) == (1, 3), fmt


def test_a_changed_stored_image_stops_the_copy_naming_it(db: Engine, tmp_path: Path) -> None:
    built = make_image_run(db, tmp_path, "img-bad")
    b = built.refs[1]
    Path(built.store.path(b.key)).write_bytes(b"not the image")
    out = tmp_path / "sf.jsonl"
    with pytest.raises(ImageExportError, match=rf"'two'.*image 1: image {b.key} .*hashes to"):
        export_run(db, built.run, "specforge", out, image_store=built.store, with_images=True)
    assert not out.exists()


def parquet_rows(folder: Path) -> dict[str, dict[str, Any]]:
    manifest = json.loads((folder / ".manifest.json").read_text())
    rows: dict[str, dict[str, Any]] = {}
    for shard in manifest["shards"]:
        for row in pq.read_table(folder / shard["path"]).to_pylist():
            rows[row["id"]] = row
    return rows


def test_parquet_has_image_columns_and_served_prompts(pg_engine: Engine, tmp_path: Path) -> None:
    built = make_image_run(pg_engine, tmp_path, "img-pq")
    out = tmp_path / "pq"
    export_parquet(pg_engine, built.run, str(out), image_store=built.store, with_images=True)
    rows = parquet_rows(out)
    for key, (prompt, refs, counts, output) in built.items.items():
        row = rows[key]
        assert row["prompt_ids"] == served(prompt, counts)
        assert row["output_ids"] == output
        if not refs:
            assert row["images"] is None and row["image_token_counts"] is None
            continue
        assert row["image_token_counts"] == counts
        assert [(e["sha256"], e["uri"], e["width"], e["height"]) for e in row["images"]] == [
            (r.sha256, r.key, r.width, r.height) for r in refs
        ]
    manifest = json.loads((out / ".manifest.json").read_text())
    for entry in manifest["images"]:
        data = (out / entry["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    with pg_engine.connect() as conn:
        assert check_export(conn, built.run.id, str(out)).problems == []
    # a copied image changed after the export: the row and the manifest entry are named
    a = built.refs[0]
    (out / a.key).write_bytes(b"changed")
    with pg_engine.connect() as conn:
        problems = check_export(conn, built.run.id, str(out)).problems
    assert any(p.startswith("manifest image ") and a.key in p for p in problems)
    assert any("item " in p and f"image 0: {a.key} hashes to" in p for p in problems)


def test_a_compacted_run_exports_the_same(pg_engine: Engine, tmp_path: Path) -> None:
    built = make_image_run(pg_engine, tmp_path, "img-compact")
    before_sf = tmp_path / "before.jsonl"
    export_run(pg_engine, built.run, "specforge", before_sf, image_store=built.store)
    export_parquet(pg_engine, built.run, str(tmp_path / "before"), image_store=built.store)
    settings = Settings(data_dir=tmp_path / "data", storage_url=(tmp_path / "store").as_uri())
    report = compact_run(pg_engine, settings, built.run, force=True)
    assert report.compacted == 4
    # the compacted shard is a dataset file itself: prompt_ids as served, the image columns
    shards = tmp_path / "store" / "runs"
    compacted = pq.read_table(next(shards.rglob("items-*.parquet"))).to_pylist()
    by_key = {row["id"]: row for row in compacted}
    prompt, _, counts, _ = built.items["two"]
    assert by_key["two"]["prompt_ids"] == served(prompt, counts)
    assert by_key["two"]["image_token_counts"] == counts
    after_sf = tmp_path / "after.jsonl"
    export_run(pg_engine, built.run, "specforge", after_sf, image_store=built.store)
    assert after_sf.read_bytes() == before_sf.read_bytes()
    export_parquet(pg_engine, built.run, str(tmp_path / "after"), image_store=built.store)
    before, after = parquet_rows(tmp_path / "before"), parquet_rows(tmp_path / "after")
    assert before == after
    # read back for verify, the prompts are the ids that were sent again
    report = verify_run(pg_engine, built.run, None, image_store=built.store)
    assert report.clean, report.to_json()
    assert report.checks[CHECK_PROMPT].checked == 4

"""`verify --export FILE.jsonl`: the image references of a specforge or conversations export.

Each row with images is matched to its ledger item by (id, sample, turn); its images (sha256,
size), its image_token_counts and each uri's bytes must be the ledger's. Relative uris (an
export made with --with-images) resolve against the file's folder, and the images its
`<file>.manifest.json` lists must be there with their hashes and sizes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import Connection

from app.ledger import reads
from app.outputs.image_checks import ImageRefs, listed_image_problems, row_image_problems
from app.outputs.parquet_export import MAX_PROBLEMS, ExportCheck
from app.outputs.split import manifest_path
from app.storage.shards import open_location

JSONL_SUFFIXES = (".jsonl",)


def is_jsonl_export(url: str) -> bool:
    """A local JSONL file (an export of the specforge or conversations format)."""
    return "://" not in url and Path(url).suffix in JSONL_SUFFIXES


def _image_items(
    conn: Connection, run_id: int
) -> dict[tuple[str, int], dict[int, reads.StoredItem]]:
    """The run's done image items by (id, sample), then turn; without their turns and token
    arrays, which the check does not read (memory: the image fields of the image items)."""
    found: dict[tuple[str, int], dict[int, reads.StoredItem]] = {}
    for item in reads.iter_items(conn, run_id):
        if item.image_refs:
            slim = replace(item, messages=None, prompt_ids=[], output_ids=None, tools=None)
            found.setdefault((item.item_key, item.sample_index), {})[item.turn_index] = slim
    return found


def _row_item(
    row: Mapping[str, Any], found: dict[tuple[str, int], dict[int, reads.StoredItem]]
) -> reads.StoredItem | None:
    turns = found.get((str(row.get("id")), int(row.get("sample") or 0)))
    if not turns:
        return None
    if isinstance(row.get("turn"), int):
        return turns.get(row["turn"])
    if isinstance(row.get("turns"), int):  # a whole conversation: its last turn's item
        return turns.get(row["turns"] - 1)
    return turns[max(turns)]


def _entries(row: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The row's images as {sha256, uri, width, height}: a specforge row lists them so; a
    conversations row lists uris, the hashes sit on its image parts (sizes are the ledger's)."""
    images = row.get("images")
    if images is None:
        return None
    if all(isinstance(e, Mapping) for e in images):
        return [dict(e) for e in images]
    parts = [
        part
        for turn in row.get("conversations") or []
        if isinstance(turn.get("content"), list)
        for part in turn["content"]
        if isinstance(part, Mapping) and part.get("type") == "image_url"
    ]
    entries = []
    for index, uri in enumerate(images):
        part = parts[index] if index < len(parts) else {}
        part_uri = (part.get("image_url") or {}).get("url")
        entries.append({"uri": uri, "sha256": part.get("sha256"), "part_uri": part_uri})
    return entries


def check_jsonl_images(
    conn: Connection, run_id: int, path: Path, storage_options: dict[str, Any] | None = None
) -> ExportCheck:
    """Check the image references of the JSONL export at path against the ledger."""
    check = ExportCheck(rows=0, shards=0)
    problems = check.problems
    if not path.is_file():
        problems.append(f"{path} does not exist")
        return check
    refs = ImageRefs(open_location(str(path.parent)), storage_options)
    found = _image_items(conn, run_id)
    with path.open(encoding="utf-8") as stream:
        for line_no, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            check.rows += 1
            try:
                row = json.loads(line)
            except ValueError as exc:
                problems.append(f"{path.name} line {line_no}: invalid JSON ({exc})")
                continue
            problems += _row_problems(f"{path.name} line {line_no}", row, found, refs)
            if len(problems) >= MAX_PROBLEMS:
                problems.append("... stopped after this many problems")
                return check
    manifest = manifest_path(path)
    if manifest.is_file():
        listed = json.loads(manifest.read_text(encoding="utf-8")).get("images") or []
        problems += listed_image_problems(listed, refs)
    return check


def _row_problems(
    where: str,
    row: Any,
    found: dict[tuple[str, int], dict[int, reads.StoredItem]],
    refs: ImageRefs,
) -> list[str]:
    if not isinstance(row, dict):
        return [f"{where}: not a JSON object"]
    entries = _entries(row)
    item = _row_item(row, found)
    if item is None:
        if entries is None:
            return []  # a text row
        return [f"{where}: row {row.get('id')!r} has images; the ledger's item has none"]
    label = f"{where} (item {item.id}, {item.item_key!r})"
    if entries is None:
        return [f"{label}: the row lists no images; the ledger's item has {len(item.image_refs)}"]
    problems = []
    for index, entry in enumerate(entries):
        if "part_uri" in entry and entry.pop("part_uri") != entry["uri"]:
            problems.append(f"{label}: image part {index} does not point at images[{index}]")
        if "width" not in entry and index < len(item.image_refs):
            entry["width"] = item.image_refs[index].width
            entry["height"] = item.image_refs[index].height
    found_problems = row_image_problems(entries, row.get("image_token_counts"), item, refs)
    return problems + [f"{label}: {p}" for p in found_problems]

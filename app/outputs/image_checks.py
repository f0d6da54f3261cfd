"""Checking the image references of an export: each uri resolves, its bytes hash to the sha256
the row gives, and the row's images and image_token_counts are the ledger's.

Used by `verify --export` for Parquet exports (app.outputs.parquet_export.check_export) and JSONL
exports (app.outputs.verify). Each distinct uri is read once, however many rows refer to it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from app.ledger import reads
from app.storage.shards import Location, open_location, read_object, split_uri


class ImageRefs:
    """Resolves and hashes the image uris of one export: relative ones against its folder
    (where --with-images put the copies), full URLs as they are; each uri read once."""

    def __init__(self, folder: Location, storage_options: dict[str, Any] | None = None) -> None:
        self.folder = folder
        self.storage_options = storage_options
        # uri -> (sha256 hex, size in bytes), or ("!" + why it could not be read, 0)
        self._digests: dict[str, tuple[str, int]] = {}

    def _digest(self, uri: str) -> tuple[str, int]:
        if uri not in self._digests:
            self._digests[uri] = self._read(uri)
        return self._digests[uri]

    def _read(self, uri: str) -> tuple[str, int]:
        try:
            if "://" in uri:
                folder, name = split_uri(uri)
                data = read_object(open_location(folder, self.storage_options), name)
            else:
                data = read_object(self.folder, uri)
        except Exception as exc:  # any filesystem's error: the reference does not resolve
            return f"!{exc}", 0
        return hashlib.sha256(data).hexdigest(), len(data)

    def problem(self, uri: str, sha256: str, size: int | None = None) -> str | None:
        """Why uri is not an image hashing to sha256 (of size bytes, if given), or None."""
        digest, got = self._digest(uri)
        if digest.startswith("!"):
            return f"{uri} does not resolve ({digest[1:]})"
        if digest != sha256:
            return f"{uri} hashes to {digest}, not {sha256}"
        if size is not None and got != size:
            return f"{uri} has {got} bytes, not {size}"
        return None

    @property
    def read(self) -> int:
        return len(self._digests)


def row_image_problems(
    entries: Sequence[Mapping[str, Any]] | None,
    counts: Sequence[int] | None,
    item: reads.StoredItem,
    refs: ImageRefs,
) -> list[str]:
    """What is wrong with a row's image fields against the ledger's item: the images (sha256,
    width, height in prompt order), the counts, and each uri's bytes. Empty when right."""
    wanted = [{"sha256": r.sha256, "width": r.width, "height": r.height} for r in item.image_refs]
    got = [{k: e.get(k) for k in ("sha256", "width", "height")} for e in entries or ()]
    problems: list[str] = []
    if got != wanted:
        problems.append(
            f"its images are {[g['sha256'] for g in got]}; the ledger's "
            f"{[w['sha256'] for w in wanted]} (with their sizes)"
        )
    stored_counts = item.image_token_counts if item.image_refs else None
    if (list(counts) if counts is not None else None) != stored_counts:
        problems.append(f"image_token_counts {counts}; the ledger's {stored_counts}")
    for index, entry in enumerate(entries or ()):
        uri, sha = entry.get("uri"), entry.get("sha256")
        if not isinstance(uri, str) or not isinstance(sha, str):
            problems.append(f"image {index} has no uri or sha256")
            continue
        problem = refs.problem(uri, sha)
        if problem is not None:
            problems.append(f"image {index}: {problem}")
    return problems


def listed_image_problems(listed: Sequence[Mapping[str, Any]], refs: ImageRefs) -> list[str]:
    """What is wrong with the images a manifest lists (--with-images): each file is there,
    hashes to its sha256 and has its size in bytes."""
    problems: list[str] = []
    for entry in listed:
        path, sha = entry.get("path"), entry.get("sha256")
        if not isinstance(path, str) or not isinstance(sha, str):
            problems.append(f"the manifest lists an image without path or sha256: {dict(entry)}")
            continue
        size = entry.get("bytes")
        problem = refs.problem(path, sha, size if isinstance(size, int) else None)
        if problem is not None:
            problems.append(f"manifest image {problem}")
    return problems

"""The image fields of exported rows: the served prompt ids, each image's entry (sha256, uri,
size), and, with --with-images, the images copied beside the export, each once.

An image item's ledger prompt holds one placeholder per image; what the model saw is that
prompt with the i-th placeholder repeated image_token_counts[i] times (app.core.images), so
every export writes the expanded ids. Image references point at the image store
(`image_uri`), or, with --with-images, at the copy under the export's own `images/` folder,
by the relative path `images/<sha256>.<ext>` (the store key), so the folder travels whole.

The row shapes, by what trainers read:
- specforge and Parquet: `images` = [{sha256, uri, width, height}] and `image_token_counts`
  beside input_ids / prompt_ids; a VLM trainer's collator needs no more to line up each
  image with its span of placeholder ids (SpecForge's VLM preparation built the same
  expanded ids + request ids pair: `specforge/data/vlm_preprocessing.py`).
- conversations: the turns keep each image where it was, as the OpenAI part
  `{"type": "image_url", "image_url": {"url": uri}, "sha256": ...}` (what chat templates
  and HF processors take), and the row lists the uris under `images` beside
  `conversations`, in prompt order: the field LLaVA-Instruct / ShareGPT4V rows,
  LLaMA-Factory's sharegpt format and SpecForge's VLM preparation read (a list of paths;
  SpecForge keeps only the text parts of a list content and attaches the image itself).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from app.core.errors import TokenmillError
from app.core.images import ImagePins, ImageRef, expand_placeholders, placeholder_count
from app.ledger import image_tokens, reads, run_queries
from app.storage.image_store import (
    ImageError,
    get_image,
    image_location,
    image_uri,
    stored_image_keys,
)
from app.storage.shards import Location, write_object

log = logging.getLogger(__name__)


class ImageExportError(TokenmillError):
    """An image item cannot be exported as the model saw it (its counts or images are missing
    or do not match its prompt, or a stored image is missing or changed)."""


def item_label(item: reads.StoredItem) -> str:
    return f"item {item.id} ({item.item_key!r}, sample {item.sample_index}, turn {item.turn_index})"


def count_problem(item: reads.StoredItem, placeholder_id: int | None) -> str | None:
    """Why item's image_token_counts cannot rebuild its served prompt, or None when they can:
    a done image item has one count per image, each >= 1, and its prompt one placeholder per
    image; a text item has no counts."""
    refs = item.image_refs
    counts = item.image_token_counts
    if not refs:
        return None if counts is None else f"image_token_counts {counts} on an item with no images"
    if placeholder_id is None:
        return f"{len(refs)} image(s), but its run pinned no image placeholder"
    if counts is None:
        return f"{len(refs)} image(s) and no image_token_counts"
    if len(counts) != len(refs):
        return f"{len(counts)} image_token_counts for {len(refs)} image(s)"
    bad = next((i for i, c in enumerate(counts) if not isinstance(c, int) or c < 1), None)
    if bad is not None:
        return f"image_token_counts[{bad}] is {counts[bad]!r} ({refs[bad].key}); each must be >= 1"
    found = placeholder_count(item.prompt_ids, placeholder_id)
    if found != len(refs):
        return f"{found} placeholder id(s) {placeholder_id} in prompt_ids for {len(refs)} image(s)"
    return None


def served_prompt(item: reads.StoredItem, placeholder_id: int | None) -> list[int]:
    """The prompt ids the server saw (a text item's as stored); ImageExportError naming the
    item when its counts cannot rebuild them."""
    if not item.image_refs and item.image_token_counts is None:
        return item.prompt_ids
    problem = count_problem(item, placeholder_id)
    if problem is not None:
        raise ImageExportError(f"{item_label(item)}: {problem}")
    assert placeholder_id is not None and item.image_token_counts is not None
    return expand_placeholders(item.prompt_ids, placeholder_id, item.image_token_counts)


@dataclass(frozen=True)
class CopiedImage:
    """One image an export copied beside itself: where, and what it must hash to."""

    sha256: str
    path: str
    bytes: int
    width: int
    height: int
    format: str

    def to_json(self) -> dict[str, Any]:
        return {
            "sha256": self.sha256,
            "path": self.path,
            "bytes": self.bytes,
            "width": self.width,
            "height": self.height,
            "format": self.format,
        }


class ImageRows:
    """How one export writes the image fields of a run's rows.

    store: the image store (None for a text-only run, whose rows have no image fields);
    copy_to: the export's folder with --with-images, where each image referenced is copied
    once (read with get_image, which checks its sha256), and referenced by relative path;
    check_present: a reference to the store is written only once its object is found there
    (an export never points at a file that does not exist)."""

    def __init__(
        self,
        pins: ImagePins | None,
        store: Location | None,
        copy_to: Location | None = None,
        *,
        check_present: bool = False,
    ) -> None:
        self.placeholder_id = None if pins is None else pins.placeholder_id
        self.store = store
        self.copy_to = copy_to
        self.copied: dict[str, CopiedImage] = {}
        self.check_present = check_present
        self._present: set[str] | None = None  # the store's image keys, listed once

    @classmethod
    def for_run(
        cls, conn: Connection, run_id: int, store: Location | None, copy_to: Location | None = None
    ) -> ImageRows:
        """The run's pins read from the ledger; a run with images and no store given points at
        its pinned storage (a run older than the pin: TOKENMILL_STORAGE_URL)."""
        pins = image_tokens.run_image_pins(conn, run_id)
        if pins is not None and store is None:
            from app.core.settings import get_settings

            store = image_location(get_settings(), run_queries.run_storage_url(conn, run_id))
        return cls(pins, store, copy_to, check_present=True)

    def served_prompt(self, item: reads.StoredItem) -> list[int]:
        return served_prompt(item, self.placeholder_id)

    def uri(self, item: reads.StoredItem, index: int, ref: ImageRef) -> str:
        """Where an exported row finds ref: its copy beside the export, or its store URL."""
        if self.store is None:
            raise ImageExportError(
                f"{item_label(item)} image {index} ({ref.key}): no image store to point at"
            )
        if self.copy_to is None:
            if self.check_present:
                self._check_present(item, index, ref)
            return image_uri(self.store, ref)
        if ref.sha256 not in self.copied:
            self._copy(item, index, ref)
        return ref.key

    def _check_present(self, item: reads.StoredItem, index: int, ref: ImageRef) -> None:
        """ImageExportError unless ref's object is in the store (its images/ folder is listed
        once; a key not listed is looked for on its own, as an enqueue may have added it)."""
        assert self.store is not None
        if self._present is None:
            self._present = stored_image_keys(self.store)
        if ref.key in self._present:
            return
        try:
            found = self.store.fs.exists(self.store.path(ref.key))
        except OSError as exc:
            raise ImageExportError(
                f"could not look for {ref.key} in {self.store.url}: {exc}"
            ) from exc
        if not found:
            raise ImageExportError(
                f"{item_label(item)} image {index}: {ref.key} is missing from {self.store.url}, "
                "so the export would point at a file that does not exist (is this the run's "
                "storage? `tokenmill verify RUN` checks every image)"
            )
        self._present.add(ref.key)

    def _copy(self, item: reads.StoredItem, index: int, ref: ImageRef) -> None:
        assert self.store is not None and self.copy_to is not None
        try:
            data = get_image(self.store, ref)
        except ImageError as exc:
            raise ImageExportError(f"{item_label(item)} image {index}: {exc}") from None
        folder, _, name = ref.key.rpartition("/")
        target = Location(
            fs=self.copy_to.fs, root=self.copy_to.path(folder), url=self.copy_to.uri(folder)
        )
        write_object(target, name, data)
        self.copied[ref.sha256] = CopiedImage(
            ref.sha256, ref.key, len(data), ref.width, ref.height, ref.format
        )
        log.debug("copied image %s to %s", ref.key, self.copy_to.uri(ref.key))

    def entries(self, item: reads.StoredItem) -> list[dict[str, Any]]:
        """The item's images as an exported row lists them, in prompt order."""
        return [
            {
                "sha256": ref.sha256,
                "uri": self.uri(item, i, ref),
                "width": ref.width,
                "height": ref.height,
            }
            for i, ref in enumerate(item.image_refs)
        ]

    def fields(self, item: reads.StoredItem) -> dict[str, Any]:
        """`images` and `image_token_counts` of an image item's row; nothing for a text item
        (its rows stay as they were before images existed)."""
        if not item.image_refs:
            return {}
        return {"images": self.entries(item), "image_token_counts": item.image_token_counts}

    def manifest(self) -> list[dict[str, Any]]:
        """The images copied beside the export, by sha256."""
        return [self.copied[sha].to_json() for sha in sorted(self.copied)]


def image_parts(turns: Iterable[Mapping[str, Any]], uris: list[tuple[str, str]]) -> list[Any]:
    """The turns with each image part, in prompt order, pointing at (uri, sha256) in turn.

    Stored turns keep an image part as `{"type": "image_url", "image_url": {"url": <store
    key>}}`; the export writes it as `{"type": "image_url", "image_url": {"url": uri},
    "sha256": ...}`, the OpenAI part that chat templates and HF processors read, with the
    hash beside it. ValueError when the turns hold another number of image parts."""
    pending = list(uris)
    out: list[Any] = []
    for turn in turns:
        turn = dict(turn)
        content = turn.get("content")
        if isinstance(content, list):
            parts: list[Any] = []
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in ("image_url", "image"):
                    if not pending:
                        raise ValueError("the turns hold more image parts than the item's images")
                    uri, sha = pending.pop(0)
                    part = {"type": "image_url", "image_url": {"url": uri}, "sha256": sha}
                parts.append(part)
            turn["content"] = parts
        out.append(turn)
    if pending:
        raise ValueError(
            f"the turns hold {len(uris) - len(pending)} image parts for its {len(uris)} images"
        )
    return out


def expanded_mask(
    prompt_ids: list[int], mask: list[int], placeholder_id: int, counts: list[int]
) -> list[int]:
    """A loss mask over prompt_ids + output, stretched as the prompt is served: each image's
    placeholder value repeated for each of its tokens (a prompt span, so 0)."""
    out: list[int] = []
    image = 0
    for position, value in enumerate(mask):
        if position < len(prompt_ids) and prompt_ids[position] == placeholder_id:
            out.extend([value] * counts[image])
            image += 1
        else:
            out.append(value)
    return out

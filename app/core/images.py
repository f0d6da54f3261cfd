"""Images in prompts: what an item records of each image, what a run pins, and how the ids a
server served relate to the ids sent.

A request carries one placeholder id per image; the server repeats the i-th placeholder
counts[i] >= 1 times and keeps every other id (sglang.md, "Images on /generate"). So the
served prompt is fully described by the request ids and the counts: `expand_placeholders`
rebuilds it, `served_counts` reads the counts off a served prompt and refuses anything else
(the re-tokenize fallback, another processor) as drift, naming the first difference.
No I/O here: reading, checking and storing images is `app.storage.image_store`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from app.core.errors import TokenmillError

# the Pillow format names tokenmill stores, and the extension of their store key
FORMAT_EXTENSIONS: dict[str, str] = {
    "PNG": "png",
    "JPEG": "jpg",
    "WEBP": "webp",
    "GIF": "gif",
    "BMP": "bmp",
    "TIFF": "tiff",
}


def store_key(sha256: str, image_format: str) -> str:
    """The content address of an image in object storage: `images/<sha256>.<ext>`."""
    ext = FORMAT_EXTENSIONS.get(image_format.upper(), image_format.lower())
    return f"images/{sha256}.{ext}"


@dataclass(frozen=True)
class ImageRef:
    """One image of a prompt as its item records it: the content hash, where the store holds
    it, what it is, and the source the row gave (a path, a URL, or `data:` for a data URI)."""

    sha256: str
    key: str
    width: int
    height: int
    format: str
    bytes: int
    source: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ImageRef:
        return cls(
            sha256=str(data["sha256"]),
            key=str(data["key"]),
            width=int(data["width"]),
            height=int(data["height"]),
            format=str(data["format"]),
            bytes=int(data["bytes"]),
            source=str(data["source"]),
        )


def refs_from_json(value: Sequence[Mapping[str, Any]] | None) -> tuple[ImageRef, ...]:
    """An item's `images` column as ImageRefs (empty for a text item)."""
    return tuple(ImageRef.from_json(entry) for entry in value or ())


@dataclass(frozen=True)
class ImagePins:
    """What a multimodal run pins: the model family's placeholder token and its id (read from
    the tokenizer folder), and the text its template renders for one image."""

    family: str
    placeholder: str
    placeholder_id: int
    image_text: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ImagePins:
        return cls(
            family=str(data["family"]),
            placeholder=str(data["placeholder"]),
            placeholder_id=int(data["placeholder_id"]),
            image_text=str(data["image_text"]),
        )


# The families SGLang 0.5.23 serves images for, with their placeholder and the text their
# templates render for one image (sglang.md, "Kimi-K2.5" and "Qwen2.5-VL / Qwen3-VL").
FAMILIES: dict[str, tuple[str, str]] = {
    "kimi": ("<|media_pad|>", "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"),
    "qwen": ("<|image_pad|>", "<|vision_start|><|image_pad|><|vision_end|>"),
}


class ImageDrift(TokenmillError):
    """The served prompt ids are not the request ids with each placeholder repeated."""


def placeholder_count(ids: Sequence[int], placeholder_id: int) -> int:
    return sum(1 for token in ids if token == placeholder_id)


def adjacent_placeholders(ids: Sequence[int], placeholder_id: int) -> int | None:
    """The position of the second of two adjacent placeholders (their expansions could not
    be told apart in the served ids), or None."""
    for position in range(1, len(ids)):
        if ids[position] == placeholder_id and ids[position - 1] == placeholder_id:
            return position
    return None


def expand_placeholders(
    ids: Sequence[int], placeholder_id: int, counts: Sequence[int]
) -> list[int]:
    """The served prompt: ids with the i-th placeholder repeated counts[i] times."""
    if placeholder_count(ids, placeholder_id) != len(counts):
        raise ValueError(
            f"{placeholder_count(ids, placeholder_id)} placeholders but {len(counts)} counts"
        )
    out: list[int] = []
    image = 0
    for token in ids:
        if token == placeholder_id:
            out.extend([token] * counts[image])
            image += 1
        else:
            out.append(token)
    return out


def served_counts(
    request_ids: Sequence[int], served_ids: Sequence[int], placeholder_id: int
) -> list[int]:
    """How many times the server repeated each placeholder of request_ids in served_ids.

    ImageDrift when served_ids is anything else: an id changed, added or dropped outside a
    placeholder's run, a placeholder missing, or a run of placeholder ids where the request
    has none. The message names the first difference by position and id.
    """
    counts: list[int] = []
    at = 0  # position in served_ids
    for position, token in enumerate(request_ids):
        if token == placeholder_id:
            run = 0
            while at + run < len(served_ids) and served_ids[at + run] == placeholder_id:
                run += 1
            if run == 0:
                raise ImageDrift(_difference(position, token, at, served_ids, "its image"))
            counts.append(run)
            at += run
            continue
        if at >= len(served_ids) or served_ids[at] != token:
            raise ImageDrift(_difference(position, token, at, served_ids, "the same id"))
        at += 1
    if at != len(served_ids):
        raise ImageDrift(
            f"the served prompt has {len(served_ids) - at} id(s) past the request's end "
            f"(served position {at}: id {served_ids[at]})"
        )
    return counts


def _difference(
    position: int, token: int, at: int, served_ids: Sequence[int], expected: str
) -> str:
    got = f"id {served_ids[at]}" if at < len(served_ids) else "the end of the prompt"
    return (
        f"request position {position} (id {token}) should be served as {expected} at served "
        f"position {at}, which is {got}"
    )


# The /server_info launch arguments (SGLang 0.5.23, `arg_groups/fields/mm.py`) that change how
# many tokens an image becomes, or whether images are read at all: with the server's version,
# they join the fingerprint a run pins (a server that comes back with other values is paused).
IMAGE_SETTINGS = (
    "enable_multimodal",
    "mm_process_config",
    "image_processor_backend",
    "disable_fast_image_processor",
    "limit_mm_data_per_request",
)


def image_settings(server_info: Mapping[str, Any]) -> dict[str, Any]:
    """The image settings a /server_info reports (the keys it has of IMAGE_SETTINGS)."""
    return {name: server_info[name] for name in IMAGE_SETTINGS if name in server_info}

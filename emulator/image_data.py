"""`image_data` on the emulator's /generate: which images belong to which prompt, and reading
one image item as SGLang 0.5.23's loaders do, with their errors.

Shapes and messages: sglang.md, "Images on /generate". Kimi reads an item's bytes first
(`snapshot_media`), so a file it cannot open is a 500; the generic loader (Qwen2.5-VL) reads
inside its client-error wrapper, and decodes a relative path as base64.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from app.core.errors import TokenmillError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif")
REQUEST_TIMEOUT_S = 3.0
BATCH_LENGTH = "The length of image_data should be equal to the batch size."


class ImageInputError(TokenmillError, ValueError):
    """SGLang answers 400 `{"error": {"message": ...}}` (a ValueError while processing)."""


class ImageServerError(TokenmillError):
    """SGLang answers a plain-text 500 (any other exception while processing)."""


class _ClientMediaError(TokenmillError):
    """What SGLang counts as the client's fault (CLIENT_MEDIA_EXCEPTIONS): bad base64, an
    unreachable URL, bytes that do not decode."""


class _UnreachableError(_ClientMediaError):
    """A URL that could not be fetched (requests' RequestException in SGLang): the client's
    fault to the generic loader, a server error to Kimi's snapshot."""


def images_per_prompt(value: Any, batch_size: int, is_single: bool) -> list[list[Any]]:
    """The image items of each prompt, as SGLang normalizes `image_data`.

    One request: an item or a list of items. A batch: one item for every prompt, a list with
    one item per prompt, or a list of lists (the first entry alone decides); another length is
    a 400. null, [] and null entries mean no image.
    """
    if value is None:
        return [[] for _ in range(batch_size)]
    if is_single:
        items = value if isinstance(value, list) else [value]
        return [_present(items)]
    if not isinstance(value, list):
        return [[value] for _ in range(batch_size)]
    if not value:
        return [[] for _ in range(batch_size)]
    if len(value) != batch_size:
        raise ImageInputError(BATCH_LENGTH)
    if isinstance(value[0], list):
        return [_present(entry or []) for entry in value]
    return [_present([entry]) for entry in value]


def _present(items: list[Any]) -> list[Any]:
    """A prompt's items; a list of nulls only is no image (a null among images stays, and
    fails to load, as in SGLang)."""
    return [] if all(item is None for item in items) else list(items)


@dataclass(frozen=True)
class LoadedImage:
    """One image as the processor saw it: its bytes' sha256 and its size."""

    sha256: str
    width: int
    height: int
    size_bytes: int


def item_source(item: Any) -> Any:
    """The string an item names its image by (an object item's `url`)."""
    if isinstance(item, Mapping):
        return item.get("url", "")
    return item


def load_image(item: Any, index: int, family: str, *, legacy: bool = False) -> LoadedImage:
    """Read and decode image item `index` the way the family's SGLang processor does.

    ImageInputError (400) or ImageServerError (500) with SGLang's message. legacy: the
    prompt-scanning loader Qwen falls back to when its image groups and images differ in
    number (its messages do not name the index).
    """
    prefix = (
        "An exception occurred while loading multimodal data: "
        if legacy
        else f"An exception occurred while loading IMAGE data at index {index}: "
    )
    source = item_source(item)
    if family == "kimi":
        try:
            data = _kimi_bytes(source)
        except _UnreachableError as exc:
            raise ImageServerError(prefix + str(exc)) from exc
        except (_ClientMediaError, ValueError) as exc:
            raise ImageInputError(prefix + str(exc)) from exc
        except Exception as exc:
            raise ImageServerError(prefix + str(exc)) from exc
        described = _describe(data)
    else:
        described = _describe(source)
        try:
            data = _generic_bytes(source)
        except (_ClientMediaError, ValueError) as exc:
            raise ImageInputError(f"{prefix}Error while loading data {described}: {exc}") from exc
        except Exception as exc:
            raise ImageServerError(f"{prefix}Error while loading data {described}: {exc}") from exc
    try:
        width, height = _decode(data)
    except _ClientMediaError as exc:
        raise ImageInputError(f"{prefix}Error while loading data {described}: {exc}") from exc
    return LoadedImage(hashlib.sha256(data).hexdigest(), width, height, len(data))


def _describe(data: Any) -> str:
    """The loader's `str(data)`, cut at 100 characters."""
    text = str(data)
    return text[:100] + "..." if len(text) > 100 else text


def _decode(data: bytes) -> tuple[int, int]:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return int(image.width), int(image.height)
    except (OSError, SyntaxError, ValueError) as exc:
        raise _ClientMediaError(f"Could not decode image: {exc}") from exc


def _kimi_bytes(source: Any) -> bytes:
    """Kimi's byte snapshot: file:// and image-named existing paths are read; URLs, data URIs
    and anything else go through the shared reader."""
    if not isinstance(source, str):
        raise _ClientMediaError(f"Invalid image: {source}")
    if source.startswith("file://"):
        source = unquote(urlparse(source).path)
    elif source.startswith(("http://", "https://", "data:")):
        return _image_bytes(source)
    if source.lower().endswith(IMAGE_EXTENSIONS) and Path(source).is_file():
        return Path(source).read_bytes()
    return _image_bytes(source)


def _generic_bytes(source: Any) -> bytes:
    """The generic loader: file:// becomes its path; every other string goes to the reader
    (a relative path is not a file to it: it is decoded as base64)."""
    if not isinstance(source, str):
        raise _ClientMediaError(f"Invalid image: {source}")
    if source.startswith("file://"):
        source = unquote(urlparse(source).path)
    return _image_bytes(source)


def _image_bytes(source: str) -> bytes:
    """SGLang's get_image_bytes: download a URL, open an absolute or file:// path, decode a
    data URI or bare base64 (strictly)."""
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=REQUEST_TIMEOUT_S) as response:
                return bytes(response.read())
        except (urllib.error.URLError, TimeoutError) as exc:
            raise _UnreachableError(str(exc)) from exc
    if source.startswith(("file://", "/")):
        return Path(source).read_bytes()
    encoded = source.split(",", 1)[1] if source.startswith("data:") else source
    try:
        return base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise _ClientMediaError(str(exc)) from exc

"""The image stage of an enqueue: every image a record's turns reference is read once, checked
and stored under its content address, and its image parts then point at the store key.

Sources: a local path (a relative one against the image root: `--image-root`, else the input
file's folder), a `file://` URL, a `data:` URI, or any fsspec URL (`s3://...`, opened with the
storage options). Each distinct source is read once per enqueue (the outcome cached by the
resolved source); a missing or undecodable image is the line's error, naming the part.
`StoredImages` reads them back for servers (`--render-with`, parity) as data URIs.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urlparse

from app.core.contracts import Message, PromptRecord
from app.core.errors import InputError, TokenmillError
from app.core.images import ImageRef
from app.prompts.chat_path import image_urls, is_image_part, with_image_urls
from app.storage.image_store import ImageError, get_image, put_image
from app.storage.shards import Location

log = logging.getLogger(__name__)

# data URIs and URLs are shown this long in errors
SHOWN_CHARS = 60
# the stored images a process keeps as data URIs for server requests (most recently used)
DATA_URI_CACHE = 64
MIME_TYPES = {"jpg": "jpeg", "tiff": "tiff", "png": "png", "webp": "webp", "gif": "gif"}


class ImageUnreadable(TokenmillError):
    """An image source that cannot be read or is not a usable image (the message says why)."""


def shown(source: str) -> str:
    """A source as an error names it (a data URI or a long URL cut short)."""
    return source if len(source) <= SHOWN_CHARS else source[: SHOWN_CHARS - 3] + "..."


class ImageSources:
    """Reads, checks and stores image sources, each distinct one once (its ImageRef, or why
    it cannot be used, cached by the resolved source)."""

    def __init__(
        self,
        store: Callable[[], Location],
        root: Path,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        # opened at the first image, so a text-only input never touches the store
        self._open_store = store
        self._store: Location | None = None
        self._root = Path(root)
        self._options = dict(storage_options or {})
        self._outcomes: dict[str, ImageRef | str] = {}
        # distinct sources (the cache answers the others): read and stored, their bytes, and
        # those that could not be read or are no usable image (nothing stored for them)
        self.reads = 0
        self.bytes_read = 0
        self.refused = 0

    def ref(self, source: str) -> ImageRef:
        """The stored image of source; ImageUnreadable saying why it cannot be used."""
        resolved = self._resolved(source)
        outcome = self._outcomes.get(resolved)
        if outcome is None:
            outcome = self._outcomes[resolved] = self._read_and_store(source, resolved)
        if isinstance(outcome, str):
            raise ImageUnreadable(f"image {shown(source)!r} {outcome}")
        given = _given(source)
        return outcome if outcome.source == given else replace(outcome, source=given)

    def _resolved(self, source: str) -> str:
        """The cache key of a source: its path or URL (a data URI by its sha256: the
        cache must not hold every URI of the input)."""
        if source.startswith("data:"):
            return "data:" + hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
        if source.startswith("file://"):
            return str(Path(unquote(urlparse(source).path)))
        if _is_url(source):
            return source
        path = Path(source).expanduser()
        return str(path if path.is_absolute() else self._root / path)

    def _read_and_store(self, source: str, resolved: str) -> ImageRef | str:
        """The source's ImageRef, or why it cannot be used (after "image 'source' ")."""
        try:
            data = self._read(source, resolved)
        except ImageUnreadable as exc:
            self.refused += 1
            return f"cannot be read: {exc}"
        if self._store is None:
            self._store = self._open_store()
        try:
            stored = put_image(self._store, data, _given(source))
        except ImageError as exc:
            self.refused += 1
            return f"is not a usable image: {exc}"
        self.reads += 1
        self.bytes_read += len(data)
        return stored

    def _read(self, source: str, resolved: str) -> bytes:
        if source.startswith("data:"):
            return data_uri_bytes(source)
        if _is_url(resolved):
            import fsspec

            try:
                with fsspec.open(resolved, "rb", **self._options) as stream:
                    data: bytes = stream.read()
                return data
            except FileNotFoundError:
                raise ImageUnreadable("No such file") from None
            except Exception as exc:  # any filesystem's failure is this image's
                raise ImageUnreadable(f"{type(exc).__name__}: {exc}") from None
        try:
            return Path(resolved).read_bytes()
        except OSError as exc:
            raise ImageUnreadable(exc.strerror or str(exc)) from None


def data_uri_bytes(uri: str) -> bytes:
    """The bytes a `data:` URI holds (base64, or percent-encoded without `;base64`)."""
    header, comma, payload = uri.partition(",")
    if not comma:
        raise ImageUnreadable("the data URI has no ',' before its data")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageUnreadable("the data URI's base64 does not decode") from None
    return unquote_to_bytes(payload)


def _given(source: str) -> str:
    """The source an ImageRef keeps: as given, a data URI as `data:` alone."""
    return "data:" if source.startswith("data:") else source


def _is_url(source: str) -> bool:
    scheme = urlparse(source).scheme
    return len(scheme) > 1 and "://" in source  # one letter: a Windows drive, not a scheme


class ImageResolver:
    """Stores the images of records: each record comes back with its image parts pointing at
    the store keys and its images (over its whole conversation, in order) recorded, or as the
    InputError of its first image that cannot be used."""

    def __init__(self, sources: ImageSources) -> None:
        self._sources = sources

    @property
    def reads(self) -> int:
        """The distinct image sources read and stored so far."""
        return self._sources.reads

    @property
    def refused(self) -> int:
        """The distinct image sources that could not be read or are no usable image."""
        return self._sources.refused

    @property
    def bytes_read(self) -> int:
        return self._sources.bytes_read

    def resolve(self, record: PromptRecord) -> PromptRecord | InputError:
        turns = record.conversation or record.messages
        if not turns or not image_urls(turns):
            return record
        field = record.prompt_fields[0] if record.prompt_fields else "messages"
        # a row's `system` field is the record's first turn, not one of the row's turns
        shift = 1 if "system" in record.prompt_fields and turns[0].get("role") == "system" else 0
        refs: dict[str, ImageRef] = {}
        ordered: list[ImageRef] = []
        for index, turn in enumerate(turns):
            content = turn.get("content")
            if not isinstance(content, list):
                continue
            for part_index, part in enumerate(content):
                if not is_image_part(part):
                    continue
                source = part["image_url"]["url"]
                try:
                    ref = self._sources.ref(source)
                except ImageUnreadable as exc:
                    where = f"{field}[{index - shift}].content[{part_index}]"
                    return InputError(f"{where}: {exc}", record.line)
                refs[source] = ref
                ordered.append(ref)

        def key_of(source: str) -> str:
            return refs[source].key

        return replace(
            record,
            messages=None if record.messages is None else with_image_urls(record.messages, key_of),
            conversation=None
            if record.conversation is None
            else with_image_urls(record.conversation, key_of),
            images=tuple(ordered),
        )


def images_of(messages: Sequence[Message] | None, record: PromptRecord) -> list[ImageRef]:
    """The images of messages (the record's turns or a prefix of them, their image parts
    holding store keys), in prompt order, as the record stored them."""
    keys = image_urls(messages or [])
    refs = list(record.images[: len(keys)])
    if [ref.key for ref in refs] == keys:
        return refs
    by_key = {ref.key: ref for ref in record.images}
    return [by_key[key] for key in keys]


def refs_json(refs: Sequence[ImageRef]) -> list[dict[str, Any]] | None:
    """An item's `images` column: the refs' JSON, or None for a text item."""
    return [ref.to_json() for ref in refs] or None


class StoredImages:
    """The stored images as servers take them: each store key as a `data:` URI of its bytes
    (checked against the sha256 its key names), the most recently used kept in memory."""

    def __init__(self, store: Callable[[], Location]) -> None:
        self._open_store = store
        self._store: Location | None = None
        self.data_uri = functools.lru_cache(maxsize=DATA_URI_CACHE)(self._data_uri)

    def _data_uri(self, key: str) -> str:
        name = key.rsplit("/", 1)[-1]
        sha256, _, ext = name.partition(".")
        # get_image reads the key and checks the sha256 the key names; nothing else is used
        ref = ImageRef(sha256, key, 0, 0, ext.upper(), 0, key)
        if self._store is None:
            self._store = self._open_store()
        try:
            data = get_image(self._store, ref)
        except ImageError as exc:
            raise InputError(f"stored image {key} cannot be read: {exc}") from None
        mime = MIME_TYPES.get(ext, ext)
        return f"data:image/{mime};base64,{base64.b64encode(data).decode('ascii')}"

    def for_server(self, messages: Sequence[Message]) -> list[Message]:
        """messages with each image part's store key replaced by the image's data URI."""
        if not image_urls(messages):
            return list(messages)
        return with_image_urls(messages, self.data_uri)

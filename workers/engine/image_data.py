"""An item's images as its request carries them: read from the image store (each checked
against its sha256), encoded as `data:` URIs, and kept in a small LRU by sha256 per worker.

A run often repeats an image (several samples of one prompt, a conversation's boundary
samples, the same picture in many rows), so a worker reads and encodes each one once while
it stays in the cache. The store's `ImageError` (missing, or no longer its sha256) reaches
the caller: it is the item's failure, not the server's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from app.core.images import ImageRef
from app.sglang.client import image_data_uri
from app.storage.image_store import get_image
from app.storage.shards import Location

# the encoded URIs a worker keeps (a 2048x2048 PNG photo is some 8 MB as base64)
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024


class ImageData:
    """The `image_data` list of an item, from the store through a bounded LRU of URIs.

    Thread-safe: a window's slots share one. The store is opened on first use (after the
    fork, never at import). Two slots missing the same image at once both read it; the
    cache keeps one copy.
    """

    def __init__(
        self, open_store: Callable[[], Location], *, max_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        self._open_store = open_store
        self._store: Location | None = None
        self._max_bytes = max_bytes
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reads = 0  # images read from the store (cache misses)

    def uris(self, refs: Sequence[ImageRef], store: Location | None = None) -> list[str]:
        """One `data:image/...;base64,` URI per ref, in order, read from store (default: the
        one open_store opens). ImageError names the image that is missing from the store or
        no longer hashes to its sha256."""
        return [self._uri(ref, store) for ref in refs]

    def _uri(self, ref: ImageRef, store: Location | None) -> str:
        with self._lock:
            cached = self._cache.get(ref.sha256)
            if cached is not None:
                self._cache.move_to_end(ref.sha256)
                return cached
            store = store or self._store
        if store is None:
            store = self._open_store()
            with self._lock:
                self._store = self._store or store
        uri = image_data_uri(ref.format, get_image(store, ref))
        with self._lock:
            self.reads += 1
            if len(uri) <= self._max_bytes and ref.sha256 not in self._cache:
                self._cache[ref.sha256] = uri
                self._bytes += len(uri)
                while self._bytes > self._max_bytes:
                    _, dropped = self._cache.popitem(last=False)
                    self._bytes -= len(dropped)
        return uri

    @property
    def cached(self) -> int:
        """How many images the cache holds now."""
        with self._lock:
            return len(self._cache)

"""A worker's image data: the stored bytes as data URIs, each image read once while it stays in
the bounded LRU, the least recently used one dropped first, and a changed or missing image an
ImageError naming it (from the store's sha256 check)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from app.core.images import ImageRef
from app.storage.image_store import ImageError, put_image
from app.storage.shards import Location, open_location
from workers.engine.image_data import ImageData


def png(side: int, shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (shade, shade, shade)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def loc(tmp_path: Path) -> Location:
    return open_location((tmp_path / "store").as_uri(), {})


def test_uris_are_the_stored_bytes_read_once_while_cached(loc: Location) -> None:
    a, b = put_image(loc, png(8, 10), "a.png"), put_image(loc, png(8, 20), "b.png")
    data = ImageData(lambda: loc)
    uris = data.uris([a, b, a])
    assert uris[0] == uris[2] == "data:image/png;base64," + base64.b64encode(png(8, 10)).decode()
    assert base64.b64decode(uris[1].split(",", 1)[1]) == png(8, 20)
    data.uris([b, a])
    assert data.reads == 2 and data.cached == 2


def test_the_least_recently_used_image_leaves_a_full_cache_first(loc: Location) -> None:
    refs = [put_image(loc, png(8, shade), f"{shade}.png") for shade in (10, 20, 30)]
    one = len(ImageData(lambda: loc).uris(refs[:1])[0])
    data = ImageData(lambda: loc, max_bytes=2 * one + one // 2)  # room for two of them
    data.uris([refs[0], refs[1]])
    data.uris([refs[0]])  # refs[1] is now the least recently used
    data.uris([refs[2]])
    assert data.cached == 2 and data.reads == 3
    data.uris([refs[0], refs[2]])
    assert data.reads == 3  # both still cached
    data.uris([refs[1]])
    assert data.reads == 4  # it had left


def test_a_changed_or_missing_image_is_an_error_naming_it(loc: Location, tmp_path: Path) -> None:
    ref = put_image(loc, png(8, 10), "a.png")
    Path(loc.path(ref.key)).write_bytes(png(8, 11))
    with pytest.raises(ImageError, match=ref.key):
        ImageData(lambda: loc).uris([ref])
    gone = ImageRef("0" * 64, "images/" + "0" * 64 + ".png", 8, 8, "PNG", 9, "gone.png")
    with pytest.raises(ImageError, match="missing"):
        ImageData(lambda: loc).uris([gone])

"""The image store: every image a prompt uses, once, under its content address.

`images/<sha256>.<ext>` in `TOKENMILL_STORAGE_URL` (a local folder by default, S3 or any
fsspec URL otherwise), shared by every row and run that uses the image, so GPU nodes never
need the user's paths. `inspect_image` checks that bytes decode (Pillow) and reads their
format and size; `put_image` stores them if absent and returns the ImageRef an item records;
`get_image` reads them back and checks they still hash to their sha256 (ImageError: the image is
missing or changed; StorageError: the store did not answer, which a retry may fix).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from app.core.errors import NotFound, TokenmillError
from app.core.images import FORMAT_EXTENSIONS, ImageRef, store_key
from app.core.settings import Settings
from app.storage.shards import Location, StorageError, open_location, read_object, write_object

# the folder of the store that holds the images (app.core.images.store_key)
IMAGES_PREFIX = "images"


class ImageError(TokenmillError, ValueError):
    """Bytes that are not a usable image, or a stored image that is missing or changed."""


@dataclass(frozen=True)
class ImageInfo:
    """What decoding an image tells: its Pillow format name and its size in pixels."""

    format: str
    width: int
    height: int


def inspect_image(data: bytes) -> ImageInfo:
    """The format and size of an encoded image; ImageError if it does not decode in full."""
    from PIL import Image, UnidentifiedImageError  # only image runs pay for importing it

    if not data:
        raise ImageError("the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                image_format = image.format or ""
                width, height = image.size
                image.load()  # decodes every pixel: a truncated file fails here
    except UnidentifiedImageError:
        raise ImageError("the bytes are not an image (no format Pillow reads)") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"the image does not decode ({exc})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"the image is too large to decode safely ({exc})") from None
    if image_format not in FORMAT_EXTENSIONS:
        known = ", ".join(FORMAT_EXTENSIONS)
        raise ImageError(f"the image is {image_format or 'of no known format'}; use one of {known}")
    return ImageInfo(image_format, width, height)


def image_location(settings: Settings, storage_url: str | None = None) -> Location:
    """The storage folder that holds the images/ prefix: a run's pinned storage_url, else the
    root of TOKENMILL_STORAGE_URL (a run older than the pin)."""
    return open_location(storage_url or settings.resolved_storage_url(), settings.storage_options)


def _folder(loc: Location, key: str) -> tuple[Location, str]:
    """The folder of key under loc and key's name in it (objects are written by name)."""
    folder, _, name = key.rpartition("/")
    sub = Location(fs=loc.fs, root=loc.path(folder), url=loc.uri(folder)) if folder else loc
    return sub, name


def put_image(loc: Location, data: bytes, source: str) -> ImageRef:
    """Check data, store it under its content address unless already there, and return the
    ImageRef for it (source: the reference the row gave, kept for the record)."""
    info = inspect_image(data)
    sha = hashlib.sha256(data).hexdigest()
    key = store_key(sha, info.format)
    try:
        present = loc.fs.exists(loc.path(key))
    except Exception as exc:
        raise StorageError(f"could not look for {key} in {loc.url}: {exc}") from exc
    if not present:
        write_object(*_folder(loc, key), data)
    return ImageRef(
        sha256=sha,
        key=key,
        width=info.width,
        height=info.height,
        format=info.format,
        bytes=len(data),
        source=source,
    )


def get_image(loc: Location, ref: ImageRef) -> bytes:
    """The stored bytes of ref; ImageError if missing or if they no longer hash to its sha256."""
    try:
        data = read_object(*_folder(loc, ref.key))
    except (NotFound, FileNotFoundError):
        raise ImageError(f"image {ref.key} is missing from {loc.url}") from None
    except OSError as exc:
        # the store did not answer (S3 down, a network error): not the image's fault, try again
        raise StorageError(f"could not read image {ref.key} from {loc.url}: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        raise ImageError(f"image {ref.key} in {loc.url} hashes to {digest}, not {ref.sha256}")
    return data


def image_uri(loc: Location, ref: ImageRef) -> str:
    """The full URL of ref's stored object (what exports point at)."""
    return loc.uri(ref.key)


def stored_image_keys(loc: Location) -> set[str]:
    """The keys (`images/<name>`) of every image in loc, from one listing of its images/
    folder (empty when there is none)."""
    try:
        names = loc.fs.ls(loc.path(IMAGES_PREFIX), detail=False)
    except FileNotFoundError:
        return set()
    except OSError as exc:
        raise StorageError(f"could not list the images in {loc.url}: {exc}") from exc
    return {f"{IMAGES_PREFIX}/{str(n).rstrip('/').rpartition('/')[2]}" for n in names}

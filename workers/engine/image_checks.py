"""The image side of an image item's request and of accepting its result.

The request carries one placeholder id per image and the images as `data:` URIs, in prompt
order. The result is accepted only if the served prompt ids are the request ids with the i-th
placeholder repeated c_i >= 1 times, `meta_info.prompt_tokens` is their count, and each image
expands to the same count as on every other server of the run (`run_image_tokens`); anything
else is token drift (sglang.md, "Images on /generate": the re-tokenize fallback, another
processor or image setting), which the caller refuses and pauses the server for.
"""

from __future__ import annotations

import threading

from sqlalchemy import Engine

from app.core.contracts import GenerateResult
from app.core.errors import PermanentError
from app.core.images import ImageDrift, ImagePins, placeholder_count, served_counts
from app.ledger import claims, image_tokens
from app.storage.image_store import ImageError
from app.storage.run_store import StorageUnreachable
from workers.engine.image_data import ImageData
from workers.engine.run_stores import RunStores


class ImageChecks:
    """Per worker: each run's image pins (read once), the images' agreed counts (each
    confirmed against the ledger once), and the images' data through the worker's cache."""

    def __init__(
        self, db: Engine, server_name: str, data: ImageData, stores: RunStores | None = None
    ) -> None:
        self._db = db
        self._server = server_name
        self._data = data
        # each run's pinned storage (None: every run's images are read from data's store)
        self._stores = stores
        self._lock = threading.Lock()
        self._pins: dict[int, ImagePins] = {}
        self._agreed: dict[tuple[int, str], image_tokens.ImageCount] = {}

    @property
    def data(self) -> ImageData:
        """Where the images' data URIs come from (the worker's cache of them)."""
        return self._data

    def pins(self, run_id: int) -> ImagePins | None:
        """The run's image pins (its placeholder id), read once per run that has them; a run
        without them is read again when asked (a later enqueue may bring its first image)."""
        with self._lock:
            cached = self._pins.get(run_id)
        if cached is not None:
            return cached
        with self._db.connect() as conn:
            pins = image_tokens.run_image_pins(conn, run_id)
        if pins is not None:
            with self._lock:
                self._pins[run_id] = pins
        return pins

    def image_data(self, item: claims.ClaimedItem) -> list[str]:
        """The `image_data` of item's request. PermanentError (the item's failure, not the
        server's) when its prompt does not hold one placeholder per image, or an image is
        missing from the store or changed there."""
        pins = self.pins(item.run_id)
        if pins is None:
            raise PermanentError(
                f"the item has {len(item.images)} image(s) but its run pins no image "
                "placeholder (runs.images is empty)"
            )
        found = placeholder_count(item.prompt_ids, pins.placeholder_id)
        if found != len(item.images):
            raise PermanentError(
                f"the prompt holds {found} {pins.placeholder} placeholder(s) (id "
                f"{pins.placeholder_id}) for {len(item.images)} image(s)"
            )
        store = None
        if self._stores is not None:
            if not self._stores.reaches(item.run_id):
                raise StorageUnreachable(
                    f"this worker does not reach the storage of run {item.run_id}'s images"
                )
            store = self._stores.location(item.run_id)
        try:
            return self._data.uris(item.images, store)
        except ImageError as exc:
            raise PermanentError(str(exc)) from exc

    def reaches(self, run_id: int) -> bool:
        """Whether this worker reads the run's images (RunStores.reaches; no stores: yes)."""
        return self._stores is None or self._stores.reaches(run_id)

    def accept(self, item: claims.ClaimedItem, result: GenerateResult) -> tuple[int, ...]:
        """How many times the server repeated each image's placeholder; ImageDrift (naming
        the first difference) when the result is anything but the request expanded."""
        pins = self.pins(item.run_id)
        if pins is None:  # image_data refused to send it; a hedge of it is refused as well
            raise ImageDrift("the run pins no image placeholder")
        served = result.prompt_token_ids
        if served is None:
            raise ImageDrift("the server sent no prompt_token_ids (return_prompt_token_ids)")
        counts = served_counts(item.prompt_ids, served, pins.placeholder_id)
        if result.prompt_tokens != len(served):
            raise ImageDrift(
                f"meta_info.prompt_tokens is {result.prompt_tokens}, but {len(served)} prompt "
                "ids were served"
            )
        by_image: dict[str, int] = {}
        for ref, count in zip(item.images, counts, strict=True):
            first = by_image.setdefault(ref.sha256, count)
            if first != count:
                raise ImageDrift(
                    f"image {ref.sha256[:12]} expands to {first} and to {count} tokens in one "
                    "prompt"
                )
        self._agree(item.run_id, by_image)
        return tuple(counts)

    def _agree(self, run_id: int, by_image: dict[str, int]) -> None:
        """Each image's count against the run's (the first server's, recorded if none)."""
        with self._lock:
            known = {sha: self._agreed.get((run_id, sha)) for sha in by_image}
        unknown = {sha: by_image[sha] for sha, agreed in known.items() if agreed is None}
        if unknown:
            with self._db.begin() as conn:
                recorded = image_tokens.note_image_tokens(conn, run_id, unknown, self._server)
            with self._lock:
                for sha, row in recorded.items():
                    self._agreed[(run_id, sha)] = known[sha] = row
        for sha, count in by_image.items():
            agreed = known[sha]
            assert agreed is not None  # note_image_tokens returns a row for every image given
            if agreed.token_count != count:
                raise ImageDrift(
                    f"image {sha[:12]} expands to {count} tokens here, {agreed.token_count} "
                    f"on {agreed.server}"
                )

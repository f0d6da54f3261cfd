"""What a run pins about its images, as the workers check results by it: the run's image pins
(placeholder id), the token count each image expands to on every server of the run, and the
image settings of the first server that reads images, joined to the run's fingerprint."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select, update
from sqlalchemy.dialects import postgresql, sqlite

from app.core.images import ImagePins
from app.core.models import run_image_tokens
from app.ledger import common


@dataclass(frozen=True)
class ImageCount:
    """The count an image of a run expands to, and the server that first expanded it."""

    token_count: int
    server: str


def run_image_pins(conn: Connection, run_id: int) -> ImagePins | None:
    """The run's image pins (`runs.images`); None for a text-only run."""
    value = conn.execute(
        select(common.runs.c.images).where(common.runs.c.id == run_id)
    ).scalar_one_or_none()
    return None if value is None else ImagePins.from_json(value)


def pin_run_images(conn: Connection, run_id: int, pins: ImagePins) -> ImagePins:
    """Pin pins as the run's image placeholder unless it holds one; returns what it holds."""
    conn.execute(
        update(common.runs)
        .where(common.runs.c.id == run_id, common.runs.c.images.is_(None))
        .values(images=pins.to_json())
    )
    held = run_image_pins(conn, run_id)
    assert held is not None
    return held


def _insert_first(conn: Connection) -> Any:
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(run_image_tokens).on_conflict_do_nothing(
        index_elements=["run_id", "sha256"]
    )


def note_image_tokens(
    conn: Connection, run_id: int, counts: Mapping[str, int], server: str
) -> dict[str, ImageCount]:
    """Record the count each image (sha256 → count) expanded to on server, unless the run
    already has one for it (the first server's count stays); return the run's count of each,
    which the caller compares with its own."""
    if not counts:
        return {}
    conn.execute(
        _insert_first(conn),
        [
            {"run_id": run_id, "sha256": sha, "token_count": count, "server": server}
            for sha, count in sorted(counts.items())
        ],
    )
    stmt = select(
        run_image_tokens.c.sha256, run_image_tokens.c.token_count, run_image_tokens.c.server
    ).where(run_image_tokens.c.run_id == run_id, run_image_tokens.c.sha256.in_(sorted(counts)))
    rows = conn.execute(stmt)
    return {str(r.sha256): ImageCount(int(r.token_count), str(r.server)) for r in rows}


def pin_image_settings(conn: Connection, run_id: int, images: dict[str, Any]) -> dict[str, Any]:
    """Join these image settings to the run's pinned fingerprint if it has none yet (it was
    pinned by a server that reads no images); return the pinned fingerprint."""
    read = select(common.runs.c.fingerprint).where(common.runs.c.id == run_id)
    if conn.dialect.name == "postgresql":
        # the run's row locked until commit: of two servers racing, the second sees the first's
        read = read.with_for_update()
    row = conn.execute(read).scalar_one()
    pinned = dict(row or {})
    if row is None or "images" in pinned:
        return pinned
    pinned["images"] = images
    conn.execute(update(common.runs).where(common.runs.c.id == run_id).values(fingerprint=pinned))
    return pinned

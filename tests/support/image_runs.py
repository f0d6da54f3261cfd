"""A finished multimodal run built straight in the ledger, for the export and verify tests.

Fixture images are drawn with Pillow at test time and put into a tmp image store with
put_image; the run pins Kimi-K2.5's placeholder (163605), each image item's prompt holds one
placeholder per image, and its image_token_counts and server prompt_tokens are written as a
done result would leave them. One text item sits in the same run.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import pytest
from PIL import Image
from sqlalchemy import Engine, update

from app.core.contracts import GenerateResult
from app.core.images import FAMILIES, ImagePins, ImageRef
from app.ledger import common, queue, run_queries
from app.ledger import outcomes as ledger_outcomes
from app.storage.image_store import put_image
from app.storage.shards import Location, open_location
from tests.support.done_runs import EOS
from tests.support.done_runs import spec as done_run_spec

PAD = 163605  # <|media_pad|>
BEGIN, CONTENT, END = 163602, 163603, 163604
PINS = ImagePins("kimi", FAMILIES["kimi"][0], PAD, FAMILIES["kimi"][1])


def image_bytes(color: str, size: tuple[int, int], fmt: str) -> bytes:
    """An image of one colour with a stripe (so no two fixtures share bytes)."""
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 7):
        image.putpixel((x, size[1] // 2), (x % 256, 0, 255 - x % 256))
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def image_span() -> list[int]:
    """The ids the template renders for one image (one placeholder)."""
    return [BEGIN, 1000, CONTENT, PAD, END]


def image_part(ref: ImageRef) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": ref.key}}


@dataclass
class ImageRun:
    run: run_queries.RunInfo
    store: Location
    refs: list[ImageRef]
    # item key -> (prompt ids as sent, image refs, counts, output ids)
    items: dict[str, tuple[list[int], list[ImageRef], list[int] | None, list[int]]]


def make_image_run(db: Engine, tmp_path: Path, name: str) -> ImageRun:
    """Items: "one" (an image), "two" (two images, the first repeated from "one"), "tool" (an
    image in a tool result), "text" (no image)."""
    store = open_location(str(tmp_path / "store"))
    refs = [
        put_image(store, image_bytes("red", (640, 480), "PNG"), "a.png"),
        put_image(store, image_bytes("blue", (300, 200), "JPEG"), "b.jpg"),
        put_image(store, image_bytes("green", (64, 64), "PNG"), "data:"),
    ]
    a, b, c = refs
    head = [163587, 500]
    rows: dict[str, tuple[list[int], list[ImageRef], list[int] | None, list[dict[str, object]]]]
    rows = {
        "one": (
            [*head, *image_span(), 501, 502],
            [a],
            [414],
            [{"role": "user", "content": [image_part(a), {"type": "text", "text": "what?"}]}],
        ),
        "two": (
            [*head, *image_span(), 503, *image_span(), 504],
            [a, b],
            [414, 88],
            [
                {
                    "role": "user",
                    "content": [image_part(a), {"type": "text", "text": "and"}, image_part(b)],
                }
            ],
        ),
        "tool": (
            [*head, 505, *image_span(), 506],
            [c],
            [4],
            [
                {"role": "user", "content": "look"},
                {"role": "tool", "tool_call_id": "t1", "content": [image_part(c)]},
            ],
        ),
        "text": ([*head, 507, 508], [], None, [{"role": "user", "content": "plain"}]),
    }
    spec = replace(done_run_spec(name), samples_per_prompt=1, chat_template_kwargs={})
    with db.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec)
        conn.execute(
            update(common.runs).where(common.runs.c.id == run.id).values(images=PINS.to_json())
        )
        queue.insert_items(
            conn,
            run.id,
            [
                queue.NewItem(key, 0, n + 1, messages, prompt)
                for n, (key, (prompt, _, _, messages)) in enumerate(rows.items())
            ],
        )
        for key, (_, item_refs, _, _) in rows.items():
            if item_refs:
                conn.execute(
                    update(common.items)
                    .where(common.items.c.run_id == run.id, common.items.c.item_key == key)
                    .values(images=[r.to_json() for r in item_refs])
                )
        ids = queue.pending_ids(conn, run.id, limit=100)  # in id order: the order of rows
    built: dict[str, tuple[list[int], list[ImageRef], list[int] | None, list[int]]] = {}
    outcomes: list[ledger_outcomes.Outcome] = []
    for n, (item_id, (key, (prompt, item_refs, counts, _))) in enumerate(
        zip(ids, rows.items(), strict=True)
    ):
        output = [600 + n, 601 + n, EOS]
        built[key] = (prompt, item_refs, counts, output)
        result = GenerateResult(
            rid=f"r{item_id}",
            output_ids=output,
            finish_reason="stop",
            matched_stop=EOS,
            prompt_tokens=built_prompt_tokens(built[key]),
            completion_tokens=len(output),
            cached_tokens=0,
            e2e_latency_s=0.5,
        )
        outcomes.append(ledger_outcomes.Done(item_id, result))
    with db.begin() as conn:
        ledger_outcomes.record_outcomes(conn, outcomes, owner="t", lease_s=60)
        for item_id, (key, (_, _, counts, _)) in zip(ids, rows.items(), strict=True):
            conn.execute(
                update(common.items)
                .where(common.items.c.id == item_id)
                .values(image_token_counts=counts, prompt_tokens=built_prompt_tokens(built[key]))
            )
        run = run_queries.get_run_by_id(conn, run.id)
    return ImageRun(run=run, store=store, refs=refs, items=built)


def built_prompt_tokens(
    entry: tuple[list[int], list[ImageRef], list[int] | None, list[int]],
) -> int:
    prompt, _, counts, _ = entry
    return len(prompt) + sum(c - 1 for c in counts or [])


def served(prompt: list[int], counts: list[int] | None) -> list[int]:
    """The served prompt, built here independently of app.core.images: each placeholder in
    turn replaced by counts[i] copies of itself."""
    out: list[int] = []
    pending = list(counts or [])
    for token in prompt:
        out.extend([token] * (pending.pop(0) if token == PAD else 1))
    return out


def count_image_reads(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sha256 of every image `module` reads with get_image from now on, in order."""
    read: list[str] = []
    real = module.get_image

    def counted(loc: Location, ref: ImageRef) -> bytes:
        read.append(ref.sha256)
        data: bytes = real(loc, ref)
        return data

    monkeypatch.setattr(module, "get_image", counted)
    return read

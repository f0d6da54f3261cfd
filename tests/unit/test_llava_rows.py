"""Image rows as read_prompts reads them: LLaVA / ShareGPT4V markers made image parts at their
places, an `image` field that is only metadata left alone, and the refusals naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.core.contracts import PromptRecord
from app.core.errors import InputError
from app.prompts.inputs import read_prompts


def read_one(tmp_path: Path, row: dict[str, Any]) -> PromptRecord | InputError:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    [entry] = list(read_prompts(path, content_format="openai"))
    return entry


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_markers_become_image_parts_in_place(tmp_path: Path) -> None:
    record = read_one(
        tmp_path,
        {
            "images": ["a.jpg", "b.jpg", "c.jpg"],
            "conversations": [
                {"from": "human", "value": "<image><image>\nCompare."},
                {"from": "gpt", "value": "They differ."},
                {"from": "human", "value": "And <image>"},
            ],
        },
    )
    assert isinstance(record, PromptRecord) and record.messages is not None
    assert [turn["content"] for turn in record.messages if turn["role"] == "user"] == [
        [image("a.jpg"), image("b.jpg"), {"type": "text", "text": "\nCompare."}],
        [{"type": "text", "text": "And "}, image("c.jpg")],
    ]
    assert record.metadata is None  # "images" is the prompt's, not metadata


def test_an_image_field_beside_messages_without_markers_is_metadata(tmp_path: Path) -> None:
    record = read_one(
        tmp_path, {"image": "thumb.png", "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert isinstance(record, PromptRecord)
    assert record.metadata == {"image": "thumb.png"}
    assert record.messages == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        (
            {"image": "a.jpg", "conversations": [{"from": "human", "value": "no marker"}]},
            "'conversations' has 0 <image> marker(s) but 'image' gives 1 image(s)",
        ),
        (
            {"images": "a.jpg", "conversations": [{"from": "human", "value": "<image>"}]},
            "'images' must be a list of strings, not a JSON string",
        ),
        (
            {
                "image": "a.jpg",
                "images": ["a.jpg"],
                "conversations": [{"from": "human", "value": "<image>"}],
            },
            "both 'image' and 'images' beside the turns",
        ),
        (
            {"images": [""], "conversations": [{"from": "human", "value": "<image>"}]},
            "'images'[0] must be a non-empty string (an image reference)",
        ),
        (
            {
                "image": "a.jpg",
                "conversations": [
                    {"from": "human", "value": "hi"},
                    {"from": "gpt", "value": "<image> here"},
                    {"from": "human", "value": "ok"},
                ],
            },
            "conversations[1].value[0] is an image part in an assistant turn",
        ),
    ],
)
def test_bad_llava_rows_name_the_field(tmp_path: Path, row: dict[str, Any], reason: str) -> None:
    error = read_one(tmp_path, row)
    assert isinstance(error, InputError) and error.reason.startswith(reason)

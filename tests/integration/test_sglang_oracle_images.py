"""Image rows enqueued by tokenmill (into Postgres, images into the local store) against SGLang
0.5.23's own /v1/tokenize of a multimodal model, run from its wheel with the GPU stack stubbed
(tests.support.sglang_server, under transformers 5.19.0): every stored prompt, boundary samples
with images in history and tool results included, is the ids SGLang renders for the same turns
with the images as data URIs, and holds one `<|media_pad|>` per image."""

from __future__ import annotations

import base64
import copy
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.core.contracts import SamplingParams
from app.core.errors import InputError
from app.core.settings import get_settings
from app.ledger import reads, run_queries
from app.prompts.template_reading import template_may_reorder_tool_results
from app.prompts.tokenization import load_tokenizer
from tests.support.oracle_families import FAMILIES, family_folder
from tests.support.sglang_chat_path import template_utils
from tests.support.sglang_server import tokenize_as_deployed
from workers.intake.producer import EnqueueOptions, enqueue

MEDIA_PAD = 163605


def png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": '{"page": 1}'}},
    {"id": "c2", "type": "function", "function": {"name": "shot", "arguments": '{"page": 2}'}},
]
ROWS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": [text("What is this?"), image("a.png")]}]},
    {"messages": [{"role": "user", "content": [image("a.png"), text("vs"), image("b.png")]}]},
    {
        "messages": [
            {"role": "system", "content": "You see images."},
            {"role": "user", "content": [image("a.png"), text("Colour?")]},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": [text("And"), image("b.png")]},
            {"role": "assistant", "content": "Blue."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Screenshot both pages."},
            {"role": "assistant", "content": None, "tool_calls": CALLS},
            {"role": "tool", "tool_call_id": "c1", "content": [text("page 1"), image("a.png")]},
            {"role": "tool", "tool_call_id": "c2", "content": [image("b.png")]},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": [text("Again:"), image("a.png")]},
        ]
    },
]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("TOKENMILL_STORAGE_URL", str(tmp_path / "store"))
    get_settings.cache_clear()
    yield tmp_path / "store"
    get_settings.cache_clear()


def as_sent(turns: list[dict[str, Any]], uris: dict[str, str]) -> list[dict[str, Any]]:
    """The turns with each image reference replaced by its data URI (what a client sends)."""
    out = copy.deepcopy(turns)
    for turn in out:
        for part in turn["content"] if isinstance(turn["content"], list) else []:
            if part["type"] == "image_url":
                part["image_url"]["url"] = uris[part["image_url"]["url"]]
    return out


def test_every_image_boundary_is_sglangs(
    pg_engine: Engine, kimi_tokenizer_dir: Path, tmp_path: Path, store: Path
) -> None:
    images = {"a.png": png(40, 30, (200, 0, 0)), "b.png": png(20, 50, (0, 0, 200))}
    uris = {}
    for name, data in images.items():
        (tmp_path / name).write_bytes(data)
        uris[name] = "data:image/png;base64," + base64.b64encode(data).decode()
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"r{i}", **row}) + "\n" for i, row in enumerate(ROWS))
    )
    tokenizer = load_tokenizer(kimi_tokenizer_dir)
    options = EnqueueOptions(path, "oracle-img", SamplingParams(max_new_tokens=8), turns="each")
    errors: list[Any] = []
    enqueue(pg_engine, tokenizer, options, publish=None, on_error=errors.append)
    assert errors == []
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "oracle-img")
        stored = reads.stored_prompts(conn, reads.prompt_item_ids(conn, run.id))
    # each boundary's turns as the row gave them: its prefix of the row's turns
    by_key = {f"r{i}": row["messages"] for i, row in enumerate(ROWS)}
    bodies = [
        {"messages": as_sent(by_key[item.item_key][: len(item.messages or [])], uris)}
        for item in stored
    ]
    expected = tokenize_as_deployed(kimi_tokenizer_dir, bodies, multimodal=True)
    assert len(stored) == 7  # 1 + 1 + 2 + 3 boundaries
    for item, ids in zip(stored, expected, strict=True):
        assert not isinstance(ids, str), f"SGLang refused item {item.item_key}: {ids}"
        assert item.prompt_ids == ids, item.item_key
        assert ids.count(MEDIA_PAD) == sum(
            1
            for turn in item.messages or []
            if isinstance(turn["content"], list)
            for part in turn["content"]
            if part["type"] == "image_url"
        )


def test_tool_results_with_images_out_of_call_order_are_reordered_by_sglang_refused_here(
    pg_engine: Engine, kimi_tokenizer_dir: Path, tmp_path: Path, store: Path
) -> None:
    (tmp_path / "a.png").write_bytes(png(8, 8, (1, 1, 1)))
    uri = "data:image/png;base64," + base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    in_order = copy.deepcopy(ROWS[3]["messages"][:4])
    swapped = [*in_order[:2], in_order[3], in_order[2]]
    uris = {"a.png": uri, "b.png": uri}
    sent = [{"messages": as_sent(turns, uris)} for turns in (in_order, swapped)]
    ordered_ids, swapped_ids = tokenize_as_deployed(kimi_tokenizer_dir, sent, multimodal=True)
    assert ordered_ids == swapped_ids  # SGLang renders the results in the calls' order
    path = tmp_path / "swapped.jsonl"
    path.write_text(json.dumps({"messages": swapped}) + "\n")
    errors: list[Any] = []
    options = EnqueueOptions(path, "swapped", SamplingParams(max_new_tokens=8))
    with pytest.raises(InputError, match="no prompt of"):
        enqueue(
            pg_engine,
            load_tokenizer(kimi_tokenizer_dir),
            options,
            publish=None,
            on_error=errors.append,
        )
    assert "answer its calls out of order" in str(errors[0])


@pytest.mark.parametrize("family", sorted(f for f, t in FAMILIES.items() if isinstance(t, str)))
def test_which_templates_reorder_tool_results_is_sglangs(family: str) -> None:
    """tokenmill refuses out-of-order image tool results exactly for the templates SGLang
    reorders them for (its jinja_template_may_reorder_tool_results, from the wheel)."""
    template = FAMILIES[family]
    expected = template_utils().jinja_template_may_reorder_tool_results(template)
    assert template_may_reorder_tool_results(template) == expected
    probe = "{% for m in messages %}{{ m.tool_call_id }}{% endfor %}"
    assert template_may_reorder_tool_results(probe) is True
    assert template_utils().jinja_template_may_reorder_tool_results(probe) is True


def test_out_of_order_image_results_are_taken_where_sglang_keeps_the_order(
    pg_engine: Engine, kimi_tokenizer_dir: Path, tmp_path: Path, store: Path
) -> None:
    """A template that never reads tool_call_id (Qwen-VL's fixture): SGLang renders the tool
    results in message order, so the swapped row is stored, equal to SGLang's ids."""
    folder = family_folder("qwen3-vl", kimi_tokenizer_dir, tmp_path / "qwen-vl")
    assert not template_utils().jinja_template_may_reorder_tool_results(FAMILIES["qwen3-vl"])
    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes(png(8, 8, (1, 1, 1)))
    uri = "data:image/png;base64," + base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    in_order = copy.deepcopy(ROWS[3]["messages"][:4])
    swapped = [*in_order[:2], in_order[3], in_order[2]]
    (expected,) = tokenize_as_deployed(
        folder, [{"messages": as_sent(swapped, {"a.png": uri, "b.png": uri})}], multimodal=True
    )
    path = tmp_path / "swapped.jsonl"
    path.write_text(json.dumps({"id": "s", "messages": swapped}) + "\n")
    options = EnqueueOptions(path, "swapped-vl", SamplingParams(max_new_tokens=8))
    report = enqueue(pg_engine, load_tokenizer(folder), options, publish=None)
    assert not report.errors, report.errors
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "swapped-vl")
        (item,) = list(reads.iter_items(conn, run.id, statuses=("pending",)))
    assert item.prompt_ids == expected

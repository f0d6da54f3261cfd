"""The enqueue's image stage on its own: sources resolved (relative to the image root, file://,
data: URIs, fsspec URLs), each distinct one read and stored once, errors naming the part, and
the placeholder pins a tokenizer folder names. Fixture images are made here with Pillow."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import fsspec
import pytest

from app.core.contracts import PromptRecord
from app.core.errors import InputError
from app.core.images import ImagePins
from app.prompts.chat_path import normalize_messages, tool_result_order_error
from app.prompts.image_pins import check_image_prompt, placeholder_id_of, read_image_pins
from app.storage.shards import open_location
from workers.intake.images import (
    ImageResolver,
    ImageSources,
    ImageUnreadable,
    StoredImages,
    data_uri_bytes,
    images_of,
)

KIMI = ImagePins("kimi", "<|media_pad|>", 163605, "x")


def png(width: int = 8, height: int = 6) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(out, format="PNG")
    return out.getvalue()


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def sources(tmp_path: Path) -> ImageSources:
    store = open_location(str(tmp_path / "store"))
    return ImageSources(lambda: store, tmp_path / "root")


def test_each_distinct_source_is_read_once_and_stored_once(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    data = png()
    (tmp_path / "root" / "a.png").write_bytes(data)
    images = sources(tmp_path)
    absolute = str(tmp_path / "root" / "a.png")
    refs = [images.ref(s) for s in ("a.png", "a.png", absolute, Path(absolute).as_uri())]
    # a relative path and its absolute and file:// spellings are one resolved source
    assert images.reads == 1
    assert {r.key for r in refs} == {refs[0].key}
    assert [r.source for r in refs] == ["a.png", "a.png", absolute, Path(absolute).as_uri()]
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    assert images.ref(uri).source == "data:" and images.ref(uri).key == refs[0].key
    assert images.reads == 2
    assert [p.name for p in (tmp_path / "store" / "images").iterdir()] == [
        refs[0].key.split("/")[-1]
    ]


def test_fsspec_urls_are_read_with_fsspec(tmp_path: Path) -> None:
    with fsspec.open("memory://bucket/cat.png", "wb") as stream:
        stream.write(png(20, 10))
    ref = sources(tmp_path).ref("memory://bucket/cat.png")
    assert (ref.width, ref.height, ref.format) == (20, 10, "PNG")
    with pytest.raises(ImageUnreadable, match=r"memory://bucket/dog\.png' cannot be read: No such"):
        sources(tmp_path).ref("memory://bucket/dog.png")


def test_bad_sources_say_why(tmp_path: Path) -> None:
    images = sources(tmp_path)
    with pytest.raises(ImageUnreadable, match=r"'missing\.png' cannot be read: No such file"):
        images.ref("missing.png")
    with pytest.raises(ImageUnreadable, match="base64 does not decode"):
        images.ref("data:image/png;base64,@@@")
    with pytest.raises(ImageUnreadable, match="is not a usable image: the bytes are not an image"):
        images.ref("data:text/plain,hello")
    assert data_uri_bytes("data:,a%20b") == b"a b"
    assert (images.reads, images.refused, images.bytes_read) == (0, 3, 0)  # none stored
    with pytest.raises(ImageUnreadable):  # an outcome is cached, errors too
        images.ref("missing.png")
    assert (images.reads, images.refused) == (0, 3)


def test_the_resolver_names_the_part_and_points_parts_at_the_store(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "a.png").write_bytes(png())
    turns = normalize_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "x"}, image("a.png")]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [image("a.png"), image("gone.png")]},
        ],
        "openai",
    )
    record = PromptRecord(3, "k", messages=turns, prompt_fields=("conversations",))
    resolver = ImageResolver(sources(tmp_path))
    error = resolver.resolve(record)
    assert isinstance(error, InputError)
    assert str(error) == (
        "line 3: conversations[2].content[1]: image 'gone.png' cannot be read: "
        "No such file or directory"
    )
    good = PromptRecord(4, "k", messages=turns[:2], prompt_fields=("messages",))
    resolved = resolver.resolve(good)
    assert isinstance(resolved, PromptRecord)
    key = resolved.images[0].key
    assert resolved.messages is not None and resolved.messages[0]["content"][1] == image(key)
    assert images_of(resolved.messages[:1], resolved) == list(resolved.images)
    # the image part's reference as StoredImages sends it to a server
    sent = StoredImages(lambda: open_location(str(tmp_path / "store"))).for_server(
        resolved.messages
    )
    url = sent[0]["content"][1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == (tmp_path / "root" / "a.png").read_bytes()


def test_image_spellings_normalize_to_one_image_url_part() -> None:
    turns = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "a.png"},
                {"type": "input_image", "image_url": "b.png"},
                {"type": "image_url", "image_url": {"url": "c.png", "detail": "low"}},
            ],
        }
    ]
    assert normalize_messages(turns, "openai")[0]["content"] == [
        image("a.png"),
        image("b.png"),
        image("c.png"),
    ]


def test_tool_results_with_images_out_of_call_order_are_refused() -> None:
    calls = [
        {"id": i, "type": "function", "function": {"name": "f", "arguments": {}}}
        for i in ("c1", "c2")
    ]
    turns = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c2", "content": [image("b.png")]},
        {"role": "tool", "tool_call_id": "c1", "content": "text"},
    ]
    found = tool_result_order_error(turns)
    assert found is not None and found[0] == 2
    assert found[1].startswith("messages[2]: the tool results after messages[1]")
    assert tool_result_order_error(turns[:2] + turns[3:] + turns[2:3]) is None  # in call order
    text_only = [*turns[:2], {**turns[2], "content": "t"}, turns[3]]
    assert tool_result_order_error(text_only) is None  # SGLang reorders no text-only run


def test_placeholder_ids_are_read_from_config_or_processor_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    assert placeholder_id_of(tmp_path) is None
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_token_id": 151655}))
    assert placeholder_id_of(tmp_path) == (151655, "processor_config.json image_token_id")
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"image_token_id": 7}}))
    assert placeholder_id_of(tmp_path) == (7, "config.json text_config image_token_id")

    class Vocab:
        def convert_ids_to_tokens(self, token_id: int) -> str:
            return {7: "<|image_pad|>"}.get(token_id, "hello")

    pins = read_image_pins(tmp_path, Vocab())
    assert isinstance(pins, ImagePins) and (pins.family, pins.placeholder_id) == ("qwen", 7)
    # a folder whose id is no known family's placeholder still loads: image rows say why not
    (tmp_path / "config.json").write_text(json.dumps({"media_placeholder_token_id": 3}))
    reason = read_image_pins(tmp_path, Vocab())
    assert isinstance(reason, str) and "which is the token 'hello', not the placeholder" in reason
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "processor_config.json").unlink()
    reason = read_image_pins(tmp_path, Vocab())
    assert isinstance(reason, str) and "names no image placeholder id" in reason


def test_a_prompt_holds_one_placeholder_per_image_none_adjacent() -> None:
    check_image_prompt([1, 163605, 2, 163605, 3], 2, KIMI)
    with pytest.raises(InputError, match=r"has 2 image\(s\) but its ids hold 1 <\|media_pad\|>"):
        check_image_prompt([1, 163605, 2], 2, KIMI)
    with pytest.raises(
        InputError, match=r"two adjacent <\|media_pad\|> placeholders \(positions 1"
    ):
        check_image_prompt([1, 163605, 163605, 2], 2, KIMI)

"""Image parts through the chat path against SGLang 0.5.23's own functions, run from its wheel
(tests.support.sglang_chat_path): the turns the template gets (each image `{"type": "image"}`,
a tool result holding one kept as a list) and the images collected, in SGLang's order; for a
"string" template SGLang drops the images, which tokenmill refuses."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from app.core.errors import InputError
from app.prompts.chat_path import image_urls, normalize_messages, template_view
from app.prompts.template_reading import detect_content_format
from app.prompts.tokenization import load_tokenizer
from emulator.fixtures.kimi import CHAT_TEMPLATE
from tests.support import sglang_chat_path as sglang

DATA_URI = "data:image/png;base64,iVBORw0KGgo="


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


CASES: dict[str, list[dict[str, Any]]] = {
    "text around two images": [
        {"role": "user", "content": [text("Compare"), image("a.png"), text("and"), image("b")]}
    ],
    "detail and a data URI": [
        {"role": "user", "content": [image(DATA_URI, detail="high"), text("What is it?")]}
    ],
    "images in history": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image("s3://bucket/cat.jpg"), text("A cat?")]},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": [text("And this?"), image("file:///tmp/dog.png")]},
    ],
    "tool results with images": [
        {"role": "user", "content": "Take screenshots."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "shot", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [text("page 1"), image("p1.png")]},
        {"role": "tool", "tool_call_id": "c2", "content": [image("p2.png")]},
        {"role": "tool", "tool_call_id": "c2", "content": [text("only"), text("text")]},
    ],
}


@pytest.mark.parametrize("turns", list(CASES.values()), ids=list(CASES))
def test_openai_template_turns_and_images_match_sglang(turns: list[dict[str, Any]]) -> None:
    ours = normalize_messages(copy.deepcopy(turns), "openai")
    reference, collected = sglang.reference_messages_and_images(copy.deepcopy(turns), "openai")
    assert template_view(ours) == reference
    assert image_urls(ours) == collected
    assert collected  # every case sends images


def test_a_string_template_drops_images_in_sglang_and_tokenmill_refuses() -> None:
    turns = CASES["text around two images"]
    reference, collected = sglang.reference_messages_and_images(copy.deepcopy(turns), "string")
    # SGLang joins the text and neither renders nor collects the images
    assert (reference[0]["content"], collected) == ("Compare and", [])
    with pytest.raises(InputError) as caught:
        normalize_messages(copy.deepcopy(turns), "string")
    assert caught.value.reason.startswith("messages[0].content[1] is an image part, but the chat")


def test_the_kimi_fixture_template_is_openai_for_sglang_and_renders_its_turns(
    kimi_tokenizer_dir: Path,
) -> None:
    assert sglang.detect_content_format(CHAT_TEMPLATE) == "openai"
    assert detect_content_format(CHAT_TEMPLATE) == "openai"
    tokenizer = load_tokenizer(kimi_tokenizer_dir)
    turns = CASES["tool results with images"] + [
        {"role": "user", "content": [text("Which?"), image("x.png")]}
    ]
    reference = sglang.reference_messages(copy.deepcopy(turns), "openai")
    # the template run on SGLang's turns, by transformers directly
    expected = tokenizer.hf_tokenizer.apply_chat_template(
        reference, add_generation_prompt=True, tokenize=False
    )
    rendered = tokenizer.render(turns)
    assert rendered == expected
    image_text = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    assert rendered.count(image_text) == 3

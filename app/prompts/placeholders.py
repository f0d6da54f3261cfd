"""Image-placeholder tokens written as text: refused, since the server would read each as an
image slot (`<|media_pad|>` for Kimi, `<|image_pad|>` / `<|video_pad|>` for Qwen-VL, ...) with
no image part behind it. Images come as image parts, which the template renders."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.core.contracts import Message
from app.core.errors import InputError

# the placeholder tokens of the multimodal families SGLang serves; only those the tokenizer
# has as added tokens are checked
PLACEHOLDER_TOKENS = (
    "<|media_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_pad|>",
    "<|image|>",
    "<image>",
    "<|IMAGE_PLACEHOLDER|>",
    "<|begin_of_image|>",
)


def image_placeholders(tokenizer: Any) -> tuple[str, ...]:
    """The placeholder tokens this tokenizer has as added tokens."""
    added = tokenizer.get_added_vocab()
    return tuple(token for token in PLACEHOLDER_TOKENS if token in added)


def check_placeholders(
    placeholders: Sequence[str],
    turns: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None,
) -> None:
    """InputError naming the first turn (or the tools) whose text holds a placeholder token:
    no image part stands behind such text, so the server's images and placeholders would
    not pair up."""
    if not placeholders:
        return
    for index, turn in enumerate(turns):
        found = _found(placeholders, turn)
        if found:
            raise InputError(
                f"messages[{index}] holds the image placeholder token {found} as text; no "
                "image stands behind it (give an image as an image part: the template "
                "renders its placeholder)"
            )
    found = _found(placeholders, tools)
    if found:
        raise InputError(
            f"the tools hold the image placeholder token {found} as text; no image stands behind it"
        )


def _found(placeholders: Sequence[str], value: Any) -> str | None:
    if isinstance(value, str):
        return next((token for token in placeholders if token in value), None)
    if isinstance(value, dict):
        if value.get("type") == "image_url":  # an image part: its reference is no text
            return None
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            found = _found(placeholders, item)
            if found:
                return found
    return None

"""The image placeholder a tokenizer folder names, as the run pins it (ImagePins), and the check
every image prompt's ids must pass: one placeholder id per image, no two adjacent."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.core.errors import ConfigurationError, InputError
from app.core.images import FAMILIES, ImagePins, adjacent_placeholders, placeholder_count

# Where a folder names its placeholder id: config.json keys first (Kimi-K2.5's, then
# Qwen-VL's), then the processor configs (top level, or under a nested config).
PLACEHOLDER_KEYS = ("media_placeholder_token_id", "image_token_id")
CONFIG_FILES = ("config.json", "preprocessor_config.json", "processor_config.json")
_NESTED = ("text_config", "vision_config")


def placeholder_id_of(folder: Path) -> tuple[int, str] | None:
    """The placeholder id the folder's configs name, with where it was found; None if none."""
    for name in CONFIG_FILES:
        config = _read_json(Path(folder) / name)
        for scope, where in [(config, name)] + [
            (config.get(key), f"{name} {key}") for key in _NESTED
        ]:
            if not isinstance(scope, dict):
                continue
            for key in PLACEHOLDER_KEYS:
                value = scope.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    return value, f"{where} {key}"
    return None


def read_image_pins(folder: Path, tokenizer: Any) -> ImagePins | str:
    """The pins of a multimodal tokenizer folder, or why it has none (what an image row is
    refused with; a text row never asks).

    The id's token must be the placeholder of a family SGLang serves images for
    (app.core.images.FAMILIES): its template text for one image is what the run pins.
    """
    found = placeholder_id_of(folder)
    keys = " or ".join(PLACEHOLDER_KEYS)
    if found is None:
        return (
            f"the row has images, but the tokenizer folder {str(folder)!r} names no image "
            f"placeholder id ({keys} in {', '.join(CONFIG_FILES)}): it is not a multimodal "
            "model's"
        )
    placeholder_id, where = found
    try:
        token = tokenizer.convert_ids_to_tokens(placeholder_id)
    except Exception:  # an id past the vocabulary
        token = None
    for family, (placeholder, image_text) in FAMILIES.items():
        if token == placeholder:
            return ImagePins(family, placeholder, placeholder_id, image_text)
    known = ", ".join(f"{name} {placeholder}" for name, (placeholder, _) in FAMILIES.items())
    return (
        f"the row has images, but {where} of {str(folder)!r} names the image placeholder id "
        f"{placeholder_id}, which is the token {token!r}, not the placeholder of a model "
        f"family tokenmill knows ({known})"
    )


def check_image_prompt(ids: Sequence[int], images: int, pins: ImagePins) -> None:
    """InputError unless ids hold exactly one placeholder id per image and no two adjacent
    (the served expansions of adjacent placeholders could not be told apart)."""
    found = placeholder_count(ids, pins.placeholder_id)
    if found != images:
        raise InputError(
            f"the prompt has {images} image(s) but its ids hold {found} {pins.placeholder} "
            f"placeholder(s) (id {pins.placeholder_id}); the template must render each image "
            "as one placeholder"
        )
    position = adjacent_placeholders(ids, pins.placeholder_id)
    if position is not None:
        raise InputError(
            f"the prompt's ids hold two adjacent {pins.placeholder} placeholders (positions "
            f"{position - 1} and {position}); the template must keep images apart"
        )


def check_run_pins(pinned: ImagePins | None, pins: ImagePins | None, run: str) -> None:
    """ConfigurationError when the tokenizer's pins differ from the ones the run holds."""
    if pinned is None or pinned == pins:
        return
    have = "none" if pins is None else json.dumps(pins.to_json())
    raise ConfigurationError(
        f"run {run!r} pins the image placeholder {json.dumps(pinned.to_json())}, but this "
        f"tokenizer gives {have}; enqueue with the run's tokenizer, or into a new run"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}

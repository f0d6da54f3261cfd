"""How many tokens an image becomes on the emulated server, and the settings that decide it.

Kimi-K2.5's NaViT count and Qwen-VL's smart-resize count, as SGLang 0.5.23 computes them
(sglang.md, "Kimi-K2.5" and "Qwen2.5-VL / Qwen3-VL"), with the defaults of each model's
processor config, what the tokenizer folder says, and --mm-process-config on top.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.errors import TokenmillError

# the model_type and architectures /model_info reports per family
FAMILY_MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kimi": ("kimi_k25", ("KimiK25ForConditionalGeneration",)),
    "qwen": ("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",)),
}

# Kimi-K2.5's media_proc_cfg (its preprocessor_config.json)
KIMI_PATCH_SIZE = 14
KIMI_MERGE_KERNEL = 2
KIMI_IN_PATCH_LIMIT = 16384
KIMI_PATCH_LIMIT_ON_ONE_SIDE = 512
KIMI_PLACEHOLDER_ID = 163605  # <|media_pad|>, config.json media_placeholder_token_id

# Qwen2.5-VL: patch 14 merged 2x2, so sides are multiples of 28; its preprocessor_config.json
QWEN_FACTOR = 28
QWEN_MIN_PIXELS = 3136
QWEN_MAX_PIXELS = 12845056
QWEN_MAX_RATIO = 200

# the --mm-process-config "image" keys each family's count reads
IMAGE_KEYS: dict[str, tuple[str, ...]] = {
    "kimi": ("in_patch_limit", "patch_limit_on_one_side"),
    "qwen": ("min_pixels", "max_pixels"),
}
SECTIONS = ("image", "video", "audio")


def kimi_token_count(
    width: int,
    height: int,
    *,
    patch_size: int = KIMI_PATCH_SIZE,
    merge_kernel: int = KIMI_MERGE_KERNEL,
    in_patch_limit: int = KIMI_IN_PATCH_LIMIT,
    patch_limit_on_one_side: int = KIMI_PATCH_LIMIT_ON_ONE_SIDE,
) -> int:
    """Kimi's NaViT count: scale into the patch budget and the per-side limit, pad each side
    up to a whole merged patch, one token per merged patch."""
    patches = max(1, width // patch_size) * max(1, height // patch_size)
    side_limit = patch_limit_on_one_side * patch_size
    scale = min(1.0, math.sqrt(in_patch_limit / patches), side_limit / width, side_limit / height)
    new_width = min(max(1, int(width * scale)), side_limit)
    new_height = min(max(1, int(height * scale)), side_limit)
    factor = merge_kernel * patch_size
    return math.ceil(new_height / factor) * math.ceil(new_width / factor)


class AspectRatioError(TokenmillError, ValueError):
    """Qwen-VL refuses images more than 200 times longer than wide (or the other way)."""


def qwen_resize(
    height: int,
    width: int,
    *,
    min_pixels: int = QWEN_MIN_PIXELS,
    max_pixels: int = QWEN_MAX_PIXELS,
    factor: int = QWEN_FACTOR,
) -> tuple[int, int]:
    """Qwen-VL's smart resize: sides rounded to multiples of factor, then scaled into
    [min_pixels, max_pixels] keeping the aspect ratio."""
    ratio = max(height, width) / min(height, width)
    if ratio > QWEN_MAX_RATIO:
        raise AspectRatioError(
            f"absolute aspect ratio must be smaller than {QWEN_MAX_RATIO}, got {ratio}"
        )
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    if new_height * new_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


def qwen_token_count(
    width: int,
    height: int,
    *,
    min_pixels: int = QWEN_MIN_PIXELS,
    max_pixels: int = QWEN_MAX_PIXELS,
    factor: int = QWEN_FACTOR,
) -> int:
    """Tokens of one image: one per merged patch (patch_size x merge_size on a side: 28 for
    Qwen2.5-VL, 32 for Qwen3-VL and Qwen3.5) of the smart-resized image."""
    new_height, new_width = qwen_resize(
        height, width, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor
    )
    return (new_height // factor) * (new_width // factor)


def qwen_processor_limits(processor: Mapping[str, Any]) -> dict[str, int]:
    """The pixel bounds and merged-patch side of a Qwen-VL processor config: `patch_size` x
    `merge_size`, and `min_pixels` / `max_pixels`, or `size`'s `shortest_edge` / `longest_edge`
    (Qwen3-VL, Qwen3.5) or its `min_pixels` / `max_pixels`; VisionConfigError for a value it
    cannot count with."""
    size = processor.get("size")
    size = size if isinstance(size, dict) else {}
    values = {
        "patch_size": processor.get("patch_size", 14),
        "merge_size": processor.get("merge_size", 2),
        "min_pixels": processor.get(
            "min_pixels", size.get("min_pixels", size.get("shortest_edge", QWEN_MIN_PIXELS))
        ),
        "max_pixels": processor.get(
            "max_pixels", size.get("max_pixels", size.get("longest_edge", QWEN_MAX_PIXELS))
        ),
    }
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise VisionConfigError(
                f"--mm qwen: the processor config's {key} is {value!r}, not a positive integer "
                "this emulator can count image tokens with"
            )
    return {
        "min_pixels": values["min_pixels"],
        "max_pixels": values["max_pixels"],
        "factor": values["patch_size"] * values["merge_size"],
    }


def check_process_config(config: Mapping[str, Any], family: str | None) -> None:
    """SGLang's structure check of --mm-process-config (sections are objects), and the image
    keys the family's count reads: positive integers, no key it does not model."""
    for section in SECTIONS:
        if section in config and not isinstance(config[section], dict):
            raise ValueError(f"mm_process_config['{section}'] must be a dict")
    image = config.get("image") or {}
    if family is None:
        return
    known = IMAGE_KEYS[family]
    for key, value in image.items():
        if key not in known:
            raise ValueError(
                f"image key {key!r} is not one the {family} emulator models ({', '.join(known)})"
            )
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"image {key} must be a positive integer, got {value!r}")


class VisionConfigError(TokenmillError, ValueError):
    """The tokenizer folder cannot serve the --mm family (no placeholder id, bad JSON)."""


@dataclass(frozen=True)
class VisionSettings:
    """One server's image processing: the family, its token ids and what its count reads."""

    family: str
    placeholder_id: int
    placeholder: str
    # Kimi's media_proc_cfg, or Qwen's pixel bounds
    limits: dict[str, int]
    retokenize: bool = False

    def token_count(self, width: int, height: int) -> int:
        if self.family == "kimi":
            return kimi_token_count(width, height, **self.limits)
        return qwen_token_count(width, height, **self.limits)

    @property
    def fingerprint(self) -> bytes:
        """What an image's cache identity includes besides its bytes."""
        return json.dumps(
            {"family": self.family, **self.limits}, sort_keys=True, separators=(",", ":")
        ).encode()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise VisionConfigError(f"{path}: {exc}") from exc
    return value if isinstance(value, dict) else {}


def vision_settings(
    family: str,
    tokenizer_folder: str | None,
    process_config: Mapping[str, Any],
    retokenize: bool = False,
) -> VisionSettings:
    """The settings of --mm FAMILY: the placeholder id from the tokenizer folder's config.json
    (Kimi: media_placeholder_token_id; Qwen: image_token_id), the processor's limits from
    its preprocessor_config.json, then --mm-process-config's image keys over those."""
    config: dict[str, Any] = {}
    processor: dict[str, Any] = {}
    if tokenizer_folder is not None:
        config = _read_json(Path(tokenizer_folder) / "config.json")
        processor = _read_json(Path(tokenizer_folder) / "preprocessor_config.json")
    overrides = dict(process_config.get("image") or {})
    if family == "kimi":
        id_key, placeholder = "media_placeholder_token_id", "<|media_pad|>"
        media = processor.get("media_proc_cfg") or {}
        limits = {
            "in_patch_limit": int(media.get("in_patch_limit", KIMI_IN_PATCH_LIMIT)),
            "patch_limit_on_one_side": int(
                media.get("patch_limit_on_one_side", KIMI_PATCH_LIMIT_ON_ONE_SIDE)
            ),
        }
        default_id: int | None = KIMI_PLACEHOLDER_ID if tokenizer_folder is None else None
    else:
        id_key, placeholder = "image_token_id", "<|image_pad|>"
        limits = qwen_processor_limits(processor)
        default_id = None
    limits.update({key: int(value) for key, value in overrides.items()})
    if family == "qwen" and limits["min_pixels"] > limits["max_pixels"]:
        raise VisionConfigError(
            f"--mm qwen: min_pixels {limits['min_pixels']} is above max_pixels "
            f"{limits['max_pixels']}"
        )
    placeholder_id = config.get(id_key, default_id)
    if not isinstance(placeholder_id, int):
        raise VisionConfigError(
            f"--mm {family}: the tokenizer folder's config.json has no integer {id_key}"
        )
    return VisionSettings(family, placeholder_id, placeholder, limits, retokenize)

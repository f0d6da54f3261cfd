"""The emulator's `--mm qwen` counts follow the folder's processor config (patch_size,
merge_size, the pixel bounds in `size` or beside it), checked against transformers' own
smart_resize; a config it cannot count with is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from emulator.vision import VisionConfigError, vision_settings
from tests.support.vision_reference import qwen_reference_count

QWEN25_VL: dict[str, Any] = {
    "patch_size": 14,
    "merge_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
}
QWEN3_VL: dict[str, Any] = {
    "patch_size": 16,
    "merge_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


def _folder(tmp_path: Path, processor: dict[str, Any]) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": 7}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("processor", "factor", "bounds"),
    [(QWEN25_VL, 28, (3136, 12845056)), (QWEN3_VL, 32, (65536, 16777216))],
    ids=["qwen2.5-vl", "qwen3-vl"],
)
def test_counts_follow_the_processor_config(
    tmp_path: Path, processor: dict[str, Any], factor: int, bounds: tuple[int, int]
) -> None:
    settings = vision_settings("qwen", _folder(tmp_path, processor), {})
    for width, height in [(40, 30), (640, 480), (1000, 37), (3000, 4000)]:
        expected = qwen_reference_count(width, height, *bounds, factor=factor)
        assert settings.token_count(width, height) == expected, (width, height)
    if factor == 32:
        assert settings.token_count(40, 30) == 70  # SGLang's count on a Qwen3-VL folder


def test_a_config_it_cannot_count_with_is_refused(tmp_path: Path) -> None:
    with pytest.raises(VisionConfigError, match="patch_size"):
        vision_settings("qwen", _folder(tmp_path, {**QWEN3_VL, "patch_size": "16"}), {})

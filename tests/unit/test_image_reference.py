"""The image e2e tests' reference holds: the NaViT count written out from sglang.md equals
the SGLang wheel's own `navit_resize_config` and sglang.md's worked examples, the Qwen-VL count
the wheel's `smart_resize`, and the fixture
rows are what the tests say they are (60 lines, 3 refused, images of differing counts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.image_reference import (
    navit_tokens,
    qwen_tokens,
    wheel_navit_tokens,
    wheel_qwen_tokens,
)
from tests.support.image_rows import IMAGE_SIZES, build_image_rows


def test_sglang_md_examples() -> None:
    assert navit_tokens(640, 480) == 414
    assert navit_tokens(300, 200) == 88


@pytest.mark.parametrize("limit", [{}, {"in_patch_limit": 4096}, {"patch_limit_on_one_side": 64}])
def test_the_formula_is_the_wheels(limit: dict[str, int]) -> None:
    sizes = [(w, h) for w in (1, 13, 28, 29, 300, 1023, 2048, 7200) for h in (1, 27, 480, 1999)]
    sizes += [(w, h) for w, h, _ in IMAGE_SIZES.values()]
    for w, h in sizes:
        assert navit_tokens(w, h, **limit) == wheel_navit_tokens(w, h, **limit), (w, h, limit)


@pytest.mark.parametrize("pixels", [(3136, 12845056), (256 * 28 * 28, 1280 * 28 * 28)])
def test_the_qwen_count_is_the_wheels(pixels: tuple[int, int]) -> None:
    low, high = pixels
    sizes = [(w, h) for w in (28, 29, 300, 1023, 2048, 5000) for h in (28, 480, 1999, 4000)]
    for w, h in sizes:
        got = qwen_tokens(w, h, min_pixels=low, max_pixels=high)
        assert got == wheel_qwen_tokens(w, h, min_pixels=low, max_pixels=high), (w, h, pixels)


def test_the_rows(tmp_path: Path) -> None:
    rows = build_image_rows(tmp_path, use_image_root=True)
    lines = [json.loads(x) for x in rows.path.read_text().splitlines()]
    assert len(lines) == 60 and len(rows.expected) == 57
    assert [b.line for b in rows.bad] == [5, 30, 60]
    assert all(lines[b.line - 1]["id"].startswith("bad-") for b in rows.bad)
    counts = {navit_tokens(w, h) for w, h, _ in IMAGE_SIZES.values()}
    assert len(counts) == len(IMAGE_SIZES)  # every image expands to its own count
    text = rows.path.read_text()
    assert "data:image/" in text and "file://" in text and '"images"' in text
    assert '"tool_call_id"' in text and '"type": "image"' in text
    assert sum(1 for x in lines if "conversations" in x) == 12
    assert len(rows.distinct_images()) == len(IMAGE_SIZES)

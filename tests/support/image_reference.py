"""The expected served ids of an image prompt, computed without tokenmill: transformers'
`apply_chat_template` on the tokenizer folder, then each `<|media_pad|>` repeated by its image's
NaViT token count as SGLang 0.5.23's Kimi-K2.5 processor counts it.

`navit_tokens` is the formula of sglang.md ("Kimi-K2.5"), written out here; `wheel_navit_tokens`
runs the wheel's own `navit_resize_config` (pure arithmetic, taken from its source) so a test
can hold the two together. Nothing here imports tokenmill.
"""

from __future__ import annotations

import ast
import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.support.image_rows import ExpectedRow

MEDIA_PAD_ID = 163605  # Kimi-K2.5's <|media_pad|>, config.json media_placeholder_token_id
KIMI_MEDIA_CFG = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384}
KIMI_MEDIA_CFG["patch_limit_on_one_side"] = 512
NAVIT_MEMBER = "sglang/srt/multimodal/processors/kimi_k25.py"
QWEN_MEMBER = "sglang/srt/multimodal/processors/qwen_vl.py"
QWEN_NAMES = ("smart_resize", "round_by_factor", "ceil_by_factor", "floor_by_factor")


def navit_tokens(
    width: int,
    height: int,
    *,
    patch_size: int = 14,
    merge_kernel_size: int = 2,
    in_patch_limit: int = 16384,
    patch_limit_on_one_side: int = 512,
) -> int:
    """How many tokens Kimi-K2.5's processor makes of a width x height image: scaled (never
    up) under the patch budget and the per-side limit, each side padded up to a multiple of
    patch * merge, one token per merged patch."""
    scale = min(
        1.0,
        math.sqrt(in_patch_limit / (max(1, width // patch_size) * max(1, height // patch_size))),
        patch_limit_on_one_side * patch_size / width,
        patch_limit_on_one_side * patch_size / height,
    )
    side_limit = patch_limit_on_one_side * patch_size
    new_w = min(max(1, int(width * scale)), side_limit)
    new_h = min(max(1, int(height * scale)), side_limit)
    factor = patch_size * merge_kernel_size
    return math.ceil(new_h / factor) * math.ceil(new_w / factor)


def qwen_tokens(
    width: int,
    height: int,
    *,
    factor: int = 28,
    min_pixels: int = 3136,
    max_pixels: int = 12845056,
) -> int:
    """How many tokens Qwen2.5-VL makes of a width x height image (sglang.md, "Qwen2.5-VL /
    Qwen3-VL": transformers' smart_resize): each side rounded to a multiple of 28, then both
    scaled into [min_pixels, max_pixels]; one token per 28 x 28 block."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return (h // factor) * (w // factor)


def _wheel_functions(member: str, names: tuple[str, ...], **namespace: Any) -> dict[str, Any]:
    """The top-level functions `names` of a wheel file, run without the file's imports (they
    are pure arithmetic: `math` and the given names are all they use)."""
    from tests.support.sglang_chat_path import _member

    tree = ast.parse(_member(member))
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in nodes} == set(names), f"{member} lacks some of {names}"
    scope: dict[str, Any] = {"math": math, **namespace}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), member, "exec"), scope)
    return scope


@functools.cache
def _wheel_navit() -> Callable[..., dict[str, Any]]:
    found = _wheel_functions(NAVIT_MEMBER, ("navit_resize_config",))
    return found["navit_resize_config"]  # type: ignore[no-any-return]


@functools.cache
def _wheel_smart_resize() -> Callable[..., tuple[int, int]]:
    # the module constants its defaults name (every call here passes both pixel bounds)
    constants = {"IMAGE_FACTOR": 28, "MAX_RATIO": 200, "MIN_PIXELS": 0, "MAX_PIXELS": 0}
    return _wheel_functions(QWEN_MEMBER, QWEN_NAMES, **constants)["smart_resize"]  # type: ignore[no-any-return]


def wheel_qwen_tokens(width: int, height: int, *, min_pixels: int, max_pixels: int) -> int:
    """The token count from the wheel's own Qwen-VL `smart_resize` (one token per 28 x 28)."""
    resize = _wheel_smart_resize()
    h, w = resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
    return int(h // 28 * (w // 28))


def wheel_navit_tokens(width: int, height: int, **cfg: int) -> int:
    """The token count from the wheel's own `navit_resize_config` (K2.5's media config)."""
    merged = {**KIMI_MEDIA_CFG, **cfg}
    result = _wheel_navit()(
        width,
        height,
        merged["patch_size"],
        merged["merge_kernel_size"],
        merged["in_patch_limit"],
        merged["patch_limit_on_one_side"],
    )
    return int(result["num_tokens"])


def image_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        return image.size


@functools.cache
def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def template_ids(tokenizer_dir: Path, messages: Sequence[dict[str, Any]]) -> list[int]:
    """The prompt ids of messages: the folder's chat template with the generation prompt,
    encoded without adding special tokens (the template writes them)."""
    tokenizer = _tokenizer(str(tokenizer_dir))
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def image_counts(images: Sequence[Path], **cfg: int) -> list[int]:
    return [navit_tokens(*image_size(path), **cfg) for path in images]


def expected_prompt_ids(tokenizer_dir: Path, row: ExpectedRow, **cfg: int) -> list[int]:
    """The served prompt of row: its template ids with the i-th `<|media_pad|>` repeated by the
    NaViT count of its i-th image. AssertionError if the template does not render exactly one
    placeholder per image."""
    ids = template_ids(tokenizer_dir, row.messages)
    counts = iter(image_counts(row.images, **cfg))
    placeholders = ids.count(MEDIA_PAD_ID)
    assert placeholders == len(row.images), (placeholders, row.images)
    out: list[int] = []
    for token in ids:
        out.extend([token] * next(counts) if token == MEDIA_PAD_ID else [token])
    return out

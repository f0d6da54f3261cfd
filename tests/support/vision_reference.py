"""The reference image token counts tests check the emulator against (SGLang's and transformers'
own code, never the emulator's), and the test images.

Kimi: the wheel's `navit_resize_config` (`kimi_k25.py`), lifted out of its module by the syntax
tree (the module imports torch) and run as is. Qwen: transformers' `smart_resize` from the PIL
backend's module, which imports without torch; its source is checked equal to the torch
backend's (`image_processing_qwen2_vl.smart_resize`).
"""

from __future__ import annotations

import ast
import base64
import functools
import importlib.util
import io
import math
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.sglang_contract import CACHE_DIR, SGLANG_VERSION, contract_path

KIMI_MEMBER = "sglang/srt/multimodal/processors/kimi_k25.py"
# K2.5's media_proc_cfg
KIMI_PATCH, KIMI_MERGE = 14, 2


def png(width: int, height: int, color: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    """A one-colour PNG made with Pillow (tests make their images at run time)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _function_node(source: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(source)
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


@functools.cache
def wheel_navit_resize_config() -> Callable[..., dict[str, int]]:
    """SGLang 0.5.23's navit_resize_config(width, height, patch, merge, in_patch_limit,
    patch_limit_on_one_side), compiled alone from the wheel's source."""
    contract_path()  # fetches the wheel when the cache lacks it
    wheel = sorted(Path(CACHE_DIR).glob(f"sglang-{SGLANG_VERSION}-*.whl"))[0]
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(KIMI_MEMBER).decode()
    node = _function_node(source, "navit_resize_config")
    namespace: dict[str, Any] = {"math": math}
    exec(compile(ast.Module(body=[node], type_ignores=[]), KIMI_MEMBER, "exec"), namespace)
    function: Callable[..., dict[str, int]] = namespace["navit_resize_config"]
    return function


def kimi_reference_count(
    width: int, height: int, in_patch_limit: int = 16384, patch_limit_on_one_side: int = 512
) -> int:
    navit = wheel_navit_resize_config()
    result = navit(width, height, KIMI_PATCH, KIMI_MERGE, in_patch_limit, patch_limit_on_one_side)
    return int(result["num_tokens"])


@functools.cache
def transformers_smart_resize() -> Callable[..., tuple[int, int]]:
    """transformers' Qwen2-VL smart_resize(height, width, factor, min_pixels, max_pixels)."""
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil_backend

    torch_spec = importlib.util.find_spec("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    assert torch_spec is not None and torch_spec.origin is not None
    torch_source = Path(torch_spec.origin).read_text(encoding="utf-8")
    pil_source = Path(str(pil_backend.__file__)).read_text(encoding="utf-8")
    torch_node = ast.unparse(_function_node(torch_source, "smart_resize"))
    assert torch_node == ast.unparse(_function_node(pil_source, "smart_resize"))
    function: Callable[..., tuple[int, int]] = pil_backend.smart_resize
    return function


def qwen_reference_count(
    width: int,
    height: int,
    min_pixels: int = 3136,
    max_pixels: int = 12845056,
    factor: int = 28,
) -> int:
    """transformers' count: one token per (patch_size x merge_size)-sided patch of the
    smart-resized image (28 for Qwen2.5-VL, 16 x 2 for Qwen3-VL and Qwen3.5)."""
    new_h, new_w = transformers_smart_resize()(
        height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return (new_h // factor) * (new_w // factor)

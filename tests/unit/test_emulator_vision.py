"""The emulator's image token counts against SGLang's and transformers' own code, and its expansion.

Kimi: the wheel's `navit_resize_config` (kimi_k25.py), lifted out of the module by its syntax tree
(the module imports torch) and run as is, plus sglang.md's worked examples. Qwen: transformers'
`smart_resize` (the PIL backend's module, which imports without torch; its source is checked equal
to the torch backend's).
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import io
import math
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
from PIL import Image

from app.emulator.image_data import (
    BATCH_LENGTH,
    ImageInputError,
    ImageServerError,
    images_per_prompt,
    load_image,
)
from app.emulator.image_prompt import ImageProcessor, TextCodec
from app.emulator.vision import (
    KIMI_PLACEHOLDER_ID,
    AspectRatioError,
    VisionSettings,
    check_process_config,
    kimi_token_count,
    qwen_token_count,
    vision_settings,
)
from tests.support.sglang_contract import CACHE_DIR, SGLANG_VERSION, contract_path

KIMI_MEMBER = "sglang/srt/multimodal/processors/kimi_k25.py"
SIZES = [
    (640, 480),
    (300, 200),
    (1, 1),
    (13, 13),
    (14, 28),
    (27, 29),
    (1024, 1024),
    (1792, 1792),
    (4000, 3000),
    (3000, 4000),
    (7168, 100),
    (10000, 60),
    (60, 10000),
    (1920, 1080),
    (4096, 2160),
    (255, 4097),
]


def _function_from_source(source: str, name: str, namespace: dict[str, Any]) -> Any:
    """One top-level function of a module's source, compiled alone (no module imports run)."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), name, "exec"), namespace)
    return namespace[name]


def _wheel_navit() -> Callable[..., dict[str, int]]:
    contract_path()  # fetches the wheel when the cache lacks it
    wheel = sorted(Path(CACHE_DIR).glob(f"sglang-{SGLANG_VERSION}-*.whl"))[0]
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(KIMI_MEMBER).decode()
    namespace: dict[str, Any] = {"math": math, "Optional": Any}
    return _function_from_source(source, "navit_resize_config", namespace)  # type: ignore[no-any-return]


def _transformers_smart_resize() -> Callable[..., tuple[int, int]]:
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil_backend

    torch_spec = importlib.util.find_spec("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    assert torch_spec is not None and torch_spec.origin is not None
    torch_source = Path(torch_spec.origin).read_text(encoding="utf-8")
    pil_source = Path(pil_backend.__file__).read_text(encoding="utf-8")

    def source_of(text: str) -> str:
        tree = ast.parse(text)
        node = next(
            n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"
        )
        return ast.unparse(node)

    assert source_of(torch_source) == source_of(pil_source)
    return pil_backend.smart_resize  # type: ignore[no-any-return]


def _navit_by_hand(width: int, height: int, in_patch_limit: int, side: int) -> int:
    """sglang.md's formula, written out again here."""
    scale = min(
        1.0,
        math.sqrt(in_patch_limit / (max(1, width // 14) * max(1, height // 14))),
        side * 14 / width,
        side * 14 / height,
    )
    new_w = min(max(1, int(width * scale)), side * 14)
    new_h = min(max(1, int(height * scale)), side * 14)
    return (-(-new_h // 28)) * (-(-new_w // 28))


def test_kimi_counts_match_sglang_md_worked_examples() -> None:
    assert kimi_token_count(640, 480) == 414
    assert kimi_token_count(300, 200) == 88


@pytest.mark.parametrize("limits", [(16384, 512), (4096, 512), (16384, 64), (1024, 40)])
def test_kimi_counts_match_the_wheels_navit_resize_config(limits: tuple[int, int]) -> None:
    navit = _wheel_navit()
    in_patch_limit, side = limits
    for width, height in SIZES:
        expected = navit(width, height, 14, 2, in_patch_limit, side)["num_tokens"]
        got = kimi_token_count(
            width, height, in_patch_limit=in_patch_limit, patch_limit_on_one_side=side
        )
        assert got == expected, (width, height, limits)
        assert got == _navit_by_hand(width, height, in_patch_limit, side)


@pytest.mark.parametrize("bounds", [(3136, 12845056), (3136, 1003520), (200_000, 400_000)])
def test_qwen_counts_match_transformers_smart_resize(bounds: tuple[int, int]) -> None:
    smart_resize = _transformers_smart_resize()
    low, high = bounds
    for width, height in SIZES:
        if max(width, height) / min(width, height) > 200:
            continue
        new_h, new_w = smart_resize(height, width, factor=28, min_pixels=low, max_pixels=high)
        expected = (new_h // 28) * (new_w // 28)
        assert qwen_token_count(width, height, min_pixels=low, max_pixels=high) == expected


def test_qwen_refuses_an_aspect_ratio_over_200_as_transformers_does() -> None:
    smart_resize = _transformers_smart_resize()
    with pytest.raises(ValueError) as reference:
        smart_resize(10, 2010)
    with pytest.raises(AspectRatioError) as ours:
        qwen_token_count(2010, 10)
    assert str(ours.value) == str(reference.value)


def _png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def _data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


KIMI = VisionSettings(
    "kimi",
    KIMI_PLACEHOLDER_ID,
    "<|media_pad|>",
    {"in_patch_limit": 16384, "patch_limit_on_one_side": 512},
)


def test_kimi_expands_each_placeholder_and_keeps_every_other_id() -> None:
    ids = [1, 2, KIMI_PLACEHOLDER_ID, 3, KIMI_PLACEHOLDER_ID, 4]
    served = ImageProcessor(KIMI).serve(ids, [_data_uri(_png(640, 480)), _data_uri(_png(300, 200))])
    expected = [1, 2] + [KIMI_PLACEHOLDER_ID] * 414 + [3] + [KIMI_PLACEHOLDER_ID] * 88 + [4]
    assert served.ids == expected
    assert served.spans == ((2, 414), (417, 88))
    assert served.image_tokens == 502
    # the keyed ids differ exactly on the image spans, one value per image
    pairs = enumerate(zip(served.ids, served.key_ids, strict=True))
    changed = [at for at, (sent, keyed) in pairs if sent != keyed]
    assert changed == list(range(2, 416)) + list(range(417, 505))
    assert len({served.key_ids[2], served.key_ids[417]}) == 2


def test_kimi_counts_placeholders_before_reading_any_image() -> None:
    processor = ImageProcessor(KIMI)
    with pytest.raises(ImageInputError) as caught:
        # the item would fail to load; the count is checked first
        processor.serve([KIMI_PLACEHOLDER_ID, KIMI_PLACEHOLDER_ID], ["/no/such/file.png"])
    assert str(caught.value) == (
        "Kimi image placeholders must map one-to-one to image data: expected 1, found 2 token(s)"
    )
    with pytest.raises(ImageInputError, match="not supported for Kimi"):
        processor.serve([KIMI_PLACEHOLDER_ID], [_data_uri(_png(8, 8))], mm_hashes=["ab"])


def test_kimi_keys_an_image_by_its_bytes_and_the_settings() -> None:
    ids = [5, KIMI_PLACEHOLDER_ID, 6]
    red, blue = _data_uri(_png(64, 64)), _data_uri(_png(64, 64, (0, 0, 200)))
    processor = ImageProcessor(KIMI)
    assert processor.serve(ids, [red]).key_ids == processor.serve(ids, [red]).key_ids
    assert processor.serve(ids, [red]).ids == processor.serve(ids, [blue]).ids
    assert processor.serve(ids, [red]).key_ids != processor.serve(ids, [blue]).key_ids
    other = VisionSettings(
        "kimi", KIMI_PLACEHOLDER_ID, "<|media_pad|>", {**KIMI.limits, "in_patch_limit": 4096}
    )
    assert ImageProcessor(other).serve(ids, [red]).key_ids != processor.serve(ids, [red]).key_ids


def test_image_data_shapes_per_prompt() -> None:
    assert images_per_prompt(None, 1, True) == [[]]
    assert images_per_prompt("a", 1, True) == [["a"]]
    assert images_per_prompt(["a", "b"], 1, True) == [["a", "b"]]
    assert images_per_prompt([None], 1, True) == [[]]
    assert images_per_prompt([], 1, True) == [[]]
    assert images_per_prompt("a", 2, False) == [["a"], ["a"]]
    assert images_per_prompt(["a", "b"], 2, False) == [["a"], ["b"]]
    assert images_per_prompt([["a", "b"], None], 2, False) == [["a", "b"], []]
    with pytest.raises(ImageInputError) as caught:
        images_per_prompt(["a", "b", "c"], 2, False)
    assert str(caught.value) == BATCH_LENGTH


def test_loading_errors_read_as_sglangs(tmp_path: Path) -> None:
    png = tmp_path / "red.png"
    png.write_bytes(_png(30, 20))
    for source in (str(png), f"file://{png}", _data_uri(_png(30, 20)), {"url": str(png)}):
        for family in ("kimi", "qwen"):
            loaded = load_image(source, 0, family)
            assert (loaded.width, loaded.height) == (30, 20)
    not_an_image = _data_uri(b"definitely not an image " * 8)
    with pytest.raises(ImageInputError) as caught:
        load_image(_data_uri(b"not an image"), 2, "kimi")
    assert str(caught.value).startswith(
        "An exception occurred while loading IMAGE data at index 2: Error while loading data "
        "b'not an image': Could not decode image: "
    )
    with pytest.raises(ImageInputError) as caught:
        load_image(not_an_image, 1, "qwen")
    assert str(caught.value).startswith(
        "An exception occurred while loading IMAGE data at index 1: Error while loading data "
        f"{not_an_image[:100]}...: Could not decode image: "
    )
    missing = str(tmp_path / "missing.png")
    with pytest.raises(ImageServerError) as server:
        load_image(missing, 0, "kimi")
    assert str(server.value).startswith(
        "An exception occurred while loading IMAGE data at index 0: [Errno 2]"
    )
    # the generic loader decodes a relative path as base64
    with pytest.raises(ImageInputError, match=r"Error while loading data red\.png: "):
        load_image("red.png", 0, "qwen")


def test_process_config_checks() -> None:
    check_process_config({"image": {"in_patch_limit": 4096}}, "kimi")
    check_process_config({"image": {"min_pixels": 1, "max_pixels": 2}}, "qwen")
    with pytest.raises(ValueError, match="'max_pixels' is not one the kimi emulator models"):
        check_process_config({"image": {"max_pixels": 2}}, "kimi")
    with pytest.raises(ValueError, match="must be a dict"):
        check_process_config({"image": 3}, None)
    with pytest.raises(ValueError, match="positive integer"):
        check_process_config({"image": {"min_pixels": 0}}, "qwen")


def test_settings_read_the_tokenizer_folder_then_the_process_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"image_token_id": 7}')
    (tmp_path / "preprocessor_config.json").write_text('{"min_pixels": 100, "max_pixels": 900}')
    qwen = vision_settings("qwen", str(tmp_path), {"image": {"max_pixels": 5000}})
    assert qwen.placeholder_id == 7
    assert qwen.limits == {"min_pixels": 100, "max_pixels": 5000}
    assert vision_settings("kimi", None, {}).placeholder_id == KIMI_PLACEHOLDER_ID


class _Chars:
    """A stand-in tokenizer for the Qwen logic: one id per character, "ab" merged into id 3000,
    the vision tokens as one id each."""

    PIECES: ClassVar[dict[str, int]] = {
        "<|vision_start|>": 900,
        "<|image_pad|>": 901,
        "<|vision_end|>": 902,
        "ab": 3000,
    }

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.PIECES.items()}
        return "".join(names.get(i, chr(i)) for i in ids)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        while text:
            piece = next((s for s in self.PIECES if text.startswith(s)), None)
            if piece:
                out.append(self.PIECES[piece])
                text = text[len(piece) :]
            else:
                out.append(ord(text[0]))
                text = text[1:]
        return out


def _qwen(retokenize: bool = False) -> ImageProcessor:
    chars = _Chars()
    settings = VisionSettings(
        "qwen", 901, "<|image_pad|>", {"min_pixels": 3136, "max_pixels": 12845056}, retokenize
    )
    return ImageProcessor(settings, TextCodec(chars.decode, chars.encode))


def test_qwen_keeps_the_callers_ids_or_re_tokenizes_with_the_fallback_on() -> None:
    image = _data_uri(_png(56, 56))  # 4 tokens
    pads = [901] * 4
    # "ab" sent as two ids, where the tokenizer's own split is the one id 3000
    ids = [ord("a"), ord("b"), 900, 901, 902, ord("x")]
    assert _qwen().serve(ids, [image]).ids == [ord("a"), ord("b"), 900, *pads, 902, ord("x")]
    drifted = _qwen(retokenize=True).serve(ids, [image])
    assert drifted.ids == [3000, 900, *pads, 902, ord("x")]
    assert drifted.spans == ((2, 4),)
    # canonical ids come back unchanged even through the fallback
    canonical = [3000, 900, 901, 902]
    assert _qwen(retokenize=True).serve(canonical, [image]).ids == [3000, 900, *pads, 902]
    two_groups = [900, 901, 902, 900, 901, 902]
    with pytest.raises(ImageInputError) as caught:
        _qwen().serve(two_groups, [image])
    assert str(caught.value) == "Prompt has 2 image placeholders but 1 image inputs were provided"
    with pytest.raises(ImageInputError, match=r"Found total 2 <\|image_pad\|> tokens and 1 images"):
        _qwen().serve([900, 901, 901, 902], [image])
    # fewer groups than images: the first images only, the group rewritten, then re-tokenized
    served = _qwen().serve([ord("a"), 900, 901, 901, 902], [image, image])
    assert served.ids == [ord("a"), 900, *pads, 902]
    # no group at all: no image is used
    assert _qwen().serve([ord("a")], [image]).ids == [ord("a")]

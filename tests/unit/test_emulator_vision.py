"""The emulator's image token counts against SGLang's and transformers' own code
(tests.support.vision_reference) and sglang.md's worked examples; its expansion, image_data shapes
and loader errors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import ClassVar

import pytest

from emulator.image_data import (
    BATCH_LENGTH,
    ImageInputError,
    ImageServerError,
    images_per_prompt,
    load_image,
)
from emulator.image_prompt import ImageProcessor, TextCodec
from emulator.vision import (
    KIMI_PLACEHOLDER_ID,
    AspectRatioError,
    VisionConfigError,
    VisionSettings,
    check_process_config,
    kimi_token_count,
    qwen_token_count,
    vision_settings,
)
from tests.support.vision_reference import (
    data_uri,
    png,
    transformers_smart_resize,
    wheel_navit_resize_config,
)

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
    navit = wheel_navit_resize_config()
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
    smart_resize = transformers_smart_resize()
    low, high = bounds
    for width, height in SIZES:
        if max(width, height) / min(width, height) > 200:
            continue
        new_h, new_w = smart_resize(height, width, factor=28, min_pixels=low, max_pixels=high)
        expected = (new_h // 28) * (new_w // 28)
        assert qwen_token_count(width, height, min_pixels=low, max_pixels=high) == expected


def test_qwen_refuses_an_aspect_ratio_over_200_as_transformers_does() -> None:
    smart_resize = transformers_smart_resize()
    with pytest.raises(ValueError) as reference:
        smart_resize(10, 2010)
    with pytest.raises(AspectRatioError) as ours:
        qwen_token_count(2010, 10)
    assert str(ours.value) == str(reference.value)


KIMI = VisionSettings(
    "kimi",
    KIMI_PLACEHOLDER_ID,
    "<|media_pad|>",
    {"in_patch_limit": 16384, "patch_limit_on_one_side": 512},
)


def test_kimi_expands_each_placeholder_and_keeps_every_other_id() -> None:
    ids = [1, 2, KIMI_PLACEHOLDER_ID, 3, KIMI_PLACEHOLDER_ID, 4]
    served = ImageProcessor(KIMI).serve(ids, [data_uri(png(640, 480)), data_uri(png(300, 200))])
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
        processor.serve([KIMI_PLACEHOLDER_ID], [data_uri(png(8, 8))], mm_hashes=["ab"])


def test_kimi_keys_an_image_by_its_bytes_and_the_settings() -> None:
    ids = [5, KIMI_PLACEHOLDER_ID, 6]
    red, blue = data_uri(png(64, 64)), data_uri(png(64, 64, (0, 0, 200)))
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
    on_disk = tmp_path / "red.png"
    on_disk.write_bytes(png(30, 20))
    sources = (str(on_disk), f"file://{on_disk}", data_uri(png(30, 20)), {"url": str(on_disk)})
    for source in sources:
        for family in ("kimi", "qwen"):
            loaded = load_image(source, 0, family)
            assert (loaded.width, loaded.height) == (30, 20)
    not_an_image = data_uri(b"definitely not an image " * 8)
    with pytest.raises(ImageInputError) as caught:
        load_image(data_uri(b"not an image"), 2, "kimi")
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
    assert qwen.limits == {"min_pixels": 100, "max_pixels": 5000, "factor": 28}
    assert vision_settings("kimi", None, {}).placeholder_id == KIMI_PLACEHOLDER_ID
    with pytest.raises(VisionConfigError, match="min_pixels 100 is above max_pixels 50"):
        vision_settings("qwen", str(tmp_path), {"image": {"max_pixels": 50}})


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
    image = data_uri(png(56, 56))  # 4 tokens
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


def test_http_images_load_and_an_unreachable_url_is_kimis_500_and_qwens_400() -> None:
    import http.server
    import socket
    import threading

    body = png(40, 30)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/cat.png"
        for family in ("kimi", "qwen"):
            assert (load_image(url, 0, family).width, load_image(url, 0, family).height) == (40, 30)
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}/gone.png"
    with pytest.raises(ImageServerError):
        load_image(dead, 0, "kimi")
    with pytest.raises(ImageInputError, match=r"Error while loading data http://127\.0\.0\.1"):
        load_image(dead, 0, "qwen")


def test_qwens_generic_loader_gives_a_500_for_a_missing_absolute_path(tmp_path: Path) -> None:
    with pytest.raises(ImageServerError) as caught:
        load_image(str(tmp_path / "gone.png"), 3, "qwen")
    assert str(caught.value).startswith(
        f"An exception occurred while loading IMAGE data at index 3: Error while loading data "
        f"{tmp_path / 'gone.png'}: [Errno 2]"
    )


def test_a_tokenizer_folder_without_the_placeholder_id_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    with pytest.raises(VisionConfigError, match="no integer media_placeholder_token_id"):
        vision_settings("kimi", str(tmp_path), {})
    with pytest.raises(VisionConfigError, match="no integer image_token_id"):
        vision_settings("qwen", str(tmp_path), {})


def test_server_info_reports_every_image_setting_flat() -> None:
    from app.core.images import IMAGE_SETTINGS, image_settings
    from emulator.config import EmulatorConfig
    from emulator.info import model_info, server_info

    config = json.dumps({"image": {"in_patch_limit": 4096}})
    cfg = EmulatorConfig(mm="kimi", mm_process_config=config)
    info = server_info(cfg, 1234, 0.0)
    assert set(image_settings(info)) == set(IMAGE_SETTINGS)
    assert info["mm_process_config"] == {"image": {"in_patch_limit": 4096}}
    assert info["enable_multimodal"] is True
    assert "--mm-process-config" in info["launch_command"]
    assert model_info(cfg)["has_image_understanding"] is True
    text_only = server_info(EmulatorConfig(), 1234, 0.0)
    assert image_settings(text_only)["mm_process_config"] == {}
    assert model_info(EmulatorConfig())["has_image_understanding"] is False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mm", "kimi", "--mm-process-config", "{nope"], "mm_process_config is not JSON"),
        (["--mm", "qwen"], "it needs a tokenizer"),
        (["--mm-retokenize"], "it needs mm 'qwen'"),
        (["--mm", "kimi", "--mm-process-config", '{"image": {"min_pixels": 5}}'], "min_pixels"),
    ],
)
def test_the_cli_refuses_image_flags_that_cannot_work(flags: list[str], message: str) -> None:
    from click.testing import CliRunner

    from emulator.cli import emulator

    result = CliRunner().invoke(emulator, flags)
    assert result.exit_code == 2
    assert message in result.output

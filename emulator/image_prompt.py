"""The prompt a multimodal emulator serves: the request ids with each image's placeholder
expanded (Kimi, Qwen by default), or Qwen's decode + re-tokenize fallback, which can drift.

Also the ids the prefix cache and the output seed see: each image token replaced by a value
derived from the image's bytes and the processor settings, as SGLang's pad values key its
radix cache, so the same ids with another image neither hit the cache nor answer alike.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.images import FAMILIES, expand_placeholders, placeholder_count
from emulator.image_data import ImageInputError, LoadedImage, load_image
from emulator.vision import AspectRatioError, VisionSettings

logger = logging.getLogger(__name__)

IDENTITY_TAG = b"tokenmill-emulator-image/1"
# Qwen-VL's image groups in the decoded prompt, and the legacy `<image>` sentinel
QWEN_GROUP = re.compile(r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>|<image>")
QWEN_IMAGE_TEXT = FAMILIES["qwen"][1]


@dataclass(frozen=True)
class TextCodec:
    """The server's tokenizer as the Qwen processor uses it: decode with special tokens, and
    tokenize text (adding the tokenizer's special tokens, as the HF processor does)."""

    decode: Callable[[Sequence[int]], str]
    encode: Callable[[str], list[int]]


@dataclass(frozen=True)
class ServedPrompt:
    """The ids served for one prompt, and how its images sit in them."""

    ids: list[int]
    # ids with image tokens replaced by their image's identity value (prefix cache, seeds)
    key_ids: list[int]
    # (first position, token count) of each image's span, in prompt order
    spans: tuple[tuple[int, int], ...]

    @property
    def image_tokens(self) -> int:
        return sum(count for _, count in self.spans)


def text_prompt(ids: list[int]) -> ServedPrompt:
    return ServedPrompt(ids, ids, ())


class ImageProcessor:
    """One server's multimodal processor: turns (ids, image items) into the served prompt."""

    def __init__(self, settings: VisionSettings, codec: TextCodec | None = None) -> None:
        if settings.family == "qwen" and codec is None:
            raise ValueError("the Qwen processor needs the server's tokenizer")
        self.settings = settings
        self.codec = codec

    def serve(self, ids: list[int], items: list[Any], mm_hashes: Any = None) -> ServedPrompt:
        """The served prompt; ImageInputError (400) or ImageServerError (500) as SGLang."""
        if not items:
            return text_prompt(ids)
        if self.settings.family == "kimi":
            return self._kimi(ids, items, mm_hashes)
        return self._qwen(ids, items)

    def _kimi(self, ids: list[int], items: list[Any], mm_hashes: Any) -> ServedPrompt:
        if mm_hashes:
            raise ImageInputError("Caller-supplied mm_hashes are not supported for Kimi.")
        pid = self.settings.placeholder_id
        found = placeholder_count(ids, pid)
        if found != len(items):  # checked before any image is read
            raise ImageInputError(
                "Kimi image placeholders must map one-to-one to image data: "
                f"expected {len(items)}, found {found} token(s)"
            )
        images = [load_image(item, index, "kimi") for index, item in enumerate(items)]
        counts = [self.settings.token_count(i.width, i.height) for i in images]
        return self._keyed(expand_placeholders(ids, pid, counts), images, counts)

    def _qwen(self, ids: list[int], items: list[Any]) -> ServedPrompt:
        assert self.codec is not None
        text = self.codec.decode(ids)
        groups = QWEN_GROUP.findall(text)
        legacy = len(groups) != len(items)
        used = items[: len(groups)] if legacy else items
        images = [load_image(item, index, "qwen", legacy=legacy) for index, item in enumerate(used)]
        if len(groups) > len(items):
            raise ImageInputError(
                f"Prompt has {len(groups)} image placeholders but {len(items)} image inputs "
                "were provided"
            )
        if not images:  # no image group: no image is used and the ids are served as sent
            return text_prompt(ids)
        if legacy:  # the prompt-scanning loader rewrites each group as one placeholder
            text = QWEN_GROUP.sub(QWEN_IMAGE_TEXT, text)
        pad = self.settings.placeholder
        try:
            counts = [self.settings.token_count(i.width, i.height) for i in images]
        except AspectRatioError as exc:
            raise ImageInputError(str(exc)) from exc
        if text.count(pad) != len(images):
            raise ImageInputError(
                f"The total number of {pad} tokens in the prompts should be the same as the "
                f"number of images passed. Found total {text.count(pad)} {pad} tokens and "
                f"{len(images)} images."
            )
        pid = self.settings.placeholder_id
        if not self.settings.retokenize and placeholder_count(ids, pid) == len(images):
            return self._keyed(expand_placeholders(ids, pid, counts), images, counts)
        logger.warning(
            "falling back to decode+retokenize, which may change prompt length (token drift)"
        )
        pieces = text.split(pad)
        expanded = pieces[0] + "".join(
            pad * count + piece for count, piece in zip(counts, pieces[1:], strict=True)
        )
        return self._keyed(self.codec.encode(expanded), images, counts)

    def _keyed(
        self, served: list[int], images: list[LoadedImage], counts: list[int]
    ) -> ServedPrompt:
        """Each image takes the next counts[i] placeholder positions of the served ids."""
        pid = self.settings.placeholder_id
        positions = [at for at, token in enumerate(served) if token == pid]
        key_ids = list(served)
        spans = []
        taken = 0
        for image, count in zip(images, counts, strict=True):
            value = self.identity_value(image, count)
            mine = positions[taken : taken + count]
            for at in mine:
                key_ids[at] = value
            spans.append((mine[0] if mine else len(served), len(mine)))
            taken += count
        return ServedPrompt(served, key_ids, tuple(spans))

    def identity_value(self, image: LoadedImage, count: int) -> int:
        """The id an image's tokens are keyed by: from its bytes' sha256, the processor
        settings and its token count; negative, so it never equals a real token id."""
        digest = hashlib.sha256(IDENTITY_TAG)
        digest.update(bytes.fromhex(image.sha256))
        digest.update(self.settings.fingerprint)
        digest.update(count.to_bytes(8, "big"))
        return -1 - int.from_bytes(digest.digest()[:7], "big")

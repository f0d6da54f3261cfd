"""Sixty multimodal rows for the image e2e tests, with fixture images made here with Pillow.

`build_image_rows(folder)` writes 13 images of different sizes and contents (so their token
counts differ), and a JSONL file of 60 rows over them: one image, several, images in history
and in tool results, `{"type": "image"}` parts, data URIs, `file://` URLs, absolute and
relative paths, an image repeated within a row and across rows, system turns, LLaVA rows
(`"image"` / `"images"` beside `conversations`, `<image>` markers), and 3 bad rows (a missing
file, bytes that do not decode, a video part). For each good row it records the prompt turns
as a chat template receives them (image parts as `{"type": "image"}`, the trailing answer
dropped) and the image files in prompt order: what `tests.support.image_reference` needs.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# name -> (width, height, Pillow format): from one token (28x28) to a scaled-down photo
IMAGE_SIZES: dict[str, tuple[int, int, str]] = {
    "dot": (28, 28, "PNG"),
    "icon": (32, 32, "PNG"),
    "thumb": (64, 48, "JPEG"),
    "strip": (333, 77, "PNG"),
    "tall": (56, 400, "PNG"),
    "card": (100, 60, "WEBP"),
    "chart": (300, 200, "PNG"),
    "portrait": (120, 250, "JPEG"),
    "poster": (90, 160, "PNG"),
    "square": (500, 500, "PNG"),
    "photo": (640, 480, "JPEG"),
    "wide": (1200, 300, "PNG"),
    "scan": (2000, 1700, "JPEG"),  # over 16,384 patches: NaViT scales it down
}
EXTENSIONS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp"}
LLAVA_MARKER = "<image>"


@dataclass(frozen=True)
class ExpectedRow:
    """A good row as the reference sees it: the prompt turns the template renders, and the
    image file behind each placeholder, in prompt order."""

    messages: list[dict[str, Any]]
    images: list[Path]


@dataclass(frozen=True)
class BadRow:
    """A row that must be refused: its line number and what its error names."""

    line: int
    names: tuple[str, ...]


@dataclass
class ImageRows:
    """The rows file, the folder of its images, the --image-root to pass (None: relative
    sources resolve against the rows file's folder), and what each row must give."""

    path: Path
    image_dir: Path
    image_root: Path | None
    expected: dict[str, ExpectedRow] = field(default_factory=dict)
    bad: list[BadRow] = field(default_factory=list)

    def distinct_images(self) -> set[Path]:
        return {image for row in self.expected.values() for image in row.images}

    def relocated(self, image_dir: Path) -> ImageRows:
        """The same rows with their images moved to image_dir (the rows' own sources now
        name nothing: what a GPU node without the user's files sees)."""
        self.image_dir.rename(image_dir)

        def moved(path: Path) -> Path:
            return image_dir / path.relative_to(self.image_dir)

        expected = {
            key: ExpectedRow(row.messages, [moved(p) for p in row.images])
            for key, row in self.expected.items()
        }
        root = image_dir if self.image_root else None
        return ImageRows(self.path, image_dir, root, expected, self.bad)


def make_image(path: Path, width: int, height: int, image_format: str, seed: int) -> Path:
    """An image of this size whose pixels depend on seed: a colour field with rectangles."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = rng.randrange(x0, width + 1), rng.randrange(y0, height + 1)
        draw.rectangle((x0, y0, x1, y1), fill=tuple(rng.randrange(256) for _ in range(3)))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=image_format, quality=80) if image_format == "JPEG" else image.save(
        path, format=image_format
    )
    return path


def make_images(folder: Path) -> dict[str, Path]:
    """IMAGE_SIZES written into folder/photos, each with its own content."""
    return {
        name: make_image(folder / "photos" / f"{name}.{EXTENSIONS[fmt]}", w, h, fmt, seed)
        for seed, (name, (w, h, fmt)) in enumerate(IMAGE_SIZES.items())
    }


class _Sources:
    """How each image is referenced, in rotation: relative, absolute, file://, data URI."""

    def __init__(self, images: dict[str, Path], root: Path) -> None:
        self.images = images
        self.root = root
        self.turn = 0

    def __call__(self, name: str, kind: str | None = None) -> str:
        path = self.images[name]
        kinds = ("relative", "absolute", "relative", "file", "data")
        kind = kind or kinds[self.turn % len(kinds)]
        self.turn += 1
        if kind == "relative":
            return path.relative_to(self.root).as_posix()
        if kind == "absolute":
            return str(path)
        if kind == "file":
            return path.as_uri()
        mime = {"png": "png", "jpg": "jpeg", "webp": "webp"}[path.suffix[1:]]
        return f"data:image/{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def _url_part(source: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": source}}


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


IMAGE = {"type": "image"}  # what SGLang's chat path hands the template for an image part


class _Builder:
    """Collects the rows (in file order) and what each good one must give."""

    def __init__(self, images: dict[str, Path], root: Path) -> None:
        self.images = images
        self.src = _Sources(images, root)
        self.lines: list[dict[str, Any]] = []
        self.expected: dict[str, ExpectedRow] = {}

    def good(self, row: dict[str, Any], prompt: list[dict[str, Any]], names: list[str]) -> None:
        key = f"img-{len(self.lines) + 1:02d}"
        self.lines.append({"id": key, **row})
        self.expected[key] = ExpectedRow(prompt, [self.images[n] for n in names])

    def single(self, name: str, question: str, *, part: str = "image_url") -> None:
        source = self.src(name)
        image = _url_part(source) if part == "image_url" else {"type": "image", "image": source}
        row = {"messages": [{"role": "user", "content": [image, _text(question)]}]}
        self.good(row, [{"role": "user", "content": [IMAGE, _text(question)]}], [name])

    def several(self, names: list[str], question: str) -> None:
        parts = [_text(question)] + [_url_part(self.src(n)) for n in names]
        prompt = [_text(question)] + [IMAGE for _ in names]
        row = {"messages": [{"role": "user", "content": parts}]}
        self.good(row, [{"role": "user", "content": prompt}], names)

    def history(self, name: str, system: str | None = None) -> None:
        turns = [
            ("What is in this picture?", [_url_part(self.src(name))], "Shapes on a plain field."),
        ]
        first = [*turns[0][1], _text(turns[0][0])]
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": turns[0][2]},
            {"role": "user", "content": "And which colour covers the most of it?"},
        ]
        prompt: list[dict[str, Any]] = [
            {"role": "user", "content": [IMAGE, _text(turns[0][0])]},
            {"role": "assistant", "content": turns[0][2]},
            messages[2],
        ]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
            prompt.insert(0, {"role": "system", "content": system})
        self.good({"messages": messages}, prompt, [name])

    def tool_result(self, names: list[str]) -> None:
        call = {
            "id": "functions.view_image:0",
            "type": "function",
            "function": {"name": "view_image", "arguments": {"path": "figure"}},
        }
        ask = {"role": "user", "content": "Open the figure and describe it."}
        called = {"role": "assistant", "content": "", "tool_calls": [call]}
        parts = [_text("The figure:")] + [_url_part(self.src(n)) for n in names]
        result = {"role": "tool", "tool_call_id": call["id"], "content": parts}
        prompt_result = {**result, "content": [_text("The figure:")] + [IMAGE for _ in names]}
        self.good({"messages": [ask, called, result]}, [ask, called, prompt_result], names)

    def llava(self, names: list[str], turns: list[tuple[str, str]]) -> None:
        """A LLaVA / ShareGPT4V row: `image` (one) or `images` (several) beside conversations."""
        sources = [self.src(n, "relative") for n in names]
        conversations: list[dict[str, str]] = []
        prompt: list[dict[str, Any]] = []
        for human, gpt in turns:
            conversations += [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]
            prompt += [
                {"role": "user", "content": _marked_parts(human)},
                {"role": "assistant", "content": gpt},
            ]
        prompt.pop()  # the last answer is what gets regenerated
        extra = {"image": sources[0]} if len(sources) == 1 else {"images": sources}
        self.good({**extra, "conversations": conversations}, prompt, names)


def _marked_parts(text: str) -> list[dict[str, Any]] | str:
    """A LLaVA turn's text as content parts: each `<image>` marker an image, the text between
    kept verbatim (empty pieces dropped); a turn without markers stays a string."""
    if LLAVA_MARKER not in text:
        return text
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split(LLAVA_MARKER)):
        if i:
            parts.append(IMAGE)
        if piece:
            parts.append(_text(piece))
    return parts


def _fill(b: _Builder) -> None:
    questions = ["Describe the image.", "What shapes do you see?", "Name the main colour."]
    for i, name in enumerate(("dot", "icon", "thumb", "strip", "tall", "card", "chart")):
        b.single(name, questions[i % 3])
    for name in ("portrait", "poster", "square", "photo", "wide"):
        b.single(name, "Caption this in five words.")
    for name in ("chart", "photo", "icon", "scan"):
        b.single(name, "What is this?", part="image")
    b.several(["chart", "photo"], "Compare the two images.")
    b.several(["thumb", "strip", "poster"], "Which of these is the widest?")
    b.several(["icon", "icon"], "Are these two the same?")  # one image twice in a row
    b.several(["square", "card", "square"], "Which two are the same picture?")
    b.several(["tall", "wide"], "Which is taller?")
    b.several(["dot", "portrait"], "Describe both.")
    for name in ("chart", "thumb", "card"):
        b.history(name)
    for name in ("photo", "strip"):
        b.history(name, system="You describe images precisely.")
    for names in (["chart"], ["poster"], ["icon", "tall"], ["photo"], ["square", "dot"]):
        b.tool_result(names)
    llava_one = [
        ("dot", [("<image>\nWhat is shown here?", "A small square.")]),
        ("chart", [("<image>\nDescribe the chart.", "Bars of colour.")]),
        ("photo", [("What is in the photo?\n<image>", "Rectangles.")]),
        ("card", [("<image>Read the card.", "It has no text.")]),
        (
            "square",
            [("<image>\nWhat colour is it?", "Mostly one colour."), ("Anything else?", "No.")],
        ),
        ("portrait", [("<image>\nIs it tall or wide?", "Tall."), ("How tall?", "Twice as tall.")]),
        ("thumb", [("Look: <image> then answer: how many shapes?", "Six.")]),
        ("wide", [("<image>\nWhat aspect ratio?", "Four to one.")]),
    ]
    for name, turns in llava_one:
        b.llava([name], turns)
    llava_many = [
        (["chart", "photo"], [("<image>\n<image>\nCompare these.", "They differ.")]),
        (["icon", "strip"], [("First <image> and second <image>: which is larger?", "The strip.")]),
        (["tall", "poster"], [("<image>\nThis one.", "Tall."), ("<image>\nAnd this?", "Tall.")]),
        (["chart", "chart"], [("<image>\n<image>\nSame image?", "Yes.")]),
    ]
    for names, turns in llava_many:
        b.llava(names, turns)
    for i, name in enumerate(("dot", "icon", "chart")):
        b.single(name, f"Image {i}: what is it?")
    b.history("poster", system="Answer briefly.")
    b.several(["photo", "photo"], "Twice the same photo?")
    b.single("tall", "Last one: describe it.")
    for i, name in enumerate(("strip", "card", "wide", "portrait", "poster", "thumb", "square")):
        b.single(
            name,
            f"Question {i}: what colour is the largest shape?",
            part="image" if i % 2 else "image_url",
        )


def _bad_rows() -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """Three rows to refuse, each with what its error must name: a missing file, bytes that
    do not decode, a video part."""
    gone = [_text("Look:"), _url_part("photos/gone.png")]
    broken = [_url_part("photos/broken.png")]
    video = [_text("Watch:"), {"type": "video_url", "video_url": {"url": "photos/clip.mp4"}}]
    return [
        ({"messages": [{"role": "user", "content": gone}]}, ("content[1]", "photos/gone.png")),
        ({"messages": [{"role": "user", "content": broken}]}, ("content[0]", "photos/broken.png")),
        ({"messages": [{"role": "user", "content": video}]}, ("content[1]", "video")),
    ]


BAD_LINES = (5, 30, 60)  # among the good rows, so those around them are seen to survive


def build_image_rows(folder: Path, *, use_image_root: bool = False) -> ImageRows:
    """Images and the 60 rows in folder. With use_image_root the rows file sits in its own
    folder and relative sources name files under the image folder (pass it as --image-root);
    otherwise the rows file sits in the image folder and relative sources resolve against it."""
    image_dir = folder / "images"
    images = make_images(image_dir)
    (image_dir / "photos" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not an image" * 9)
    builder = _Builder(images, image_dir)
    _fill(builder)
    good = iter(builder.lines)
    bad = iter(_bad_rows())
    lines: list[dict[str, Any]] = []
    refused: list[BadRow] = []
    for line in range(1, len(builder.lines) + len(BAD_LINES) + 1):
        if line in BAD_LINES:
            row, names = next(bad)
            lines.append({"id": f"bad-{line:02d}", **row})
            refused.append(BadRow(line, names))
        else:
            lines.append(next(good))
    assert len(lines) == 60, len(lines)
    rows_dir = folder / "rows" if use_image_root else image_dir
    rows_dir.mkdir(parents=True, exist_ok=True)
    path = rows_dir / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in lines), encoding="utf-8")
    root = image_dir if use_image_root else None
    return ImageRows(path, image_dir, root, builder.expected, refused)

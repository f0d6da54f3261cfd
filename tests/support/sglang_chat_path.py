"""SGLang 0.5.23's own chat-path functions, loaded from its wheel for the tests to compare with.

`jinja_template_utils.py` is loaded whole, with a stub for the one sglang module it imports
(`sglang.srt.utils`: media types tokenmill never sends). From `serving_chat.py`, which imports
half of SGLang, only the pure functions named in SERVING_CHAT_FUNCTIONS are taken, by their
source, and run with the modules they use. `reference_messages` chains them the way
`OpenAIServingChat._apply_jinja_template` does for a Jinja template.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib.util
import sys
import zipfile
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from tests.support.sglang_contract import CACHE_DIR, SGLANG_VERSION, _wheel

TEMPLATE_UTILS_MEMBER = "sglang/srt/parser/jinja_template_utils.py"
SERVING_CHAT_MEMBER = "sglang/srt/entrypoints/openai/serving_chat.py"
SERVING_CHAT_FUNCTIONS = (
    "normalize_tool_content",
    "parse_tool_call_arguments",
    "normalize_assistant_tool_call_arguments",
)


@dataclass
class _MediaStub:
    """Stands in for sglang.srt.utils.ImageData / VideoData: the fields the chat path fills."""

    url: str = ""
    detail: str | None = None
    max_dynamic_patch: int | None = None
    content_hash: str | None = None
    max_long_side_pixel: int | None = None
    preprocess_kwargs: dict[str, Any] | None = None


def _member(name: str) -> str:
    with zipfile.ZipFile(_wheel(CACHE_DIR, SGLANG_VERSION)) as wheel:
        return wheel.read(name).decode("utf-8")


@functools.cache
def template_utils() -> ModuleType:
    """sglang.srt.parser.jinja_template_utils, as the wheel ships it."""
    utils = ModuleType("sglang.srt.utils")
    utils.GLM_MEDIA_CONFIG_KEYS = ()  # type: ignore[attr-defined]
    utils.ImageData = _MediaStub  # type: ignore[attr-defined]
    utils.VideoData = _MediaStub  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in ("sglang", "sglang.srt", "sglang.srt.utils")}
    for name in ("sglang", "sglang.srt"):
        sys.modules.setdefault(name, ModuleType(name))
    sys.modules["sglang.srt.utils"] = utils
    try:
        path = CACHE_DIR / f"jinja_template_utils-{SGLANG_VERSION}.py"
        if not path.exists():
            path.write_text(_member(TEMPLATE_UTILS_MEMBER), encoding="utf-8")
        spec = importlib.util.spec_from_file_location("sglang_jinja_template_utils", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


@functools.cache
def serving_chat_functions() -> dict[str, Any]:
    """The functions of SERVING_CHAT_FUNCTIONS, compiled from the wheel's source."""
    import orjson

    tree = ast.parse(_member(SERVING_CHAT_MEMBER))
    wanted = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in SERVING_CHAT_FUNCTIONS
    ]
    assert {node.name for node in wanted} == set(SERVING_CHAT_FUNCTIONS)
    module = ast.Module(body=list(wanted), type_ignores=[])
    namespace: dict[str, Any] = {"orjson": orjson, "Any": Any}
    exec(compile(module, SERVING_CHAT_MEMBER, "exec"), namespace)
    return {name: namespace[name] for name in SERVING_CHAT_FUNCTIONS}


def detect_content_format(template: str) -> str:
    return str(template_utils().detect_jinja_template_content_format(template))


def dumped_turns(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns as SGLang's request models (protocol.py's ChatCompletionMessageParam) keep
    and dump them: only the fields their role declares, in the models' order."""
    from pydantic import TypeAdapter

    from tests.support.sglang_contract import load_protocol

    adapter = TypeAdapter(load_protocol().ChatCompletionMessageParam)
    return [adapter.validate_python(copy.deepcopy(turn)).model_dump() for turn in turns]


def reference_messages(turns: list[dict[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """SGLang's turns for a Jinja template, from a request's turns (dumped by its request
    models first)."""
    return reference_messages_and_images(turns, content_format)[0]


def reference_messages_and_images(
    turns: list[dict[str, Any]], content_format: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """reference_messages, and the urls of the images SGLang collects, in its order."""
    functions = serving_chat_functions()
    process = template_utils().process_content_for_template_format
    messages = dumped_turns(turns)
    for message in messages:
        functions["normalize_assistant_tool_call_arguments"](message, strict=True)
    out = []
    images: list[Any] = []
    for message in copy.deepcopy(messages):
        if message.get("content") is None:
            message["content"] = ""
        processed = process(message, content_format, images, [], [], [])
        processed["content"] = functions["normalize_tool_content"](
            processed["role"], processed.get("content")
        )
        out.append(processed)
    return out, [image.url for image in images]

"""JSON as SGLang 0.5.23 reads a request: its body and tool-call arguments are parsed by orjson
(`http_server.ORJSONRequest`, `serving_chat.parse_tool_call_arguments`), not Python's json."""

from __future__ import annotations

import math
from typing import Any

from app.core.errors import InputError

# orjson's integer range: it reads an integer outside it as a float
_ORJSON_INT_MIN, _ORJSON_INT_MAX = -(2**63), 2**64 - 1


def parse_tool_call_arguments(text: str, where: str = "arguments") -> dict[str, Any]:
    """Tool-call arguments given as a JSON string, as the object the template receives: parsed
    by orjson, as SGLang parses them (NaN, Infinity and lone surrogates refused, an integer
    beyond 64 bits read as a float)."""
    import orjson

    try:
        value = orjson.loads(text)
    except (orjson.JSONDecodeError, UnicodeEncodeError) as exc:
        raise InputError(f"{where} is not valid JSON as SGLang reads it ({exc})") from None
    if not isinstance(value, dict):
        raise InputError(f"{where} must hold a JSON object, not a JSON {json_type(value)}")
    return value


def as_sglang_reads(value: Any, where: str) -> Any:
    """The value as SGLang's orjson body parser reads it: an integer beyond 64 bits becomes a
    float (as orjson parses it); InputError naming the first value it refuses (400): a lone
    surrogate, NaN, Infinity, or a number beyond a float's range."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(
                f"{where} holds a lone surrogate escape (like \\ud800), which SGLang refuses"
            ) from None
        return value
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if _ORJSON_INT_MIN <= value <= _ORJSON_INT_MAX:
            return value
        try:
            return float(value)
        except OverflowError:
            raise InputError(
                f"{where} is a number beyond a float's range, which SGLang refuses"
            ) from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InputError(f"{where} is {value}, which SGLang refuses (not JSON)")
        return value
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            as_sglang_reads(key, f"{where} (a key)")
            out[key] = as_sglang_reads(item, f"{where}.{key}")
        return out
    if isinstance(value, list):
        return [as_sglang_reads(item, f"{where}[{i}]") for i, item in enumerate(value)]
    return value


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__

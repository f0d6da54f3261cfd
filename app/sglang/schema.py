"""SGLang 0.5.23's /generate schema gate: the accept/reject verdict and 400 text of its published
JSON contract, for the client (a row's sampling_params at enqueue) and the emulator alike.

SGLang checks every body against that contract before anything else (unknown keys in
sampling_params rejected, wrong types rejected, serde-style messages); this mirrors those checks,
and the conformance tests hold it to the wheel's `sglang/api/v1/api_types.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.core.errors import TokenmillError

Check = Callable[[Any], None]


class SchemaViolation(TokenmillError, ValueError):
    """The body breaks the JSON contract: HTTP 400 `{"error": "<text>"}`."""


SAMPLING_FIELDS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
WATERMARK_FIELDS = ("enabled", "key", "context_window")
MEDIA_REF_FIELDS = (
    "url",
    "detail",
    "max_dynamic_patch",
    "content_hash",
    "min_pixels",
    "max_pixels",
    "total_max_pixels",
    "fps",
    "num_frames",
    "min_frames",
    "max_frames",
    "max_tokens_per_frame",
    "max_image_tokens",
    "use_audio",
    "image_grid_thw",
)


def describe(value: Any) -> str:
    """serde's name for an unexpected value, so the 400 text reads like SGLang's."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


def invalid_type(value: Any, expected: str) -> SchemaViolation:
    return SchemaViolation(f"invalid type: {describe(value)}, expected {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- scalar checks --------------------------------------------------------------------


def check_int(value: Any, expected: str = "i64") -> None:
    if not _is_int(value):
        raise invalid_type(value, expected)


def check_uint(value: Any, expected: str = "u64") -> None:
    check_int(value, expected)
    if value < 0:
        raise SchemaViolation(f"invalid value: integer `{value}`, expected {expected}")


def check_float(value: Any, expected: str = "f64") -> None:
    if not _is_number(value):
        raise invalid_type(value, expected)


def check_bool(value: Any, expected: str = "a boolean") -> None:
    if not isinstance(value, bool):
        raise invalid_type(value, expected)


def check_str(value: Any, expected: str = "a string") -> None:
    if not isinstance(value, str):
        raise invalid_type(value, expected)


def check_seq(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise invalid_type(value, "a sequence")
    return value


def check_map(value: Any, expected: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid_type(value, expected)
    return value


# --- composite checks -----------------------------------------------------------------


def check_token_ids(value: Any) -> None:
    items = check_seq(value)
    # one pass in C for the common case; the slow loop only finds the culprit
    if all(type(item) is int for item in items):
        return
    for item in items:
        check_int(item)


def check_token_ids_or_list(value: Any) -> None:
    if not isinstance(value, list):
        raise invalid_type(value, "a value or an array of values for TokenIdsOrList")
    if not value or _is_number(value[0]):
        check_token_ids(value)
        return
    for row in value:
        check_token_ids(row)


def or_list(scalar: Callable[[Any, str], None], element: str, alias: str) -> Check:
    """One value or an array of values, as SGLang's `XOrList` shapes decode."""

    def check(value: Any) -> None:
        if isinstance(value, list):
            for item in value:
                scalar(item, element)
        else:
            scalar(value, f"a value or an array of values for {alias}")

    return check


def optional_or_list(scalar: Callable[[Any, str], None], element: str, alias: str) -> Check:
    def check(value: Any) -> None:
        if isinstance(value, list):
            for item in value:
                if item is not None:
                    scalar(item, element)
        else:
            scalar(value, f"a value or an array of values for {alias}")

    return check


def list_of(scalar: Callable[[Any, str], None], element: str) -> Check:
    def check(value: Any) -> None:
        for item in check_seq(value):
            scalar(item, element)

    return check


def string_list_or_list(value: Any) -> None:
    if not isinstance(value, list):
        raise invalid_type(value, "a value or an array of values for StringListOrList")
    if not value or isinstance(value[0], str):
        list_of(check_str, "a string")(value)
        return
    for row in check_seq(value):
        list_of(check_str, "a string")(row)


def check_optional_string_list(value: Any) -> None:
    for item in check_seq(value):
        if item is not None:
            check_str(item)


def map_of(scalar: Callable[[Any, str], None], element: str) -> Check:
    def check(value: Any) -> None:
        for item in check_map(value, "a map").values():
            scalar(item, element)

    return check


def check_struct(fields: dict[str, Check], names: tuple[str, ...], struct: str) -> Check:
    """An object whose unknown keys are rejected (serde `deny_unknown_fields`)."""

    def check(value: Any) -> None:
        for key, item in check_map(value, f"struct {struct}").items():
            field_check = fields.get(key)
            if field_check is None:
                raise unknown_field(key, names)
            if item is not None:
                field_check(item)

    return check


def unknown_field(key: str, names: tuple[str, ...]) -> SchemaViolation:
    listed = ", ".join(f"`{name}`" for name in names)
    return SchemaViolation(f"unknown field `{key}`, expected one of {listed}")


def _accept(value: Any) -> None:
    """Shapes the emulator does not model (media, kv hints) pass the gate unchecked."""


_WATERMARK: dict[str, Check] = {
    "enabled": check_bool,
    "key": check_str,
    "context_window": check_int,
}
check_watermark = check_struct(_WATERMARK, WATERMARK_FIELDS, "WatermarkRequestConfig")


def _check_grid(value: Any) -> None:
    for row in check_seq(value):
        list_of(check_int, "i64")(row)


_MEDIA_REF: dict[str, Check] = {
    "url": check_str,
    "detail": check_str,
    "max_dynamic_patch": check_int,
    "content_hash": check_str,
    "min_pixels": check_int,
    "max_pixels": check_int,
    "total_max_pixels": check_int,
    "fps": check_float,
    "num_frames": check_int,
    "min_frames": check_int,
    "max_frames": check_int,
    "max_tokens_per_frame": check_int,
    "max_image_tokens": check_int,
    "use_audio": check_bool,
    "image_grid_thw": _check_grid,
}
_check_media_ref = check_struct(_MEDIA_REF, MEDIA_REF_FIELDS, "MediaRef")


def _check_media_item(value: Any) -> None:
    """A string (URL, path, data URI, base64) or a MediaRef object (unknown keys rejected)."""
    if isinstance(value, str):
        return
    if isinstance(value, dict):
        if "url" in value and value["url"] is None:
            raise invalid_type(None, "a string")
        _check_media_ref(value)
        return
    raise invalid_type(value, "one of the MediaItem shapes")


def _check_media_items(value: Any) -> None:
    for item in check_seq(value):
        if item is not None:
            _check_media_item(item)


def check_media_input(value: Any) -> None:
    """image_data / video_data / audio_data: an item, a list of items (nulls allowed), or a
    list of such lists; the first entry alone decides which list shape it is."""
    if isinstance(value, (str, dict)):
        _check_media_item(value)
        return
    if not isinstance(value, list):
        raise invalid_type(value, "one of the MediaInput shapes")
    if value and isinstance(value[0], list):
        for row in value:
            if row is not None:
                _check_media_items(row)
        return
    _check_media_items(value)


_STRING_OR_LIST = or_list(check_str, "a string", "StringOrList")
_SAMPLING: dict[str, Check] = {
    "max_new_tokens": check_int,
    "stop": _STRING_OR_LIST,
    "stop_token_ids": list_of(check_int, "i64"),
    "stop_regex": _STRING_OR_LIST,
    "temperature": check_float,
    "top_p": check_float,
    "top_k": check_int,
    "min_p": check_float,
    "frequency_penalty": check_float,
    "presence_penalty": check_float,
    "repetition_penalty": check_float,
    "min_new_tokens": check_int,
    "n": check_int,
    "json_schema": check_str,
    "regex": check_str,
    "ebnf": check_str,
    "structural_tag": check_str,
    "ignore_eos": check_bool,
    "skip_special_tokens": check_bool,
    "spaces_between_special_tokens": check_bool,
    "no_stop_trim": check_bool,
    "stream_interval": check_int,
    "logit_bias": map_of(check_float, "f64"),
    "sampling_seed": check_int,
    "custom_params": _accept,
    "beam_width": check_int,
    "watermark": check_watermark,
    "choice": list_of(check_str, "a string"),
}
check_sampling_params = check_struct(_SAMPLING, SAMPLING_FIELDS, "SamplingParams")


def check_sampling_params_or_list(value: Any) -> None:
    if isinstance(value, list):
        for item in value:
            check_sampling_params(item)
        return
    check_map(value, "a value or an array of values for SamplingParamsOrList")
    check_sampling_params(value)


_GENERATE: dict[str, Check] = {
    "rid": _STRING_OR_LIST,
    "text": _STRING_OR_LIST,
    "input_ids": check_token_ids_or_list,
    "stream": check_bool,
    "sampling_params": check_sampling_params_or_list,
    "return_logprob": or_list(check_bool, "a boolean", "BoolOrList"),
    "logprob_start_len": or_list(check_int, "i64", "Int64OrList"),
    "top_logprobs_num": or_list(check_int, "i64", "Int64OrList"),
    "token_ids_logprob": check_token_ids_or_list,
    "return_hidden_states": or_list(check_bool, "a boolean", "BoolOrList"),
    "return_text_in_logprobs": check_bool,
    "bootstrap_host": optional_or_list(check_str, "a string", "OptionalStringOrList"),
    "bootstrap_port": optional_or_list(check_int, "i64", "OptionalInt64OrList"),
    "bootstrap_room": optional_or_list(check_int, "i64", "OptionalInt64OrList"),
    "bootstrap_pair_key": optional_or_list(check_str, "a string", "OptionalStringOrList"),
    "decode_tp_size": optional_or_list(check_int, "i64", "OptionalInt64OrList"),
    "routed_dp_rank": check_int,
    "disagg_prefill_dp_rank": check_int,
    "image_data": check_media_input,
    "mm_hashes": string_list_or_list,
    "video_data": check_media_input,
    "audio_data": check_media_input,
    "extra_key": _STRING_OR_LIST,
    "priority": check_int,
    "cache_salt": _STRING_OR_LIST,
    "require_reasoning": check_bool,
    "lora_path": optional_or_list(check_str, "a string", "OptionalStringOrList"),
    "session_params": _accept,
    "kv_hints": _accept,
    "routing_key": check_str,
    "max_thinking_tokens": check_uint,
    "session_id": check_str,
    "custom_logit_processor": optional_or_list(check_str, "a string", "OptionalStringOrList"),
    "custom_labels": map_of(check_str, "a string"),
    "images_config": _accept,
    "return_sampling_mask": or_list(check_bool, "a boolean", "BoolOrList"),
    "modalities": check_optional_string_list,
}
# keys that must not be null (no `None if x is None` in the contract)
_NOT_NULL: dict[str, Check] = {
    "return_prompt_token_ids": check_bool,
    "routed_experts_start_len": check_int,
}


def check_generate_request(body: Any) -> None:
    """Raise SchemaViolation when SGLang's contract would reject this /generate body.

    Top-level unknown keys are ignored (as in SGLang); keys are checked in body order, so the
    first violation reported is the one SGLang reports.
    """
    for key, value in check_map(body, "struct GenerateRequest").items():
        strict = _NOT_NULL.get(key)
        if strict is not None:
            strict(value)
            continue
        field_check = _GENERATE.get(key)
        if field_check is not None and value is not None:
            field_check(value)

"""The body of an HTTP 200 from SGLang's `POST /generate`, decoded and checked into a
GenerateResult: an abort is an error, a malformed body a RetryableError, never a success."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from app.core.contracts import GenerateResult, SpecStats
from app.core.errors import RetryableError
from app.sglang.errors import map_abort, trim_message

logger = logging.getLogger(__name__)


def _malformed(why: str) -> RetryableError:
    return RetryableError(f"malformed /generate response: {why}", status_code=200)


def _is_int_list(value: Any) -> bool:
    # set(map(type, ...)) runs in C: ~20 ns an id, so checking 8K ids costs ~0.15 ms; bool is
    # its own type, so true/false never pass as ids.
    return type(value) is list and set(map(type, value)) <= {int}


def _int_list(value: Any, name: str) -> list[int]:
    if not _is_int_list(value):
        raise _malformed(f"{name} is not a list of ints")
    ids: list[int] = value
    return ids


def _int_field(meta: Mapping[str, Any], key: str, default: int) -> int:
    value = meta.get(key)
    if value is None:
        return default
    if type(value) is not int or value < 0:
        raise _malformed(f"meta_info.{key} is not a count")
    return value


def _matched(value: Any) -> int | str | None:
    # SGLang reports the matched stop as a token id, a stop string, or a list of token ids
    # (a multi-token stop); one id is kept as an int, a longer list as its JSON text.
    if value is None or isinstance(value, str) or type(value) is int:
        return value
    if _is_int_list(value):
        return value[0] if len(value) == 1 else json.dumps(value)
    raise _malformed("finish_reason.matched has an unknown shape")


def _span_versions(spans: Any) -> tuple[str, ...]:
    """The versions of meta_info.weight_versions ([{"version", "start", "end"}]), in order."""
    if not isinstance(spans, list):
        return ()
    return tuple(
        str(s["version"])
        for s in spans
        if isinstance(s, dict) and isinstance(s.get("version"), str)
    )


def parse_generate_response(
    content: bytes,
    rid: str,
    *,
    prompt_tokens_sent: int,
    elapsed_s: float,
) -> GenerateResult:
    """Decode and check the body of an HTTP 200 from `POST /generate` (non-streaming).

    Raises the error of `map_abort` for an aborted request and RetryableError for a body that
    is not a complete single response for `rid` (bad JSON, wrong shapes, another rid).
    `elapsed_s` stands in for the server's `e2e_latency` when the server does not send one.
    """
    try:
        data = json.loads(content)
    except ValueError as exc:
        raise _malformed(
            f"not JSON ({trim_message(content[:200].decode('utf-8', 'replace'))})"
        ) from exc
    if not isinstance(data, dict):
        raise _malformed(f"expected an object, got {type(data).__name__}")
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        raise _malformed("no meta_info object")
    echoed_rid = meta.get("id")
    if echoed_rid is not None and echoed_rid != rid:
        raise _malformed(f"meta_info.id {str(echoed_rid)[:80]!r} is not the rid sent {rid!r}")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict):
        raise _malformed("no meta_info.finish_reason object")
    finish_type = finish.get("type")
    if finish_type == "abort":
        raise map_abort(finish)
    if finish_type not in ("stop", "length"):
        raise _malformed(f"unknown finish_reason.type {str(finish_type)[:40]!r}")

    output_ids = _int_list(data.get("output_ids"), "output_ids")
    echoed_prompt = data.get("prompt_token_ids")
    prompt_token_ids = (
        None if echoed_prompt is None else _int_list(echoed_prompt, "prompt_token_ids")
    )
    completion_tokens = _int_field(meta, "completion_tokens", len(output_ids))
    if completion_tokens != len(output_ids):
        # output_ids is what gets stored; the count is only reported, so say it and go on.
        logger.warning(
            "rid %s: completion_tokens %d but %d output_ids",
            rid,
            completion_tokens,
            len(output_ids),
            extra={"action": "token_count_mismatch"},
        )
    e2e_latency = meta.get("e2e_latency")
    weight_version = meta.get("weight_version")
    text = data.get("text")
    return GenerateResult(
        rid=rid,
        output_ids=output_ids,
        finish_reason="stop" if finish_type == "stop" else "length",
        matched_stop=_matched(finish.get("matched")) if finish_type == "stop" else None,
        prompt_tokens=_int_field(meta, "prompt_tokens", prompt_tokens_sent),
        completion_tokens=completion_tokens,
        cached_tokens=_int_field(meta, "cached_tokens", 0),
        e2e_latency_s=(
            float(e2e_latency)
            if isinstance(e2e_latency, int | float) and not isinstance(e2e_latency, bool)
            else elapsed_s
        ),
        weight_version=weight_version if isinstance(weight_version, str) else None,
        weight_versions=_span_versions(meta.get("weight_versions")),
        prompt_token_ids=prompt_token_ids,
        text=text if isinstance(text, str) else "",
        spec=_spec_stats(meta),
    )


def _number(meta: Mapping[str, Any], key: str) -> float:
    value = meta.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _malformed(f"meta_info.{key} is not a number")
    if not 0 <= value < float("inf"):
        raise _malformed(f"meta_info.{key} is not a non-negative number")
    return float(value)


def _spec_stats(meta: Mapping[str, Any]) -> SpecStats | None:
    """The speculative-decoding fields SGLang adds to a finished request that had a verify
    step (`TokenizerManager._calculate_spec_decoding_metrics`); None when there are none."""
    if meta.get("spec_verify_ct") is None:
        return None
    histogram = meta.get("spec_correct_drafts_histogram")
    if histogram is None:
        histogram = []
    if not _is_int_list(histogram) or any(n < 0 for n in histogram):
        raise _malformed("meta_info.spec_correct_drafts_histogram is not a list of counts")
    return SpecStats(
        verify_ct=_int_field(meta, "spec_verify_ct", 0),
        num_correct_drafts=_int_field(meta, "spec_num_correct_drafts", 0),
        num_proposed_drafts=_int_field(meta, "spec_num_proposed_drafts", 0),
        accept_length=_number(meta, "spec_accept_length"),
        accept_rate=_number(meta, "spec_accept_rate"),
        histogram=tuple(histogram),
    )

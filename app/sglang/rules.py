"""SGLang 0.5.23's request rules after its schema gate (app.sglang.schema): the context-length
checks and SamplingParams.verify, with SGLang's 400 texts, for the client and the emulator alike.

Read from the wheel's `managers/tokenizer_manager.py` `_validate_one_request` and
`sampling/sampling_params.py` `verify`; the conformance tests hold both to it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from app.core.errors import TokenmillError

TEXT_UNSUPPORTED = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)
QUEUE_FULL = "The request queue is full."
TOP_K_ALL = 1 << 30  # SGLang's top_k for "the whole vocabulary"
# SGLang treats temperatures below this as greedy (top_k = 1).
GREEDY_TEMPERATURE = 1e-6


class InvalidRequest(TokenmillError, ValueError):
    """SGLang rejects the request after its schema gate: HTTP 400 `{"error": {"message": ...}}`."""


def validate_item(
    input_ids: list[int], sampling: Mapping[str, Any], context_length: int, vocab_size: int | None
) -> None:
    """The per-prompt checks SGLang runs after tokenization: context length, then sampling."""
    if not input_ids:
        raise InvalidRequest("input_ids cannot be empty.")
    input_len, context = len(input_ids), context_length
    if input_len >= context:
        raise InvalidRequest(
            f"The input ({input_len} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    max_new_tokens = sampling.get("max_new_tokens")
    if max_new_tokens is not None and max_new_tokens + input_len > context:
        raise InvalidRequest(
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {max_new_tokens + input_len} tokens: {input_len} "
            f"tokens from the input messages and {max_new_tokens} tokens for the completion. "
            "Please reduce the number of tokens in the input messages or the completion to fit "
            "within the limit."
        )
    verify_sampling(sampling, vocab_size)


def _value(sampling: Mapping[str, Any], key: str, default: Any) -> Any:
    value = sampling.get(key)
    return default if value is None else value


def verify_sampling(sampling: Mapping[str, Any], vocab_size: int | None) -> None:
    """SGLang's SamplingParams.verify, with its texts (after its own defaulting); logit_bias
    keys are checked against vocab_size when it is known (the server always knows it)."""
    temperature = _value(sampling, "temperature", 1.0)
    top_k = _value(sampling, "top_k", -1)
    if 0 <= temperature < GREEDY_TEMPERATURE:
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    top_p = _value(sampling, "top_p", 1.0)
    min_p = _value(sampling, "min_p", 0.0)
    frequency_penalty = _value(sampling, "frequency_penalty", 0.0)
    presence_penalty = _value(sampling, "presence_penalty", 0.0)
    repetition_penalty = _value(sampling, "repetition_penalty", 1.0)
    min_new_tokens = _value(sampling, "min_new_tokens", 0)
    max_new_tokens = sampling.get("max_new_tokens", 128)
    beam_width = sampling.get("beam_width")

    problems = [
        (
            beam_width is not None and beam_width < 1,
            f"beam_width must be at least 1, got {beam_width}.",
        ),
        (
            not math.isfinite(temperature) or temperature < 0.0,
            f"temperature must be a non-negative finite number, got {temperature}.",
        ),
        (not 0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}."),
        (not 0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}."),
        (top_k < 1, f"top_k must be -1 (disable) or at least 1, got {top_k}."),
        (
            not -2.0 <= frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {frequency_penalty}.",
        ),
        (
            not -2.0 <= presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {presence_penalty}.",
        ),
        (
            not 0.0 < repetition_penalty <= 2.0,
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition_penalty}.",
        ),
        (
            min_new_tokens < 0,
            f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}.",
        ),
    ]
    if max_new_tokens is not None:
        problems += [
            (max_new_tokens < 0, f"max_new_tokens must be at least 0, got {max_new_tokens}."),
            (
                min_new_tokens > max_new_tokens,
                f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got "
                f"{min_new_tokens}.",
            ),
        ]
    for failed, message in problems:
        if failed:
            raise InvalidRequest(message)
    _verify_extras(sampling, vocab_size)


def _verify_extras(sampling: Mapping[str, Any], vocab_size: int | None) -> None:
    for token_id in sampling.get("logit_bias") or {}:
        try:
            key = int(token_id)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        if vocab_size is not None and not 0 <= key < vocab_size:
            raise InvalidRequest(
                f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}."
            )
    seed = sampling.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise InvalidRequest(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    grammars = ("json_schema", "regex", "ebnf", "structural_tag")
    if sum(bool(sampling.get(key)) for key in grammars) > 1:
        raise InvalidRequest("Only one of json_schema, regex, ebnf, or structural_tag can be set.")

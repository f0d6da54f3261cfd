"""The emulator's /generate protocol: a JSON body becomes request items; results become SGLang JSON.

Mirrors SGLang 0.5.23's normalization (single vs batch, rid expansion, n) and its 400 texts.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.sglang.rules import TEXT_UNSUPPORTED, InvalidRequest, validate_item
from app.sglang.schema import check_generate_request
from emulator.config import EmulatorConfig
from emulator.image_data import images_per_prompt
from emulator.image_prompt import ImageProcessor, ServedPrompt, text_prompt
from emulator.model import FinishReason, reasoning_token_count, render_text


def waiting_abort() -> FinishReason:
    """The finish reason of a request aborted before it was scheduled."""
    return {"type": "abort", "message": "Abort in waiting queue"}


def running_abort(message: str = "Aborted", status_code: int | None = None) -> FinishReason:
    """The finish reason of a request aborted while it ran (SGLang's FINISH_ABORT)."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


@dataclass(frozen=True, slots=True)
class ItemRequest:
    """One prompt of a /generate call, after batch and n expansion."""

    rid: str
    input_ids: list[int]
    sampling: Mapping[str, Any]
    sample_index: int = 0
    return_prompt_token_ids: bool = False
    require_reasoning: bool = False
    internal: bool = False
    # with images: the ids with image tokens keyed by content (prefix cache, output seed),
    # and each image's (first position, token count)
    image_key_ids: list[int] | None = None
    image_spans: tuple[tuple[int, int], ...] = ()
    # with images: the ids as the request sent them (input_ids are the served ones)
    sent_ids: list[int] | None = None
    # the request's `priority` (None: it named none); orders the waiting queue only on a
    # server with priority scheduling, as SGLang's
    priority: int | None = None

    @property
    def key_ids(self) -> list[int]:
        """The ids the prefix cache and the output seed see (input_ids when it has no image)."""
        return self.input_ids if self.image_key_ids is None else self.image_key_ids

    @property
    def image_tokens(self) -> int:
        return sum(count for _, count in self.image_spans)

    @property
    def skip_special_tokens(self) -> bool:
        return self.sampling.get("skip_special_tokens") is not False


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """A parsed /generate body: its items in response order."""

    items: list[ItemRequest]
    is_single: bool
    stream: bool


def parse_generate(
    body: Any, cfg: EmulatorConfig, images: ImageProcessor | None = None
) -> GenerateCall:
    """Check and normalize a /generate body as SGLang does; with an image processor (a
    multimodal server), each prompt's images are read and its placeholders expanded first.

    Raises SchemaViolation (400 `{"error": text}`), InvalidRequest or ImageInputError (400
    `{"error": {"message": text}}`) or ImageServerError (500), with SGLang's texts, in SGLang's
    order of checks. A text-only server ignores image_data.
    """
    check_generate_request(body)
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise InvalidRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        raise InvalidRequest(TEXT_UNSUPPORTED)
    if len(input_ids) == 0:
        raise InvalidRequest("input_ids cannot be empty.")

    is_single = isinstance(input_ids[0], int)
    prompts: list[list[int]] = [input_ids] if is_single else input_ids
    samplings = _per_prompt_sampling(body.get("sampling_params"), len(prompts))
    n = _parallel_sample_num(samplings)
    is_single = is_single and n == 1
    rids = _rids(body.get("rid"), len(prompts), is_single, n)
    common = {
        "return_prompt_token_ids": bool(body.get("return_prompt_token_ids")),
        "require_reasoning": bool(body.get("require_reasoning")),
        "priority": body.get("priority"),
    }
    served = _served_prompts(body, prompts, images)
    items = []
    for index, (prompt, sampling) in enumerate(zip(served, samplings, strict=True)):
        validate_item(prompt.ids, sampling, cfg.checked_context, cfg.vocab_size)
        with_images = bool(prompt.spans)
        for sample in range(n):
            rid = rids[index * n + sample]
            items.append(
                ItemRequest(
                    rid,
                    prompt.ids,
                    sampling,
                    sample_index=sample,
                    image_key_ids=prompt.key_ids if with_images else None,
                    image_spans=prompt.spans,
                    sent_ids=prompts[index] if with_images else None,
                    **common,
                )
            )
    return GenerateCall(items=items, is_single=is_single, stream=bool(body.get("stream")))


def _served_prompts(
    body: Mapping[str, Any], prompts: list[list[int]], images: ImageProcessor | None
) -> list[ServedPrompt]:
    """Each prompt as the server serves it: as sent on a text-only server (image_data is
    ignored), else through the image processor."""
    is_single = isinstance(body["input_ids"][0], int)
    # the batch shape is checked whatever the model (SGLang normalizes it before tokenizing)
    per_prompt = images_per_prompt(body.get("image_data"), len(prompts), is_single)
    if images is None:
        return [text_prompt(prompt) for prompt in prompts]
    mm_hashes = body.get("mm_hashes")
    return [
        images.serve(prompt, items, mm_hashes)
        for prompt, items in zip(prompts, per_prompt, strict=True)
    ]


def _per_prompt_sampling(value: Any, batch_size: int) -> list[Mapping[str, Any]]:
    if value is None:
        return [{}] * batch_size
    if isinstance(value, dict):
        return [value] * batch_size
    if len(value) != batch_size:
        raise InvalidRequest("The length of sampling_params should be equal to the batch size.")
    return list(value)


def _parallel_sample_num(samplings: list[Mapping[str, Any]]) -> int:
    n = samplings[0].get("n") or 1
    if any((sampling.get("n") or 1) != n for sampling in samplings):
        raise InvalidRequest(
            "The parallel_sample_num should be the same for all samples in sample params."
        )
    return max(int(n), 1)


def _rids(value: Any, batch_size: int, is_single: bool, n: int) -> list[str]:
    if n > 1:
        # SGLang gives every parallel sample a fresh id
        return [uuid.uuid4().hex for _ in range(batch_size * n)]
    if is_single:
        if isinstance(value, list):
            if len(value) != 1:
                raise InvalidRequest("The rid should be a string or a list of strings.")
            return [value[0]]
        return [value if value is not None else uuid.uuid4().hex]
    if value is None:
        return [uuid.uuid4().hex for _ in range(batch_size)]
    if isinstance(value, str):
        return [f"{value}_{i}" for i in range(batch_size)]
    if len(value) != batch_size:
        raise InvalidRequest(
            "The specified rids length mismatch with the batch_size for batch processing."
        )
    return list(value)


# --- responses ------------------------------------------------------------------------


def generate_response(
    item: ItemRequest,
    output_ids: list[int],
    finish_reason: FinishReason | None,
    cfg: EmulatorConfig,
    *,
    cached_tokens: int = 0,
    e2e_latency_s: float | None = None,
    spec_meta: dict[str, Any] | None = None,
    weight_version: str | None = None,
    weight_versions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One /generate answer (or a stream event while finish_reason is None), as SGLang shapes it.
    spec_meta: the finished request's speculative-decoding fields; weight_version: the server's
    now (None: cfg's); weight_versions: a finished request's spans of output per version, the
    last of which is then its weight_version."""
    reasoning = reasoning_token_count(output_ids, cfg) if item.require_reasoning else 0
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": finish_reason,
        "prompt_tokens": len(item.input_ids),
        "weight_version": cfg.weight_version if weight_version is None else weight_version,
        "num_retractions": 0,
        "reasoning_tokens": reasoning,
        "completion_tokens": len(output_ids),
        "cached_tokens": cached_tokens,
    }
    if item.image_tokens:
        meta["image_tokens"] = item.image_tokens
    if spec_meta:
        meta.update(spec_meta)
    if weight_versions:
        meta["weight_versions"] = weight_versions
        meta["weight_version"] = weight_versions[-1]["version"]
    if e2e_latency_s is not None:
        meta["e2e_latency"] = e2e_latency_s
        meta["response_sent_to_client_ts"] = time.time()
    return _with_prompt(
        item,
        {
            "text": render_text(output_ids, cfg, skip_special_tokens=item.skip_special_tokens),
            "output_ids": output_ids,
            "meta_info": meta,
        },
    )


def waiting_abort_response(
    item: ItemRequest,
    cfg: EmulatorConfig,
    e2e_latency_s: float,
    finish_reason: FinishReason | None = None,
    weight_version: str | None = None,
) -> dict[str, Any]:
    """The answer of a request aborted before it was scheduled (SGLang's shorter meta_info,
    with the one empty span of the version it was aborted under)."""
    version = cfg.weight_version if weight_version is None else weight_version
    meta = {
        "id": item.rid,
        "finish_reason": finish_reason or waiting_abort(),
        "weight_version": version,
        "e2e_latency": e2e_latency_s,
        "completion_tokens": 0,
        "weight_versions": [{"version": version, "start": 0, "end": 0}],
    }
    return _with_prompt(item, {"text": "", "output_ids": [], "meta_info": meta})


def _with_prompt(item: ItemRequest, response: dict[str, Any]) -> dict[str, Any]:
    if item.return_prompt_token_ids:
        response["prompt_token_ids"] = item.input_ids
    return response


def error_object(message: str, status: int) -> dict[str, Any]:
    """SGLang's ErrorResponse body (queue full, scheduler aborts with a status)."""
    return {
        "object": "error",
        "message": message,
        "type": str(status),
        "param": None,
        "code": status,
    }


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()

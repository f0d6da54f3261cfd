"""Typed values that cross module boundaries: sampling parameters, prompts, results.

Plain dataclasses with no I/O, so every layer (producer, client, workers, export) agrees.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from app.core.images import ImageRef

Message = dict[str, Any]
FinishType = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """The full sampling configuration of a run, sent explicitly on every request.

    Servers fill unspecified values from the model's generation_config.json, so every value
    the data depends on is sent, never left to the server.
    """

    max_new_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # cycles (`--temperature 0.6,0.8,1.0`): sample k takes the k-th value modulo the list;
    # empty: every sample takes the single value above
    temperature_cycle: tuple[float, ...] = ()
    top_p_cycle: tuple[float, ...] = ()
    min_p_cycle: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        for t in (self.temperature, *self.temperature_cycle):
            if t < 0:
                raise ValueError("temperature must be >= 0")
        for p in (self.top_p, *self.top_p_cycle):
            if not 0 < p <= 1:
                raise ValueError("top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        for m in (self.min_p, *self.min_p_cycle):
            if not 0 <= m <= 1:
                raise ValueError("min_p must be in [0, 1]")

    def for_sample(self, sample_index: int, row: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The `sampling_params` body for sample k: the k-th value of each cycle, seed + k when
        a seed is pinned, then the row's own `sampling_params` over them (a row's
        `sampling_seed` S gives sample k the seed S + k)."""
        body: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": _pick(self.temperature_cycle, sample_index, self.temperature),
            "top_p": _pick(self.top_p_cycle, sample_index, self.top_p),
            "top_k": self.top_k,
            "min_p": _pick(self.min_p_cycle, sample_index, self.min_p),
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            body["sampling_seed"] = self.seed + sample_index
        for key, value in (row or {}).items():
            body[key] = value + sample_index if key == "sampling_seed" else value
        return body

    @property
    def cycles(self) -> dict[str, list[float]]:
        """The cycled settings and their values (empty when nothing cycles)."""
        named = {
            "temperature": self.temperature_cycle,
            "top_p": self.top_p_cycle,
            "min_p": self.min_p_cycle,
        }
        return {name: list(values) for name, values in named.items() if values}

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["stop_token_ids"] = list(self.stop_token_ids)
        # a run without cycles reads as it did before they existed (later enqueues compare)
        for name in _CYCLES:
            if data[name]:
                data[name] = list(data[name])
            else:
                del data[name]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SamplingParams:
        data = dict(data)
        data["stop_token_ids"] = tuple(data.get("stop_token_ids") or ())
        for name in _CYCLES:
            data[name] = tuple(data.get(name) or ())
        return cls(**data)


_CYCLES = ("temperature_cycle", "top_p_cycle", "min_p_cycle")


def _pick(cycle: tuple[float, ...], sample_index: int, single: float) -> float:
    return cycle[sample_index % len(cycle)] if cycle else single


@dataclass(frozen=True)
class PromptRecord:
    """One usable input line: either chat turns to template, or pre-tokenized ids."""

    line: int
    key: str
    messages: list[Message] | None = None
    input_ids: list[int] | None = None
    # every turn of the line, trailing assistant turns included, when messages dropped some
    # (`--turns all` regenerates those too)
    conversation: list[Message] | None = None
    # the row's tool declarations (a `tools` list, or a JSON string of one, parsed), passed
    # to the template as `tools=`; None when the row has none
    tools: list[dict[str, Any]] | None = None
    # the row's template kwargs (its `chat_template_kwargs`, and a `reasoning_effort`), merged
    # over the run's when the prompt is rendered; None when the row has none
    chat_template_kwargs: dict[str, Any] | None = None
    # the row's `reasoning_effort` (a template input as SGLang treats a request's; see
    # app.prompts.chat_path.merge_template_kwargs)
    reasoning_effort: str | float | None = None
    # the row's other top-level fields (source, category, ...): not template inputs, kept
    # and exported with each sample; None when the row has none
    metadata: dict[str, Any] | None = None
    # the top-level fields the prompt was built from (prompt field, id, system, tools, ...)
    prompt_fields: tuple[str, ...] = ()
    # the first turn that cannot be used (its position and why); the turns stop before it:
    # read_prompts refuses the line unless `--turns each` keeps the boundaries before it
    bad_turn: tuple[int, str] | None = None
    # the bad turn is among the trailing assistant turns that a `--turns last` prompt drops
    bad_turn_in_tail: bool = False
    # the row's own `sampling_params`, merged over the run's for each of its samples
    sampling_params: dict[str, Any] | None = None
    # the sample indices this record makes (a `--reasoning-effort` cycle templates a row once
    # per effort); None: every sample of the run
    samples: tuple[int, ...] | None = None
    # the images of the turns (conversation, else messages) in prompt order, once stored at
    # enqueue (workers.intake.images); their image parts then hold the store keys
    images: tuple[ImageRef, ...] = ()
    # the row's continue_final_message applied (app.prompts.request_fields.assistant_prefix):
    # the final assistant turn's text, which messages then leave out, appended after the
    # generation prompt as SGLang appends it; None: a prompt without one
    assistant_prefix: str | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.input_ids is None):
            raise ValueError("a PromptRecord holds exactly one of messages or input_ids")


@dataclass(frozen=True)
class SpecStats:
    """A finished request's speculative-decoding counters, as SGLang's meta_info reports them
    (`spec_verify_ct` verify steps, accepted and proposed drafts, the per-step histogram)."""

    verify_ct: int
    num_correct_drafts: int
    num_proposed_drafts: int
    accept_length: float
    accept_rate: float
    histogram: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerateResult:
    """What the server returned for one successful request (finish reason stop or length)."""

    rid: str
    output_ids: list[int]
    finish_reason: FinishType
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency_s: float
    weight_version: str | None = None
    prompt_token_ids: list[int] | None = None
    text: str = ""
    # speculative decoding's counters (None: the server does not speculate, or no verify step)
    spec: SpecStats | None = None
    # every version the output tokens came under (meta_info.weight_versions; empty when the
    # server does not report spans), and the sampling_params body the request carried
    weight_versions: tuple[str, ...] = ()
    sampling_params: dict[str, Any] | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True)
class ServerFingerprint:
    """The server configuration a run pins: data from two configurations is never mixed."""

    model_path: str | None = None
    weight_version: str | None = None
    reasoning_parser: str | None = None
    version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # the speculative-decoding settings from /server_info (algorithm, draft model path, draft
    # tokens, steps, top-k); None when the server does not speculate
    speculative: dict[str, Any] | None = None
    # the image settings from /server_info (app.core.images.image_settings) of a server whose
    # /model_info says `has_image_understanding: true`; None: the server reads no images
    images: dict[str, Any] | None = None
    # the request limits from /server_info (app.sglang.limits.limits_of): context_length,
    # max_req_input_len, max_total_num_tokens; never compared as equal or not (a limit that
    # grows is no drift): a run checks whether they admit its largest request
    limits: dict[str, int] | None = None

    @property
    def reads_images(self) -> bool:
        """Whether the server understands images (only such servers get image items)."""
        return self.images is not None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "model_path": self.model_path,
            "weight_version": self.weight_version,
            "reasoning_parser": self.reasoning_parser,
            "version": self.version,
        }
        # only when set: a run pinned by a server that does not speculate keeps its old form
        if self.speculative is not None:
            data["speculative"] = self.speculative
        # the same for a server that reads no images
        if self.images is not None:
            data["images"] = self.images
        # and for a server that reports no limits
        if self.limits is not None:
            data["limits"] = self.limits
        return data

    def differences(self, other: ServerFingerprint) -> list[str]:
        """Human lines like "reasoning_parser: None → kimi_k2" for every field that differs,
        and "images.mm_process_config: A → B" for every image setting that does. The limits
        are not among them: whether they admit a run's requests is app.sglang.limits.refusal's.

        Image settings are compared only when both servers read images: one that reads none
        serves a run's text items alone, and image settings do not change those."""
        mine, theirs = self.to_json(), other.to_json()
        mine.pop("limits", None), theirs.pop("limits", None)
        mine_images, their_images = mine.pop("images", None), theirs.pop("images", None)
        keys = [*mine, *(k for k in theirs if k not in mine)]
        lines = [
            f"{k}: {mine.get(k)} → {theirs.get(k)}" for k in keys if mine.get(k) != theirs.get(k)
        ]
        if mine_images is not None and their_images is not None:
            names = [*mine_images, *(k for k in their_images if k not in mine_images)]
            lines += [
                f"images.{k}: {mine_images.get(k)} → {their_images.get(k)}"
                for k in names
                if mine_images.get(k) != their_images.get(k)
            ]
        return lines


def stable_hash(value: Any) -> str:
    """sha256 of the canonical JSON form of a value (item keys, config hashes)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()

"""Emulated speculative decoding: SGLang 0.5.23's EAGLE settings, per-request acceptance and the
`spec_*` fields of meta_info, and the request log that records what each answer was drawn from.

Acceptance is a pure function of (prompt ids, sampling, draft path, --spec-accept): the output
ids stay the target's (greedy speculative decoding is lossless), only the counts change.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

# The algorithms whose draft settings follow SGLang's EAGLE family rules (arg_groups/
# speculative_hook.py `_handle_eagle_family`); NEXTN is EAGLE's alias there.
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN")
# (num_steps, eagle_topk, num_draft_tokens) SGLang picks for a DeepseekV3-architecture target
# (Kimi-K2.5 is one) when --speculative-num-steps is not given
AUTO_PARAMS = (3, 1, 4)
# Part of every acceptance seed: a change to how acceptance is drawn must change this.
ACCEPTANCE_VERSION = b"tokenmill-emulator-spec/1"
# How strongly a prompt's share of repeated token trigrams moves acceptance (logit units per unit of
# share): repetitive prompts (code, templated text) are easier for a draft, as in practice.
REPEAT_NGRAM = 3
REPETITION_WEIGHT = 2.0
REPETITION_CENTER = 0.3
# A draft's own strength on each of REPETITION_BUCKETS kinds of prompt (logit offsets drawn
# uniformly in +-DRAFT_KIND_SPAN from the draft path), and its per-prompt noise (sd, logits).
REPETITION_BUCKETS = 4
DRAFT_KIND_SPAN = 0.6
DRAFT_PROMPT_SD = 0.25


@dataclass(frozen=True)
class SpecSettings:
    """The resolved speculative settings of an emulated server (what /server_info reports)."""

    algorithm: str
    draft_model_path: str
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    accept: float

    def server_args(self) -> dict[str, Any]:
        return {
            "speculative_algorithm": self.algorithm,
            "speculative_draft_model_path": self.draft_model_path,
            "speculative_num_steps": self.num_steps,
            "speculative_eagle_topk": self.eagle_topk,
            "speculative_num_draft_tokens": self.num_draft_tokens,
        }


def resolve_settings(
    algorithm: str | None,
    draft_model_path: str | None,
    num_steps: int | None,
    eagle_topk: int | None,
    num_draft_tokens: int | None,
    accept: float,
) -> SpecSettings | None:
    """SGLang 0.5.23's resolution of the EAGLE-family flags, or ValueError naming the flag.

    Without --speculative-num-steps, topk and draft tokens must be absent too (SGLang asserts
    it) and (3, 1, 4) is chosen; with topk 1, draft tokens become num_steps + 1.
    """
    if algorithm is None:
        if draft_model_path or num_steps or eagle_topk or num_draft_tokens:
            raise ValueError("the --speculative-* settings need --speculative-algorithm")
        return None
    algorithm = algorithm.upper()
    if algorithm not in EAGLE_FAMILY:
        raise ValueError(
            f"--speculative-algorithm {algorithm}: the emulator has {', '.join(EAGLE_FAMILY)}"
        )
    if not draft_model_path:
        raise ValueError(
            f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path"
        )
    if not 0 <= accept < 1:
        raise ValueError("--spec-accept must be in [0, 1)")
    if num_steps is None:
        if eagle_topk is not None or num_draft_tokens is not None:
            raise ValueError(
                "--speculative-eagle-topk and --speculative-num-draft-tokens need "
                "--speculative-num-steps (SGLang 0.5.23 asserts that without num_steps both are "
                "unset, then chooses all three)"
            )
        num_steps, eagle_topk, num_draft_tokens = AUTO_PARAMS
    topk = 1 if eagle_topk is None else eagle_topk
    if num_steps < 1 or topk < 1:
        raise ValueError("--speculative-num-steps and --speculative-eagle-topk must be >= 1")
    if topk == 1 or num_draft_tokens is None:
        num_draft_tokens = num_steps + 1
    if num_draft_tokens < 2:
        raise ValueError("--speculative-num-draft-tokens must be at least 2")
    return SpecSettings(algorithm, draft_model_path, num_steps, topk, num_draft_tokens, accept)


def repetition_share(input_ids: Sequence[int]) -> float:
    """The share of the prompt's token trigrams that repeat an earlier one (0: all distinct):
    text that repeats itself (code, templated or quoted text) is what drafts predict best."""
    size = REPEAT_NGRAM
    grams = [tuple(input_ids[i : i + size]) for i in range(len(input_ids) - size + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def _unit(*parts: bytes) -> random.Random:
    digest = hashlib.blake2b(ACCEPTANCE_VERSION, digest_size=16)
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return random.Random(int.from_bytes(digest.digest(), "big"))


def _ids_key(input_ids: Sequence[int]) -> bytes:
    return ",".join(map(str, input_ids)).encode()


def acceptance_probability(input_ids: Sequence[int], spec: SpecSettings) -> float:
    """The chance that each next draft token is accepted, for this prompt and this draft."""
    share = repetition_share(input_ids)
    kind = min(int(share * REPETITION_BUCKETS), REPETITION_BUCKETS - 1)
    draft = spec.draft_model_path.encode()
    kind_offset = (_unit(draft, b"kind", str(kind).encode()).random() * 2 - 1) * DRAFT_KIND_SPAN
    noise = _unit(draft, b"prompt", _ids_key(input_ids)).gauss(0.0, DRAFT_PROMPT_SD)
    base = math.log(spec.accept / (1 - spec.accept)) if spec.accept > 0 else -30.0
    logit = base + REPETITION_WEIGHT * (share - REPETITION_CENTER) + kind_offset + noise
    return 1.0 / (1.0 + math.exp(-logit))


def expected_step_tokens(probability: float, num_steps: int) -> float:
    """Tokens one verify step commits on average: the bonus plus each draft while accepted."""
    return sum(probability**depth for depth in range(num_steps + 1))


@dataclass(frozen=True)
class SpecDraw:
    """What one finished request's speculative decoding did (SGLang's counters)."""

    probability: float
    verify_ct: int
    correct: int
    histogram: list[int]


def draw_steps(
    input_ids: Sequence[int],
    completion_tokens: int,
    spec: SpecSettings,
    *,
    seed: int,
) -> SpecDraw:
    """The verify steps of an output: the prefill gives the first token, then each step commits
    its accepted drafts plus one, counted before the output is trimmed (as SGLang counts)."""
    probability = acceptance_probability(input_ids, spec)
    rng = _unit(spec.draft_model_path.encode(), b"steps", str(seed).encode())
    histogram: list[int] = []
    verify_ct = correct = 0
    remaining = completion_tokens - 1
    while remaining > 0:
        accepted = 0
        while accepted < spec.num_steps and rng.random() < probability:
            accepted += 1
        if len(histogram) <= accepted:
            histogram.extend([0] * (accepted + 1 - len(histogram)))
        histogram[accepted] += 1
        verify_ct += 1
        correct += accepted
        remaining -= accepted + 1
    return SpecDraw(probability, verify_ct, correct, histogram)


def meta_fields(draw: SpecDraw, completion_tokens: int, spec: SpecSettings) -> dict[str, Any]:
    """The `spec_*` meta_info fields, by `TokenizerManager._calculate_spec_decoding_metrics`:
    none without a verify step (a one-token output)."""
    if draw.verify_ct == 0:
        return {}
    proposed = draw.verify_ct * (spec.num_draft_tokens - 1)
    fields: dict[str, Any] = {
        "spec_accept_rate": draw.correct / proposed,
        "spec_accept_length": completion_tokens / draw.verify_ct,
        "spec_num_correct_drafts": draw.correct,
        "spec_num_proposed_drafts": proposed,
        "spec_verify_ct": draw.verify_ct,
    }
    if any(draw.histogram):
        fields["spec_correct_drafts_histogram"] = list(draw.histogram)
    return fields


class RequestLog:
    """`--request-log FILE`: one JSON line per finished request (an aborted one has none): its
    rid, when it arrived, the input_ids it was sent and the output_ids it generated, its counts,
    and what its speculative counts were drawn from (acceptance probability, expected tokens
    per step)."""

    def __init__(self, path: str | None) -> None:
        self._path = Path(path) if path else None
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        if self._path is None:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self._path.open("a", encoding="utf-8")
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

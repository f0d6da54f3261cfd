"""Per-sample variation at enqueue: a `--reasoning-effort` cycle templates each chat row once
per effort (sample k takes the k-th effort, modulo), and a row's own `sampling_params` is
checked against what each of its samples will send.

The producer calls these at its call sites; the logic stays here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from app.core.contracts import PromptRecord, SamplingParams
from app.core.errors import InputError
from app.prompts.row_sampling import check_samples


def samples_of(record: PromptRecord, samples_per_prompt: int) -> Sequence[int]:
    """The sample indices this record makes: its own share of an effort cycle, or all."""
    return record.samples if record.samples is not None else range(samples_per_prompt)


def expand_efforts(
    records: Sequence[PromptRecord], efforts: Sequence[str | float], samples_per_prompt: int
) -> list[PromptRecord]:
    """One record per effort of the cycle for each chat row without an effort of its own,
    holding the samples that effort makes; others pass as they are (a row's own
    `reasoning_effort` wins over the cycle, and pre-tokenized rows have no template)."""
    if not efforts:
        return list(records)
    out: list[PromptRecord] = []
    for record in records:
        if record.messages is None or record.reasoning_effort is not None:
            out.append(record)
            continue
        for position, effort in enumerate(efforts):
            mine = tuple(k for k in range(samples_per_prompt) if k % len(efforts) == position)
            if mine:
                out.append(replace(record, reasoning_effort=effort, samples=mine))
    return out


def row_error(
    sampling: SamplingParams, record: PromptRecord, samples_per_prompt: int
) -> InputError | None:
    """The record's line error when a sample of it would send what SGLang refuses."""
    try:
        check_samples(sampling, record.sampling_params, samples_per_prompt)
    except InputError as exc:
        return InputError(exc.reason, record.line)
    return None

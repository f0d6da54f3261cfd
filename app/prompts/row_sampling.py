"""A row's own `sampling_params` and the run's cycles: checked as SGLang 0.5.23 checks a
request's (its JSON contract, then SamplingParams.verify on the merged values of each sample).

The checks are SGLang's request rules (app.sglang.schema and app.sglang.rules, both held to the
wheel by the conformance tests), so a row the server would refuse is refused at enqueue with its
line number, before any GPU time is spent.
"""

from __future__ import annotations

import contextlib
from typing import Any

from app.core.contracts import SamplingParams
from app.core.errors import InputError
from app.prompts.chat_path import check_reasoning_effort
from app.sglang.rules import InvalidRequest, verify_sampling
from app.sglang.schema import SchemaViolation, check_sampling_params


def parse_row_sampling(value: Any) -> dict[str, Any] | None:
    """A row's `sampling_params` object as SGLang's JSON contract takes it (unknown keys and
    wrong types refused with its text); `n` is refused: each sample is its own request."""
    if value is None:
        return None
    try:
        check_sampling_params(value)
    except SchemaViolation as exc:
        raise InputError(f"'sampling_params': {exc}") from None
    row = {k: v for k, v in value.items() if v is not None}
    if row.get("n", 1) != 1:
        raise InputError(
            "'sampling_params': n must be 1: each sample is its own request "
            "(use --samples-per-prompt for more samples)"
        )
    return row or None


def check_samples(
    run: SamplingParams,
    row: dict[str, Any] | None,
    samples: int,
    vocab_size: int | None = None,
) -> None:
    """SamplingParams.verify on what every sample of a row will send; InputError otherwise.
    Without vocab_size, logit_bias keys are left for the server to check against its vocabulary."""
    for k in range(samples if row else 0):
        try:
            verify_sampling(run.for_sample(k, row), vocab_size)
        except InvalidRequest as exc:
            raise InputError(f"'sampling_params' (sample {k}): {exc}") from None


def parse_cycle(text: str, name: str) -> tuple[float, ...]:
    """`0.6,0.8,1.0` as numbers; one value is a cycle of one."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"--{name} takes a number or comma-separated numbers, not {text!r}"
        ) from None
    return values


def parse_efforts(text: str | None) -> tuple[str | float, ...]:
    """`none,low,high` as SGLang's reasoning-effort tiers (or numbers from 0 to 0.99)."""
    if text is None:
        return ()
    efforts: list[str | float] = []
    for part in text.split(","):
        value: Any = part.strip()
        with contextlib.suppress(ValueError):  # a number from 0 to 0.99 is an effort too
            value = float(value)
        try:
            checked = check_reasoning_effort(value, "--reasoning-effort")
        except InputError as exc:
            raise ValueError(exc.reason) from None
        if checked is not None:
            efforts.append(checked)
    return tuple(efforts)

"""Sampling per sample and per row: cycles, a row's own sampling_params merged over the run's,
checked as SGLang 0.5.23 checks them (the wheel's own SamplingParams.verify and JSON contract
are the reference), and a reasoning-effort cycle templating a row once per effort."""

from __future__ import annotations

from typing import Any

import pytest

from app.core.contracts import PromptRecord, SamplingParams
from app.core.errors import InputError
from app.prompts.row_sampling import check_samples, parse_cycle, parse_efforts, parse_row_sampling
from emulator.weights import VersionEvent, version_spans
from tests.support.sglang_contract import load_contract, wheel_module
from workers.intake.cycles import expand_efforts, samples_of

RUN = SamplingParams(
    max_new_tokens=64, temperature=0.6, seed=10, temperature_cycle=(0.6, 0.8, 1.0),
    top_p_cycle=(0.9, 1.0), min_p=0.0,
)  # fmt: skip


def test_sample_k_takes_the_kth_value_of_each_cycle_and_seed_plus_k() -> None:
    bodies = [RUN.for_sample(k) for k in range(4)]
    assert [b["temperature"] for b in bodies] == [0.6, 0.8, 1.0, 0.6]
    assert [b["top_p"] for b in bodies] == [0.9, 1.0, 0.9, 1.0]
    assert [b["sampling_seed"] for b in bodies] == [10, 11, 12, 13]
    assert {b["min_p"] for b in bodies} == {0.0}


def test_a_rows_sampling_params_go_over_the_runs_and_its_seed_counts_from_its_own() -> None:
    row = {"temperature": 0.2, "max_new_tokens": 16, "stop": ["END"], "sampling_seed": 500}
    body = RUN.for_sample(2, row)
    assert body["temperature"] == 0.2 and body["max_new_tokens"] == 16
    assert body["stop"] == ["END"] and body["sampling_seed"] == 502
    assert body["top_p"] == 0.9  # not the row's: the run's cycle


def test_a_run_without_cycles_pins_what_it_always_did() -> None:
    plain = SamplingParams(temperature=0.7)
    assert "temperature_cycle" not in plain.to_json()
    assert SamplingParams.from_json(plain.to_json()) == plain
    assert SamplingParams.from_json(RUN.to_json()) == RUN
    assert RUN.cycles == {"temperature": [0.6, 0.8, 1.0], "top_p": [0.9, 1.0]}
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p_cycle=(0.5, 0.0))


def test_cycle_and_effort_flags_parse_or_say_what_is_wrong() -> None:
    assert parse_cycle("0.6,0.8,1.0", "temperature") == (0.6, 0.8, 1.0)
    with pytest.raises(ValueError, match="--temperature takes a number"):
        parse_cycle("0.6,hot", "temperature")
    assert parse_efforts("none,low,high") == ("none", "low", "high")
    assert parse_efforts("0.5") == (0.5,)
    with pytest.raises(ValueError, match="--reasoning-effort"):
        parse_efforts("none,loud")


# --- a row's sampling_params against SGLang's own checks ---------------------------------

GOOD_ROWS: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"top_k": 20, "min_p": 0.05, "stop": "###", "min_new_tokens": 4},
    {"logit_bias": {"12": -5.0}, "json_schema": "{}"},
    {"sampling_seed": -3, "ignore_eos": True},
]
BAD_ROWS: list[dict[str, Any]] = [
    {"top_p": 0},
    {"temperature": -1},
    {"min_p": 1.5},
    {"top_k": 0},
    {"repetition_penalty": 3},
    {"frequency_penalty": -2.5},
    {"min_new_tokens": 100},
    {"logit_bias": {"999999": 1.0}},
    {"regex": "a", "ebnf": "b"},
]
VOCAB = 163840


@pytest.mark.parametrize("row", GOOD_ROWS + BAD_ROWS)
def test_row_sampling_is_refused_exactly_when_sglangs_verify_refuses_it(
    row: dict[str, Any],
) -> None:
    reference = wheel_module("sglang/srt/sampling/sampling_params.py", "sglang_sampling_params")
    for k in range(3):
        merged = RUN.for_sample(k, row)
        wheel_error = None
        try:
            reference.SamplingParams(**merged).verify(VOCAB)
        except ValueError as exc:
            wheel_error = str(exc)
        if wheel_error is None:
            check_samples(RUN, row, 3, VOCAB)
        else:
            with pytest.raises(InputError) as caught:
                check_samples(RUN, row, 3, VOCAB)
            assert caught.value.reason.endswith(wheel_error)
            return
    assert row in GOOD_ROWS


@pytest.mark.parametrize(
    "value",
    [{"temprature": 0.5}, {"temperature": "hot"}, {"stop_token_ids": [1, "x"]}, ["temperature"]],
)
def test_a_row_the_json_contract_refuses_is_refused_with_its_text(value: Any) -> None:
    contract = load_contract()
    with pytest.raises(contract.JsonContractError) as wheel:
        contract.SamplingParams.from_json_value(value)
    with pytest.raises(InputError) as ours:
        parse_row_sampling(value)
    assert ours.value.reason == f"'sampling_params': {wheel.value}"


def test_n_is_refused_and_nulls_are_dropped() -> None:
    with pytest.raises(InputError, match="--samples-per-prompt"):
        parse_row_sampling({"n": 2})
    assert parse_row_sampling({"temperature": None, "top_k": 5}) == {"top_k": 5}
    assert parse_row_sampling({"temperature": None}) is None


# --- a reasoning-effort cycle ------------------------------------------------------------


def test_an_effort_cycle_templates_a_row_once_per_effort_with_its_samples() -> None:
    chat = PromptRecord(1, "a", messages=[{"role": "user", "content": "hi"}])
    own = PromptRecord(2, "b", messages=[{"role": "user", "content": "x"}], reasoning_effort="low")
    ids = PromptRecord(3, "c", input_ids=[1, 2])
    out = expand_efforts([chat, own, ids], ("none", "low", "high"), 5)
    variants = [r for r in out if r.key == "a"]
    assert [(r.reasoning_effort, r.samples) for r in variants] == [
        ("none", (0, 3)), ("low", (1, 4)), ("high", (2,)),
    ]  # fmt: skip
    assert [r for r in out if r.key != "a"] == [own, ids]
    assert list(samples_of(own, 5)) == [0, 1, 2, 3, 4]
    # two samples, three efforts: the third effort makes nothing
    assert [r.samples for r in expand_efforts([chat], ("none", "low", "high"), 2)] == [(0,), (1,)]


# --- the emulator's weight-version spans against SGLang's -----------------------------------


@pytest.mark.parametrize(
    ("events", "current", "tokens"),
    [
        ([], "a", 7),
        ([("a", 3)], "b", 9),
        ([("a", 3), ("b", 3), ("c", 6)], "d", 6),
        ([("a", 4)], "a", 10),
        ([], "a", 0),
    ],
)
def test_weight_version_spans_are_sglangs(
    events: list[tuple[str, int]], current: str, tokens: int
) -> None:
    reference = wheel_module("sglang/srt/utils/weight_versions.py", "sglang_weight_versions")
    spans = reference.compute_weight_version_spans(
        [reference.WeightVersionEvent(v, n) for v, n in events], current, tokens
    )
    meta: dict[str, Any] = {}
    reference.add_weight_versions_to_meta_info(meta, spans, tokens)
    ours = version_spans([VersionEvent(v, n) for v, n in events], current, tokens)
    assert ours == meta["weight_versions"]

"""A run's kind and turn mode, typed: the modes' meanings and their stored strings, and the
policy registry (every kind has a policy; generation's request and outcome)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from app.core.contracts import GenerateResult, SamplingParams
from app.core.run_kinds import RunKind, TurnsMode
from app.ledger import claims, run_queries
from workers.engine.policies import POLICIES, GenerationPolicy, policy_for
from workers.engine.window_types import Checked


def test_each_turn_mode_means_one_thing_and_keeps_its_string() -> None:
    assert [m.value for m in TurnsMode] == ["last", "all", "each"]
    assert [m for m in TurnsMode if m.chains] == [TurnsMode.ALL]
    assert [m for m in TurnsMode if m.boundary_samples] == [TurnsMode.EACH]
    assert [m for m in TurnsMode if m.final_only] == [TurnsMode.LAST]
    assert json.dumps({"turns": TurnsMode.ALL}) == '{"turns": "all"}'
    assert TurnsMode.parse("each") is TurnsMode.EACH


def test_an_unknown_turn_mode_names_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"turns: 'every' is not a turn mode \(last, all, each\)"):
        TurnsMode.parse("every")


def test_every_run_kind_has_a_policy() -> None:
    assert set(POLICIES) == set(RunKind)


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[list[int], dict[str, object], str, Any]] = []

    def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, object],
        rid: str,
        *,
        image_data: list[str] | None = None,
    ) -> GenerateResult:
        self.calls.append((input_ids, sampling_params, rid, image_data))
        return GenerateResult(rid, [7, 8], "stop", None, 3, 2, 0, 0.01)


def run_info(sampling: SamplingParams) -> run_queries.RunInfo:
    settings = run_queries.GenerationSettings("/t", "a", "b", {}, sampling, 1, None, [])
    return run_queries.RunInfo(1, "r", settings, None, datetime.now(UTC))


def test_generation_sends_the_samples_params_and_records_the_servers_answer() -> None:
    sampling = SamplingParams(temperature=0.5, seed=3)
    policy = policy_for(run_info(sampling))
    assert policy == GenerationPolicy(sampling)
    item = claims.ClaimedItem(5, 1, 2, [1, 2, 3], 0, row_sampling_params={"top_k": 4})
    client = RecordingClient()
    result = policy.send(client, item, "rid-1", None)
    sent = client.calls[0]
    assert sent[:3] == ([1, 2, 3], sampling.for_sample(2, {"top_k": 4}), "rid-1")
    assert sent[3] is None
    policy.send(client, item, "rid-2", ["img"])
    assert client.calls[1][3] == ["img"]
    done = policy.outcome(item, result, Checked(image_token_counts=(4,)), "s1")
    assert (done.item_id, done.result, done.server, done.image_token_counts) == (
        5,
        result,
        "s1",
        (4,),
    )

"""The emulator's speculative decoding against SGLang 0.5.23's facts (../shared/sglang.md,
"Speculative decoding in meta_info"): the EAGLE settings' resolution, the meta_info formulas,
counters that add up, acceptance that follows the prompt and the draft, outputs unchanged."""

from __future__ import annotations

import pytest

from emulator.config import EmulatorConfig
from emulator.model import generate_output
from emulator.speculative import (
    SpecSettings,
    acceptance_probability,
    draw_steps,
    expected_step_tokens,
    meta_fields,
    resolve_settings,
)


def settings(**kw: object) -> SpecSettings:
    args: dict[str, object] = {
        "algorithm": "EAGLE3",
        "draft_model_path": "/drafts/a",
        "num_steps": None,
        "eagle_topk": None,
        "num_draft_tokens": None,
        "accept": 0.7,
    } | kw
    resolved = resolve_settings(**args)  # type: ignore[arg-type]
    assert resolved is not None
    return resolved


def test_without_num_steps_sglang_chooses_all_three() -> None:
    s = settings()
    assert (s.num_steps, s.eagle_topk, s.num_draft_tokens) == (3, 1, 4)


@pytest.mark.parametrize("given", [{"eagle_topk": 1}, {"num_draft_tokens": 4}])
def test_topk_or_draft_tokens_alone_fail(given: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="need --speculative-num-steps"):
        settings(**given)


def test_topk_one_makes_draft_tokens_steps_plus_one() -> None:
    s = settings(num_steps=5, eagle_topk=1, num_draft_tokens=16)
    assert s.num_draft_tokens == 6
    tree = settings(num_steps=3, eagle_topk=4, num_draft_tokens=8)
    assert (tree.eagle_topk, tree.num_draft_tokens) == (4, 8)


def test_off_without_an_algorithm_and_flags_need_it() -> None:
    assert resolve_settings(None, None, None, None, None, 0.7) is None
    with pytest.raises(ValueError, match="need --speculative-algorithm"):
        resolve_settings(None, "/drafts/a", None, None, None, 0.7)
    with pytest.raises(ValueError, match="invalid emulator configuration"):
        EmulatorConfig(speculative_algorithm="EAGLE3")  # no draft path


def test_server_args_report_the_resolved_settings() -> None:
    cfg = EmulatorConfig(speculative_algorithm="EAGLE3", speculative_draft_model_path="/d")
    args = cfg.server_args()
    assert args["speculative_algorithm"] == "EAGLE3"
    assert args["speculative_draft_model_path"] == "/d"
    assert (args["speculative_num_steps"], args["speculative_num_draft_tokens"]) == (3, 4)
    assert EmulatorConfig().server_args()["speculative_algorithm"] is None


@pytest.mark.parametrize("tokens", [2, 3, 17, 300, 1000])
def test_meta_info_follows_sglang_formulas(tokens: int) -> None:
    s = settings()
    draw = draw_steps(list(range(50)), tokens, s, seed=tokens)
    meta = meta_fields(draw, tokens, s)
    # a step commits accepted + 1 tokens, counted before the output is trimmed
    committed = 1 + sum((k + 1) * n for k, n in enumerate(draw.histogram))
    assert committed >= tokens > committed - (s.num_steps + 1)
    assert meta["spec_verify_ct"] == sum(draw.histogram)
    assert meta["spec_num_correct_drafts"] == sum(k * n for k, n in enumerate(draw.histogram))
    assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * (s.num_draft_tokens - 1)
    assert (
        meta["spec_accept_rate"]
        == meta["spec_num_correct_drafts"] / (meta["spec_num_proposed_drafts"])
    )
    assert meta["spec_accept_length"] == tokens / meta["spec_verify_ct"]
    assert len(meta["spec_correct_drafts_histogram"]) <= s.num_steps + 1


def test_one_token_output_has_no_verify_step() -> None:
    s = settings()
    draw = draw_steps([1, 2, 3], 1, s, seed=0)
    assert draw.verify_ct == 0 and meta_fields(draw, 1, s) == {}


def test_acceptance_follows_the_prompt_and_the_draft() -> None:
    repetitive = [5, 6, 7] * 30
    varied = list(range(1000, 1090))
    a, b = settings(), settings(draft_model_path="/drafts/b")
    assert acceptance_probability(repetitive, a) > acceptance_probability(varied, a)
    assert acceptance_probability(varied, a) != acceptance_probability(varied, b)
    # deterministic per prompt
    assert draw_steps(varied, 200, a, seed=3) == draw_steps(varied, 200, a, seed=3)


def test_expected_step_tokens_matches_the_draws() -> None:
    s = settings(accept=0.6)
    prompt = list(range(200, 260))
    p = acceptance_probability(prompt, s)
    draw = draw_steps(prompt, 200_001, s, seed=1)
    assert 200_000 / draw.verify_ct == pytest.approx(expected_step_tokens(p, 3), rel=0.01)


def test_outputs_stay_the_targets() -> None:
    plain = EmulatorConfig()
    spec = EmulatorConfig(speculative_algorithm="EAGLE3", speculative_draft_model_path="/d")
    sampling = {"max_new_tokens": 300, "temperature": 0}
    assert generate_output([1, 2, 3], sampling, plain) == generate_output([1, 2, 3], sampling, spec)

"""The emulator's deterministic generation: same inputs, same outputs; lengths, EOS, think split.

Pure logic (no server): `generate_output` is what every other test checks stored outputs against.
"""

from __future__ import annotations

import statistics

import pytest

from emulator.config import KIMI_IM_END_ID, KIMI_THINK_END_ID, EmulatorConfig
from emulator.model import (
    generate_output,
    generation_seed,
    reasoning_token_count,
    render_text,
    resolve_max_new_tokens,
)

CFG = EmulatorConfig(median_tokens=40, sigma=0.8)
PROMPT = [163587, 1204, 163601, 500, 163586, 163588, 163606]


def prompts(count: int, length: int = 12) -> list[list[int]]:
    return [[256 + (i * 7919 + j * 104729) % 1700 for j in range(length)] for i in range(count)]


def test_same_inputs_give_the_same_output() -> None:
    sampling = {"max_new_tokens": 500, "temperature": 0.7, "sampling_seed": 11}
    assert generate_output(PROMPT, sampling, CFG) == generate_output(list(PROMPT), sampling, CFG)


def test_the_prompt_the_seed_and_the_temperature_each_change_the_output() -> None:
    base = {"max_new_tokens": 500, "temperature": 0.7, "sampling_seed": 11}
    reference = generate_output(PROMPT, base, CFG)[0]
    assert generate_output([*PROMPT, 7], base, CFG)[0] != reference
    assert generate_output(PROMPT, {**base, "sampling_seed": 12}, CFG)[0] != reference
    assert generate_output(PROMPT, {**base, "temperature": 0.6}, CFG)[0] != reference
    # parameters the seed does not cover leave the output alone
    assert generate_output(PROMPT, {**base, "top_p": 0.9}, CFG)[0] == reference


def test_greedy_ignores_the_seed() -> None:
    outputs = {
        tuple(generate_output(PROMPT, {"temperature": 0.0, "sampling_seed": s}, CFG)[0])
        for s in range(5)
    }
    assert len(outputs) == 1
    # SGLang decodes greedily with top_k 1 whatever the temperature
    top_k_one = generate_output(PROMPT, {"temperature": 0.9, "top_k": 1, "sampling_seed": 3}, CFG)
    assert tuple(top_k_one[0]) in outputs


def test_outputs_are_pinned_across_processes_and_releases() -> None:
    # a hash of the values, never Python's randomized hash(): stored outputs stay checkable;
    # if this golden value changes, bump GENERATION_VERSION on purpose
    assert generation_seed([1, 2, 3], {"temperature": 0}) == generation_seed(
        (1, 2, 3), {"temperature": 0.0, "sampling_seed": 99}
    )
    assert generation_seed([1, 2, 3], {}) == 24413897303071115950367103925678525293
    short = EmulatorConfig(median_tokens=10, sigma=0.8)
    assert generate_output([1, 2, 3], {"max_new_tokens": 100, "temperature": 0}, short) == (
        [809, KIMI_THINK_END_ID, 594, KIMI_IM_END_ID],
        {"type": "stop", "matched": KIMI_IM_END_ID},
    )


def test_a_stopped_output_ends_with_eos_and_counts_it() -> None:
    stopped = 0
    for prompt in prompts(50):
        output, finish = generate_output(prompt, {"max_new_tokens": 10_000}, CFG)
        assert finish == {"type": "stop", "matched": KIMI_IM_END_ID}
        assert output[-1] == KIMI_IM_END_ID
        assert output.count(KIMI_IM_END_ID) == 1
        stopped += 1
    assert stopped == 50


def test_lengths_follow_the_configured_median() -> None:
    lengths = [
        len(generate_output(prompt, {"max_new_tokens": 100_000}, CFG)[0]) - 1
        for prompt in prompts(400)
    ]
    assert 0.8 * CFG.median_tokens <= statistics.median(lengths) <= 1.2 * CFG.median_tokens
    # heavy tail: the longest answers run several times the median
    assert max(lengths) > 4 * CFG.median_tokens
    no_spread = EmulatorConfig(median_tokens=33, sigma=0)
    assert {len(generate_output(p, {}, no_spread)[0]) for p in prompts(20)} == {34}


def test_a_long_draw_is_cut_at_max_new_tokens_with_finish_length() -> None:
    cut = 0
    for prompt in prompts(60):
        output, finish = generate_output(prompt, {"max_new_tokens": 30}, CFG)
        if finish["type"] == "length":
            cut += 1
            assert finish == {"type": "length", "length": 30}
            assert len(output) == 30
            assert KIMI_IM_END_ID not in output
        else:
            assert len(output) <= 30
            assert output[-1] == KIMI_IM_END_ID
    assert 0 < cut < 60


def test_a_smaller_budget_gives_a_prefix_of_the_longer_output() -> None:
    sampling = {"temperature": 1.0, "sampling_seed": 5}
    full, _ = generate_output(PROMPT, {**sampling, "max_new_tokens": 5000}, CFG)
    for budget in (1, 7, len(full) - 1, len(full)):
        part, finish = generate_output(PROMPT, {**sampling, "max_new_tokens": budget}, CFG)
        assert part == full[:budget]
        assert finish["type"] == ("stop" if budget == len(full) else "length")


def test_a_stopped_output_is_reasoning_then_think_end_then_answer_then_eos() -> None:
    for prompt in prompts(40):
        output, finish = generate_output(prompt, {"max_new_tokens": 100_000}, CFG)
        assert finish["type"] == "stop"
        assert output.count(KIMI_THINK_END_ID) == 1
        split = output.index(KIMI_THINK_END_ID)
        reasoning, answer = output[:split], output[split + 1 : -1]
        assert all(CFG.token_min <= t < CFG.token_max for t in reasoning + answer)
        if len(output) > 10:
            assert len(reasoning) >= len(answer) > 0
        assert reasoning_token_count(output, CFG) == split + 1


def test_without_a_think_end_id_there_is_no_reasoning_part() -> None:
    plain = EmulatorConfig(median_tokens=40, think_end_id=None)
    output, _ = generate_output(PROMPT, {"max_new_tokens": 10_000}, plain)
    assert KIMI_THINK_END_ID not in output
    assert output[-1] == KIMI_IM_END_ID
    assert all(plain.token_min <= t < plain.token_max for t in output[:-1])
    assert reasoning_token_count(output, plain) == 0


def test_token_range_and_eos_follow_the_config() -> None:
    cfg = EmulatorConfig(median_tokens=30, token_min=1000, token_max=1010, eos_id=2, think_end_id=3)
    output, finish = generate_output(PROMPT, {"max_new_tokens": 1000}, cfg)
    assert finish == {"type": "stop", "matched": 2}
    assert set(output) - {2, 3} <= set(range(1000, 1010))


def test_stop_token_ids_stop_at_the_first_one_the_stream_contains() -> None:
    sampling = {"max_new_tokens": 10_000, "temperature": 0.0}
    full, _ = generate_output(PROMPT, sampling, CFG)
    target = full[len(full) // 2]
    first = full.index(target)
    output, finish = generate_output(PROMPT, {**sampling, "stop_token_ids": [target, 7]}, CFG)
    assert output == full[: first + 1]
    assert finish == {"type": "stop", "matched": target}
    # the think-end id can be a stop token as well
    output, finish = generate_output(
        PROMPT, {**sampling, "stop_token_ids": [KIMI_THINK_END_ID]}, CFG
    )
    assert output[-1] == KIMI_THINK_END_ID and finish["matched"] == KIMI_THINK_END_ID
    # ids the stream never contains change nothing
    assert generate_output(PROMPT, {**sampling, "stop_token_ids": [1, 2]}, CFG)[0] == full


def test_ignore_eos_runs_to_max_new_tokens() -> None:
    sampling = {"max_new_tokens": 500, "temperature": 0.0}
    natural, _ = generate_output(PROMPT, sampling, CFG)
    output, finish = generate_output(PROMPT, {**sampling, "ignore_eos": True}, CFG)
    assert len(output) == 500
    assert finish == {"type": "length", "length": 500}
    assert output[: len(natural)] == natural
    # SGLang's ignore_eos skips stop_token_ids too
    with_stops = {**sampling, "ignore_eos": True, "stop_token_ids": [natural[0]]}
    assert generate_output(PROMPT, with_stops, CFG)[0] == output


def test_min_new_tokens_holds_eos_back() -> None:
    output, finish = generate_output(PROMPT, {"max_new_tokens": 2000, "min_new_tokens": 300}, CFG)
    assert len(output) >= 301
    assert finish["type"] == "stop"


def test_max_new_tokens_zero_and_the_defaults() -> None:
    assert generate_output(PROMPT, {"max_new_tokens": 0}, CFG) == (
        [],
        {"type": "length", "length": 0},
    )
    small = EmulatorConfig(context_length=100)
    assert resolve_max_new_tokens(10, {}, small) == 90  # SGLang's 128, clipped to the room left
    assert resolve_max_new_tokens(10, {}, CFG) == 128
    assert resolve_max_new_tokens(10, {"max_new_tokens": None}, small) == 90
    assert resolve_max_new_tokens(10, {"max_new_tokens": 5}, small) == 5
    long_cfg = EmulatorConfig(median_tokens=5000, sigma=0)
    output, finish = generate_output(PROMPT, {}, long_cfg)
    assert len(output) == 128 and finish == {"type": "length", "length": 128}


def test_parallel_samples_differ_unless_greedy() -> None:
    sampling = {"max_new_tokens": 200, "temperature": 1.0, "sampling_seed": 1}
    first = generate_output(PROMPT, sampling, CFG, sample_index=0)
    assert generate_output(PROMPT, sampling, CFG, sample_index=1) != first
    greedy = {"max_new_tokens": 200, "temperature": 0.0}
    assert generate_output(PROMPT, greedy, CFG, sample_index=1) == generate_output(
        PROMPT, greedy, CFG
    )


def test_text_is_a_cheap_rendering_of_the_ids() -> None:
    ids = [400, 401, KIMI_THINK_END_ID, 402, KIMI_IM_END_ID]
    assert render_text(ids, CFG) == "400 401 402"
    assert (
        render_text(ids, CFG, skip_special_tokens=False)
        == f"400 401 {KIMI_THINK_END_ID} 402 {KIMI_IM_END_ID}"
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"token_min": 10, "token_max": 10},
        {"median_tokens": 0},
        {"max_running": 0},
        {"error_rate": 0.7, "drop_rate": 0.5},
        {"token_min": 163000, "token_max": 164000},  # EOS inside the ordinary range
        {"port": 70000},
    ],
)
def test_invalid_configs_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="invalid emulator configuration"):
        EmulatorConfig(**changes)  # type: ignore[arg-type]


def test_capacity_is_slots_times_steps_per_second() -> None:
    assert EmulatorConfig(max_running=64, step_ms=5).capacity_tokens_per_s == 12_800
    assert EmulatorConfig(step_ms=0).capacity_tokens_per_s is None

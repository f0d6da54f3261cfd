"""Multi-turn logic without a ledger: splitting conversations into turns, the regenerated
history, and whole-conversation loss-mask spans (a toy template and the Kimi-shaped one)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from app.core.contracts import Message
from app.core.errors import InputError
from app.prompts.conversation import (
    SpecForgeRowError,
    WholeConversationError,
    check_specforge_row,
    next_history,
    split_turns,
    template_encoder,
    whole_conversation_mask,
)
from app.prompts.tokenization import load_tokenizer

SYS: Message = {"role": "system", "content": "Be brief."}
U1: Message = {"role": "user", "content": "one"}
A1: Message = {"role": "assistant", "content": "original answer one"}
U2: Message = {"role": "user", "content": "two"}
A2: Message = {"role": "assistant", "content": "original answer two"}
U3: Message = {"role": "user", "content": "three"}


def test_each_assistant_turn_and_a_trailing_user_turn_are_turns() -> None:
    plans = split_turns([SYS, U1, A1, U2, A2, U3])
    assert [p.index for p in plans] == [0, 1, 2]
    assert [p.context for p in plans] == [[SYS, U1], [U2], [U3]]
    # ending with an assistant turn: that answer is regenerated too, nothing after it
    assert [p.context for p in split_turns([U1, A1, U2, A2])] == [[U1], [U2]]
    assert [p.context for p in split_turns([U1])] == [[U1]]


def test_tool_turns_lead_to_the_next_answer() -> None:
    call: Message = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}
    tool: Message = {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert [p.context for p in split_turns([U1, call, tool, A1])] == [[U1], [tool]]


@pytest.mark.parametrize(
    ("messages", "contexts"),
    [
        ([U1, A1, A2], [[U1], []]),  # the second answer right after the regenerated first
        ([SYS, A1, U1], [[SYS], [U1]]),  # an assistant turn after the system turn
        ([U1, A1, SYS], [[U1], [SYS]]),  # a conversation ending with a system turn
        ([A1, U1, A2], [[A1, U1]]),  # a greeting stays history
    ],
)
def test_every_shape_sglang_renders_is_split(
    messages: list[Message], contexts: list[list[Message]]
) -> None:
    assert [p.context for p in split_turns(messages)] == contexts


def test_a_conversation_of_answers_only_has_no_turn() -> None:
    with pytest.raises(InputError, match="no turn before its first assistant turn"):
        split_turns([A1, A2])


def test_next_history_puts_the_regenerated_answer_between_the_original_turns() -> None:
    regenerated: Message = {"role": "assistant", "content": "new", "reasoning_content": "r"}
    history = next_history([SYS, U1], regenerated, [U2])
    assert history == [SYS, U1, regenerated, U2]


# A toy template that keeps history: each turn is ROLE, its characters, END.
ROLE = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
END = 9


def toy_encode(messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
    ids: list[int] = []
    for m in messages:
        ids += [ROLE[m["role"]], *(100 + ord(c) for c in m["content"]), END]
    return ids + ([ROLE["assistant"]] if add_generation_prompt else [])


def test_mask_covers_every_regenerated_turn_and_the_last_output() -> None:
    a1: Message = {"role": "assistant", "content": "xy"}
    history = [U1, a1, U2]
    prompt = toy_encode(history, True)
    output = [500, 501, END]
    mask = whole_conversation_mask(7, history, prompt, len(output), toy_encode)
    u1_len = 1 + len("one") + 1
    expected_prompt = [0] * u1_len + [0] + [1, 1, 1] + [0] * (len(prompt) - u1_len - 4)
    assert mask == [*expected_prompt, 1, 1, 1]
    # the masked tokens are exactly a1's text and its end token
    assert [t for t, m in zip(prompt, mask, strict=False) if m] == [
        100 + ord("x"),
        100 + ord("y"),
        END,
    ]


def test_a_template_that_rewrites_history_is_refused_with_a_pointer_to_per_turn() -> None:
    def rewriting(messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        # drops earlier assistant text once a later user turn follows (like Kimi's reasoning)
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        kept = [
            {**m, "content": ""} if m["role"] == "assistant" and i < last_user else m
            for i, m in enumerate(messages)
        ]
        return toy_encode(kept, add_generation_prompt)

    history = [U1, {"role": "assistant", "content": "xy"}, U2]
    prompt = rewriting(history, True)
    with pytest.raises(WholeConversationError, match=r"item 7: .*--per-turn"):
        whole_conversation_mask(7, history, prompt, 2, rewriting)


KEEP_REASONING = (
    "loop.index0 > state.last_user and message['reasoning_content']",
    "message['reasoning_content']",
)


def test_kimi_shaped_template_with_and_without_kept_reasoning(kimi_tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(kimi_tokenizer_dir)
    a1: Message = {"role": "assistant", "content": "Hello there", "reasoning_content": "hmm"}
    history = [SYS, U1, a1, U2]
    kimi = template_encoder(tokenizer, {})
    prompt = tokenizer.apply(history)
    # Kimi drops the reasoning of turns before the last user turn: no whole-conversation mask
    with pytest.raises(WholeConversationError, match="--per-turn"):
        whole_conversation_mask(1, history, prompt, 3, kimi)
    # a variant that keeps reasoning in history: the span is <think>'s end ... <|im_end|>
    template = tokenizer.hf_tokenizer.chat_template
    assert KEEP_REASONING[0] in template
    tokenizer.hf_tokenizer.chat_template = template.replace(*KEEP_REASONING)
    keeping = template_encoder(tokenizer, {})
    prompt = keeping(history, True)
    mask = whole_conversation_mask(1, history, prompt, 3, keeping)
    masked = [t for t, m in zip(prompt, mask[: len(prompt)], strict=True) if m]
    assert tokenizer.decode(masked) == "hmm</think>Hello there<|im_end|>"
    assert mask[len(prompt) :] == [1, 1, 1]


def test_specforge_row_checks() -> None:
    check_specforge_row({"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]})
    for bad, needle in (
        ({"input_ids": [1, 2], "loss_mask": [0]}, "2 input_ids but 1"),
        ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "other than 0 and 1"),
        ({"input_ids": [1, 2], "loss_mask": [0, 0]}, "no 1"),
    ):
        with pytest.raises(SpecForgeRowError, match=needle):
            check_specforge_row({"id": "a", **bad})

"""Multi-turn regeneration, the pure part: splitting a conversation into assistant turns,
building the regenerated history, and the loss-mask spans of a whole regenerated conversation.

No I/O and no ledger: the template is passed in as a function, so unit tests need no tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.contracts import Message
from app.core.errors import InputError, TokenmillError
from app.prompts.tokenization import ChatTokenizer

# (messages, add_generation_prompt) → token ids, as the run's pinned chat template makes them
Encode = Callable[[Sequence[Message], bool], list[int]]


class WholeConversationError(InputError):
    """A whole-conversation loss mask cannot be built from this chat template."""


class SpecForgeRowError(TokenmillError):
    """An exported row would be refused by SpecForge."""


@dataclass(frozen=True)
class TurnPlan:
    """What one assistant turn needs from the input: the original non-assistant turns since
    the assistant turn before it (for turn 0, everything before the first assistant turn)."""

    index: int
    context: list[Message]


def split_turns(messages: Sequence[Message], *, keep_calls: bool = False) -> list[TurnPlan]:
    """One plan per assistant turn of a conversation; a trailing turn of any other role makes a
    final turn too (its answer is what the model is asked for). Assistant turns are what gets
    regenerated, so their original text is not kept, except for assistant turns before any
    other turn (a greeting), which have no prompt of their own and stay history.

    Every shape SGLang renders is taken: two assistant turns in a row (the second regenerated
    right after the first), an assistant turn after a system turn, a conversation without a
    user turn or ending with a system turn. A template that refuses a shape refuses it when
    the prompt is rendered, with its own message.

    keep_calls (agentic chains): an assistant turn with tool calls opens the next plan's
    context, so the turn after it knows which calls the dataset's cached results answer
    (`tool_calls.cached_results`); it is never history.
    """
    plans: list[TurnPlan] = []
    context: list[Message] = []
    for turn in messages:
        if turn["role"] != "assistant" or not (plans or any_prompt(context)):
            context.append(dict(turn))
            continue
        plans.append(TurnPlan(len(plans), context))
        context = [dict(turn)] if keep_calls and turn.get("tool_calls") else []
    if any_prompt(context):
        plans.append(TurnPlan(len(plans), context))
    if not plans:
        raise InputError("the conversation has no turn before its first assistant turn")
    return plans


def any_prompt(turns: Sequence[Message]) -> bool:
    """Whether turns hold one that is not an assistant turn (something to answer)."""
    return any(t["role"] != "assistant" for t in turns)


@dataclass(frozen=True)
class Boundary:
    """A boundary sample (`--turns each`): the original turns before assistant turn `index`
    (counted among the assistant turns), or before the answer to a trailing user/tool turn."""

    index: int
    messages: list[Message]


def split_boundaries(messages: Sequence[Message]) -> list[Boundary]:
    """One boundary per assistant turn, its prompt the original history before it (earlier
    assistant turns as the dataset has them, tool calls and reasoning included), plus one for
    a trailing turn of another role. Shortest first. Every shape SGLang renders is taken (two
    assistant turns in a row, an assistant turn after a system turn, no user turn, a trailing
    system turn); an assistant turn with only assistant turns before it has no prompt and is
    no boundary. A template that refuses a shape refuses the boundaries that hold it, when
    each is rendered, with its own message."""
    boundaries: list[Boundary] = []
    for position, turn in enumerate(messages):
        if turn["role"] == "assistant" and any_prompt(messages[:position]):
            boundaries.append(Boundary(len(boundaries), [dict(t) for t in messages[:position]]))
    if messages and messages[-1]["role"] != "assistant":
        boundaries.append(Boundary(len(boundaries), [dict(t) for t in messages]))
    if not boundaries:
        raise InputError("the conversation has no turn before its first assistant turn")
    return boundaries


def tool_turn_position(messages: Sequence[Message]) -> int | None:
    """The position of the first tool turn or assistant turn with tool calls, if any."""
    for position, turn in enumerate(messages):
        if turn["role"] == "tool" or turn.get("tool_calls"):
            return position
    return None


def next_history(
    history: Sequence[Message], regenerated: Message, context: Sequence[Message]
) -> list[Message]:
    """The prompt turns of the next turn: this turn's prompt turns, the regenerated answer,
    then the original user/tool turns that lead to the next assistant turn."""
    return [*(dict(t) for t in history), dict(regenerated), *(dict(t) for t in context)]


def whole_conversation_mask(
    item_id: int,
    history: Sequence[Message],
    prompt_ids: Sequence[int],
    output_len: int,
    encode: Encode,
) -> list[int]:
    """Loss mask over `prompt_ids + output` of a chain's last turn: 1 on the last output and
    on every regenerated assistant turn inside the prompt, 0 elsewhere.

    An assistant turn's span is found by rendering: before = history up to it with the
    generation prompt, after = history through it without; both must be token prefixes of the
    prompt. A template that rewrites earlier turns (Kimi's drops their reasoning) fails this,
    and the error names the item and points to --per-turn.
    """
    mask = [0] * len(prompt_ids) + [1] * output_len
    for position, turn in enumerate(history):
        if turn["role"] != "assistant":
            continue
        before = encode(history[:position], True)
        after = encode(history[: position + 1], False)
        if not (_is_prefix(before, prompt_ids) and _is_prefix(after, prompt_ids)):
            raise WholeConversationError(
                f"item {item_id}: the chat template renders earlier turns differently in a "
                f"later prompt (assistant turn at messages[{position}] is not a token prefix of "
                "the final prompt; templates such as Kimi's drop earlier reasoning), so no "
                "whole-conversation loss mask exists; export with --per-turn instead"
            )
        if len(after) <= len(before):
            raise WholeConversationError(
                f"item {item_id}: the assistant turn at messages[{position}] renders to no tokens"
            )
        for i in range(len(before), len(after)):
            mask[i] = 1
    return mask


def _is_prefix(part: Sequence[int], whole: Sequence[int]) -> bool:
    return len(part) <= len(whole) and list(whole[: len(part)]) == list(part)


def check_specforge_row(row: Mapping[str, Any]) -> None:
    """The checks SpecForge applies to a `data.prompts_path` row: equal lengths, a 0/1 mask,
    at least one trainable token. SpecForgeRowError naming the row's id otherwise."""
    ids, mask = row["input_ids"], row["loss_mask"]
    where = f"row id={row.get('id')!r} sample={row.get('sample')!r}"
    if len(ids) != len(mask):
        raise SpecForgeRowError(f"{where}: {len(ids)} input_ids but {len(mask)} loss_mask values")
    if any(m not in (0, 1) for m in mask):
        raise SpecForgeRowError(f"{where}: loss_mask holds a value other than 0 and 1")
    if not any(mask):
        raise SpecForgeRowError(f"{where}: loss_mask has no 1 (nothing to train on)")


def template_encoder(
    tokenizer: ChatTokenizer,
    chat_template_kwargs: Mapping[str, Any],
    tools: Sequence[dict[str, Any]] | None = None,
) -> Encode:
    """The run's chat template as an Encode function, with or without the generation prompt
    (with the row's tools and kwargs, as its prompts were rendered)."""
    hf = tokenizer.hf_tokenizer
    kwargs = dict(chat_template_kwargs)
    if tools:
        kwargs["tools"] = list(tools)

    def encode(messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        if not messages:
            return []
        result = hf.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            **kwargs,
        )
        ids = result if isinstance(result, list) else result["input_ids"]
        return [int(i) for i in ids]

    return encode

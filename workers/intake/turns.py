"""Multi-turn plans at enqueue: a `--turns all` conversation's items (turn 0 pending, each
later turn waiting, linked to the turn before it) and a `--turns each` conversation's
boundary samples. Advancing a chain once a turn finishes is workers/chains/.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import Connection

from app.core.constants import TOOL_CALL_PARSERS
from app.core.contracts import PromptRecord
from app.core.errors import InputError
from app.core.run_kinds import TurnsMode
from app.ledger import queue, turns
from app.prompts import tool_calls
from app.prompts.conversation import TurnPlan, split_boundaries, split_turns, tool_turn_position
from workers.intake.images import images_of, refs_json


def first_turns(
    records: Sequence[PromptRecord],
    plans: dict[str, list[TurnPlan]],
    fail: Callable[[InputError], None],
    tool_call_parser: str | None = None,
) -> list[PromptRecord]:
    """Records whose messages are turn 0's prompt turns; each chat record's turn plans go to
    plans (by key). Pre-tokenized records stay single-turn; a conversation that cannot be
    split is reported through fail and dropped. A row with tool turns becomes an on-policy
    agentic chain (the dataset's cached tool results spliced in after the regenerated calls,
    read with tool_call_parser, the run's); with no parser it is refused."""
    out: list[PromptRecord] = []
    for record in records:
        if record.messages is None:
            out.append(record)
            continue
        conversation = record.conversation or record.messages
        tool_at = tool_turn_position(conversation)
        if tool_at is not None and tool_call_parser is None:
            fail(
                InputError(
                    f"messages[{tool_at}] is a tool call or tool result, and the run has no "
                    "tool-call parser to read the regenerated calls with (SGLang's template "
                    "detection names none implemented here for this tokenizer): pass "
                    f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}), or use --turns each",
                    record.line,
                )
            )
            continue
        if record.assistant_prefix is not None:
            fail(
                InputError(
                    "continue_final_message: --turns all regenerates every assistant turn, so "
                    "none is continued; use --turns last or each (the final turn continued), "
                    "or --no-request-fields",
                    record.line,
                )
            )
            continue
        try:
            split = split_turns(conversation, keep_calls=tool_at is not None)
        except InputError as exc:
            fail(InputError(exc.reason, record.line))
            continue
        plans[record.key] = split
        out.append(replace(record, messages=split[0].context, conversation=None))
    return out


def boundary_records(
    records: Sequence[PromptRecord], fail: Callable[[InputError], None]
) -> tuple[list[PromptRecord], list[int]]:
    """`--turns each`: one record per boundary sample of each chat record (shortest first;
    the row's tools, kwargs and metadata kept), and the turn index of each; pre-tokenized
    records stay one item of turn 0. A continued final turn (continue_final_message) is the
    last boundary's prefix; the earlier boundaries have none. A conversation that cannot be
    split is reported through fail and dropped."""
    out: list[PromptRecord] = []
    turn_of: list[int] = []
    for record in records:
        if record.messages is None:
            out.append(record)
            turn_of.append(0)
            continue
        try:
            split = split_boundaries(record.conversation or record.messages)
        except InputError as exc:
            fail(InputError(exc.reason, record.line))
            continue
        for boundary in split:
            last = boundary is split[-1]
            prefix = record.assistant_prefix if last else None
            out.append(
                replace(
                    record, messages=boundary.messages, conversation=None, assistant_prefix=prefix
                )
            )
            turn_of.append(boundary.index)
    return out, turn_of


def chain_items(
    record: PromptRecord,
    prompt_ids: list[int],
    samples: int,
    plans: list[TurnPlan] | None,
    kwargs: dict[str, Any] | None = None,
    chat_pins: dict[str, Any] | None = None,
) -> list[queue.NewItem]:
    """Turn 0 of every sample with its prompt, then each later turn waiting, holding the
    original turns it will need (samples are independent chains). Every item keeps the row's
    tools, its merged template kwargs (None: the run's) and its metadata, and its images: a
    later turn's are those of every turn of the row before its answer (regenerated answers
    hold none). With the run's chat_pins, the last turn of an agentic chain (a parser pinned,
    the row with tools or tool turns) is marked: its ending is recorded once it is done."""
    later = (plans or [])[1:]
    history = list(record.messages or [])
    later_images: list[list[dict[str, Any]] | None] = []
    for plan in later:
        history += plan.context
        later_images.append(refs_json(images_of(history, record)))
    agentic = tool_calls.chain_parser(chat_pins, TurnsMode.ALL, record.tools, history) is not None
    first = queue.NewItem(
        record.key,
        0,
        record.line,
        record.messages,
        prompt_ids,
        tools=record.tools,
        chat_template_kwargs=kwargs,
        metadata=record.metadata,
        sampling_params=record.sampling_params,
        images=refs_json(images_of(record.messages, record)),
        assistant_prefix=record.assistant_prefix,
    )
    new: list[queue.NewItem] = []
    for k in record.samples if record.samples is not None else range(samples):
        new.append(replace(first, sample_index=k, ends_chain=agentic and not later))
        for plan, images in zip(later, later_images, strict=True):
            new.append(
                replace(
                    first,
                    sample_index=k,
                    messages=plan.context,
                    prompt_ids=[],
                    turn_index=plan.index,
                    waiting=True,
                    images=images,
                    ends_chain=agentic and plan is later[-1],
                )
            )
    return new


def link_chains(conn: Connection, run_id: int, new_items: Sequence[queue.NewItem]) -> None:
    """Point the later turns just inserted at the item of the turn before them."""
    keys = sorted({n.item_key for n in new_items if n.turn_index > 0})
    if keys:
        turns.link_turns(conn, run_id, keys)

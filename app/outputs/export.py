"""Exports of a run's finished samples: SpecForge pre-tokenized JSONL and conversations JSONL.

Streams a page of rows at a time; the file appears under its final name only when complete.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import Engine

from app import ledger
from app.core.constants import EXPORT_FORMATS
from app.core.errors import ConfigurationError
from app.ledger import RunInfo, StoredItem
from app.outputs.provenance import provenance, weight_filter
from app.prompts.conversation import check_specforge_row, template_encoder, whole_conversation_mask
from app.prompts.tokenization import ChatTokenizer, split_reasoning

log = logging.getLogger(__name__)

ExportFormat = Literal["specforge", "conversations"]
FORMATS: tuple[ExportFormat, ...] = EXPORT_FORMATS


@dataclass
class ExportReport:
    path: Path
    format: str
    rows: int = 0
    truncated: int = 0
    tokens: int = 0


def specforge_row(item: StoredItem) -> dict[str, Any]:
    """input_ids = prompt + output; the loss mask trains only on what the model generated."""
    output = item.output_ids or []
    row = {
        "id": item.item_key,
        "sample": item.sample_index,
        "input_ids": item.prompt_ids + output,
        "loss_mask": [0] * len(item.prompt_ids) + [1] * len(output),
        "finish_reason": item.finish_reason,
    }
    return _with_metadata(row, item)


def _with_metadata(row: dict[str, Any], item: StoredItem) -> dict[str, Any]:
    """The row with its provenance (weight_version, sampling_params) and the input row's
    metadata fields (source, category, ...), if it had any."""
    row.update(provenance(item))
    if item.metadata is not None:
        row["metadata"] = item.metadata
    return row


def assistant_turn(item: StoredItem, run: RunInfo, tokenizer: ChatTokenizer) -> dict[str, Any]:
    """The regenerated assistant turn as text, its reasoning split off at the `</think>` id."""
    output = list(item.output_ids or [])
    if item.finish_reason == "stop" and output and output[-1] in set(run.eos_token_ids):
        output = output[:-1]
    think_end = run.think_end_id
    reasoning_ids, answer_ids = split_reasoning(output, think_end)
    if reasoning_ids is None and think_end is not None and item.finish_reason == "length":
        # cut off before `</think>`: if the prompt opened the thinking block, all is reasoning
        start = tokenizer.think_start_id
        if start is not None and item.prompt_ids and item.prompt_ids[-1] == start:
            reasoning_ids, answer_ids = output, []
    turn: dict[str, Any] = {"role": "assistant", "content": tokenizer.decode(answer_ids)}
    if reasoning_ids is not None:
        start = tokenizer.think_start_id
        if reasoning_ids and start is not None and reasoning_ids[0] == start:
            reasoning_ids = reasoning_ids[1:]
        turn["reasoning_content"] = tokenizer.decode(reasoning_ids)
    return turn


def conversations_row(item: StoredItem, run: RunInfo, tokenizer: ChatTokenizer) -> dict[str, Any]:
    turns: list[dict[str, Any]] = [dict(t) for t in item.messages or []]
    row: dict[str, Any] = {"id": item.item_key, "sample": item.sample_index}
    if not turns:
        row["prompt"] = tokenizer.decode(item.prompt_ids)
    row["conversations"] = [*turns, assistant_turn(item, run, tokenizer)]
    # what else built the prompt, so a trainer that re-renders it gets the same text
    if item.tools is not None:
        row["tools"] = item.tools
    if item.chat_template_kwargs is not None:
        row["chat_template_kwargs"] = item.chat_template_kwargs
    row["finish_reason"] = item.finish_reason
    return _with_metadata(row, item)


def whole_conversation_row(
    item: StoredItem, run: RunInfo, tokenizer: ChatTokenizer
) -> dict[str, Any]:
    """A `--turns all` chain as one SpecForge row: its last turn's prompt + output, the loss
    mask on the last output and on every regenerated assistant turn inside the prompt."""
    output = item.output_ids or []
    kwargs = run.chat_template_kwargs
    if item.chat_template_kwargs is not None:
        kwargs = item.chat_template_kwargs
    encode = template_encoder(tokenizer, kwargs, item.tools)
    mask = whole_conversation_mask(
        item.id, item.messages or [], item.prompt_ids, len(output), encode
    )
    row = {
        "id": item.item_key,
        "sample": item.sample_index,
        "turns": item.turn_index + 1,
        "input_ids": item.prompt_ids + output,
        "loss_mask": mask,
        "finish_reason": item.finish_reason,
    }
    check_specforge_row(row)
    return _with_metadata(row, item)


def whole_conversations(run: RunInfo, fmt: ExportFormat, *, per_turn: bool, whole: bool) -> bool:
    """Does this export write one row per chain (True) or per turn item? Per turn is SpecForge's
    default (what it recommends for Kimi); conversations of a `--turns all` run default to the
    whole regenerated conversation."""
    if per_turn and whole:
        raise ConfigurationError("choose one of --per-turn and --whole-conversation")
    if whole and run.turns != "all":
        raise ConfigurationError(
            f"--whole-conversation needs a run enqueued with --turns all; run {run.name} "
            + (
                "holds boundary samples (--turns each), each on its original history"
                if run.turns == "each"
                else "regenerated only the last turn (its earlier assistant turns are the input's)"
            )
        )
    if fmt == "conversations" and run.turns == "all":
        return not per_turn
    return whole


def iter_rows(
    db: Engine,
    run: RunInfo,
    fmt: ExportFormat,
    tokenizer: ChatTokenizer | None,
    *,
    whole: bool = False,
    weight_version: str | None = None,
    allow_mixed_weights: bool = False,
) -> Iterator[tuple[StoredItem, dict[str, Any]]]:
    with db.connect() as conn:
        keep = weight_filter(conn, run, weight_version, allow_mixed_weights)
        for item in ledger.iter_items(conn, run.id, final_turns_only=whole):
            if not keep(item):
                continue
            if fmt == "specforge" and whole:
                assert tokenizer is not None
                yield item, whole_conversation_row(item, run, tokenizer)
            elif fmt == "specforge":
                row = specforge_row(item)
                if run.turns != "last":
                    row["turn"] = item.turn_index
                yield item, row
            else:
                assert tokenizer is not None
                row = conversations_row(item, run, tokenizer)
                if run.turns == "each":
                    row["turn"] = item.turn_index
                yield item, row


def export_run(
    db: Engine,
    run: RunInfo,
    fmt: ExportFormat,
    out: Path,
    *,
    tokenizer: ChatTokenizer | None = None,
    per_turn: bool = False,
    whole_conversation: bool = False,
    weight_version: str | None = None,
    allow_mixed_weights: bool = False,
) -> ExportReport:
    """Write every done sample of run to out (atomically: a temp file renamed when complete).
    One weight version per export unless allow_mixed_weights (app.outputs.provenance).

    A `--turns all` run: one row per turn (per_turn), or per chain whose every turn is done
    (whole_conversation; the default of the conversations format)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    whole = whole_conversations(run, fmt, per_turn=per_turn, whole=whole_conversation)
    if (fmt == "conversations" or whole) and tokenizer is None:
        raise ValueError(f"the {fmt} export needs the run's tokenizer")
    out = out.expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    report = ExportReport(path=out, format=fmt)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            rows = iter_rows(
                db,
                run,
                fmt,
                tokenizer,
                whole=whole,
                weight_version=weight_version,
                allow_mixed_weights=allow_mixed_weights,
            )
            for item, row in rows:
                fh.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")))
                fh.write("\n")
                report.rows += 1
                report.truncated += item.finish_reason == "length"
                report.tokens += len(item.prompt_ids) + len(item.output_ids or [])
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, out)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    log.info("exported %d %s rows of run %s to %s", report.rows, fmt, run.name, out)
    return report

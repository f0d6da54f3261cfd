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

from app.core.constants import EXPORT_FORMATS
from app.core.errors import ConfigurationError
from app.ledger import common, reads, run_queries
from app.outputs.image_rows import (
    ImageExportError,
    ImageRows,
    expanded_mask,
    image_parts,
    item_label,
)
from app.outputs.provenance import provenance, weight_filter
from app.outputs.split import Selection, eval_path, manifest_path
from app.prompts import chat_path, tool_calls
from app.prompts.conversation import check_specforge_row, template_encoder, whole_conversation_mask
from app.prompts.tokenization import ChatTokenizer, split_reasoning
from app.storage.shards import Location, open_location

log = logging.getLogger(__name__)

ExportFormat = Literal["specforge", "conversations"]
FORMATS: tuple[ExportFormat, ...] = EXPORT_FORMATS
JSONL_MANIFEST_FORMAT = "tokenmill-jsonl-export/1"
# the rows of a run without image pins: text items as stored; an image item is refused, named
TEXT_ONLY = ImageRows(None, None)


@dataclass
class ExportReport:
    path: Path
    format: str
    rows: int = 0
    truncated: int = 0
    tokens: int = 0
    # a split or filtered export: where its rows went (the counts above are the training side's)
    selection: Selection | None = None
    # --with-images: how many distinct images were copied beside the export
    images: int = 0
    # --text-only: the samples left out because their prompt holds an image
    image_rows_left_out: int = 0


def specforge_row(item: reads.StoredItem, images: ImageRows | None = None) -> dict[str, Any]:
    """input_ids = prompt + output; the loss mask trains only on what the model generated.

    An image item's prompt is the served one (each image's tokens, all masked 0), and its
    row lists its images ({sha256, uri, width, height}) and image_token_counts; a text
    item's row has neither key."""
    output = item.output_ids or []
    images = images or TEXT_ONLY
    prompt = images.served_prompt(item)
    row = {
        "id": item.item_key,
        "sample": item.sample_index,
        "input_ids": prompt + output,
        "loss_mask": [0] * len(prompt) + [1] * len(output),
        "finish_reason": item.finish_reason,
        **images.fields(item),
    }
    return _with_metadata(row, item)


def _with_metadata(row: dict[str, Any], item: reads.StoredItem) -> dict[str, Any]:
    """The row with its provenance (weight_version, sampling_params), the continued final turn
    its prompt ends with (continue_final_message) and the input row's metadata fields (source,
    category, ...), each if it had any."""
    row.update(provenance(item))
    if item.assistant_prefix is not None:
        row["assistant_prefix"] = item.assistant_prefix
    if item.metadata is not None:
        row["metadata"] = item.metadata
    return row


def assistant_turn(
    item: reads.StoredItem,
    run: run_queries.RunInfo,
    tokenizer: ChatTokenizer,
    parser: str | None = None,
) -> dict[str, Any]:
    """The regenerated assistant turn as text, its reasoning split off at the `</think>` id; a
    continued turn's text (continue_final_message) starts it: the reasoning when the output
    closes one (the prompt left the prefix inside it), else the answer.

    parser: the tool-call parser of an agentic chain, whose turns are read as SGLang's chat
    endpoint reads them (its reasoning parser, `detect_and_parse`): with no `</think>` in a
    reasoning block the template or the output opened, the parser family's tool-call start
    (`tool_calls.reasoning_interrupt_id`) ends the reasoning and stays in the answer, and without
    one everything is reasoning."""
    reasoning_ids, answer_ids = _reasoning_and_answer(item, run, tokenizer, parser)
    prefix = item.assistant_prefix or ""
    answer = tokenizer.decode(answer_ids)
    if reasoning_ids is None:
        return {"role": "assistant", "content": prefix + answer}
    reasoning = _without_think_starts(reasoning_ids, tokenizer.think_start_id, parser)
    return {
        "role": "assistant",
        "content": answer,
        "reasoning_content": prefix + tokenizer.decode(reasoning),
    }


def _generated_ids(item: reads.StoredItem, run: run_queries.RunInfo) -> list[int]:
    """The output ids without the end-of-sequence id a stopped generation ends with."""
    output = list(item.output_ids or [])
    if item.finish_reason == "stop" and output and output[-1] in set(run.generation.eos_token_ids):
        output = output[:-1]
    return output


def _reasoning_and_answer(
    item: reads.StoredItem, run: run_queries.RunInfo, tokenizer: ChatTokenizer, parser: str | None
) -> tuple[list[int] | None, list[int]]:
    """The output split into reasoning (None: no reasoning block) and answer ids."""
    output = _generated_ids(item, run)
    reasoning_ids, answer_ids = split_reasoning(output, run.generation.think_end_id)
    if reasoning_ids is not None or run.generation.think_end_id is None:
        return reasoning_ids, answer_ids
    start = tokenizer.think_start_id
    prompt_opened = start is not None and bool(item.prompt_ids) and item.prompt_ids[-1] == start
    opened = prompt_opened or (start is not None and start in output)
    if parser is not None and opened:
        interrupt = tool_calls.reasoning_interrupt_id(parser, tokenizer)
        if interrupt is not None and interrupt in output:
            at = output.index(interrupt)
            return output[:at], output[at:]
        return output, []  # as SGLang reads an unterminated block: all reasoning
    if item.finish_reason == "length" and prompt_opened:
        return output, []  # cut off before `</think>`, in the thinking block the prompt opened
    return reasoning_ids, answer_ids


def _without_think_starts(reasoning: list[int], start: int | None, parser: str | None) -> list[int]:
    """The reasoning without its opening `<think>` id (an agentic chain's: without every one,
    as SGLang's reasoning parser strips them)."""
    if start is None or reasoning[:1] != [start]:
        return reasoning
    reasoning = reasoning[1:]
    while parser is not None and reasoning[:1] == [start]:
        reasoning = reasoning[1:]
    return reasoning


def conversations_row(
    item: reads.StoredItem,
    run: run_queries.RunInfo,
    tokenizer: ChatTokenizer,
    images: ImageRows | None = None,
) -> dict[str, Any]:
    """The turns and the regenerated assistant turn as text. An image item's image parts point
    at its images (`image_rows.image_parts`), and the row lists their uris in prompt order
    under `images` (the field LLaVA / ShareGPT4V rows and SpecForge's VLM preparation read
    beside `conversations`) with `image_token_counts`."""
    turns: list[dict[str, Any]] = [dict(t) for t in item.messages or []]
    row: dict[str, Any] = {"id": item.item_key, "sample": item.sample_index}
    if not turns:
        row["prompt"] = tokenizer.decode(item.prompt_ids)
    fields = (images or TEXT_ONLY).fields(item)
    uris = [(entry["uri"], entry["sha256"]) for entry in fields.get("images", [])]
    if uris:
        try:
            turns = image_parts(turns, uris)
        except ValueError as exc:
            raise ImageExportError(f"{item_label(item)}: {exc}") from None
    parser = tool_calls.chain_parser(
        run.generation.chat_pins, run.generation.turns, item.tools, item.messages
    )
    last = assistant_turn(item, run, tokenizer, parser)
    if parser is not None:  # an agentic chain: the calls parsed as the server parses them
        seed = tool_calls.item_seed(item.item_key, item.sample_index, item.turn_index)
        last = tool_calls.final_message(parser, last, item.tools or [], seed, turns)
        # its calls in the shape the history's take (SGLang's ToolCall: `arguments` an object,
        # `index`), so each field of the row has one type whatever the turn
        last = chat_path.normalize_turn(last, "string", "last turn", pass_turn_fields=True)
        row["tool_call_parser"] = parser
        if item.chain_end is not None:
            row["chain_end"] = item.chain_end
    row["conversations"] = [*turns, last]
    if uris:
        row["images"] = [uri for uri, _ in uris]
        row["image_token_counts"] = fields["image_token_counts"]
    # what else built the prompt, so a trainer that re-renders it gets the same text
    if item.tools is not None:
        row["tools"] = item.tools
    if item.chat_template_kwargs is not None:
        row["chat_template_kwargs"] = item.chat_template_kwargs
    row["finish_reason"] = item.finish_reason
    return _with_metadata(row, item)


def whole_conversation_row(
    item: reads.StoredItem,
    run: run_queries.RunInfo,
    tokenizer: ChatTokenizer,
    images: ImageRows | None = None,
) -> dict[str, Any]:
    """A `--turns all` chain as one SpecForge row: its last turn's prompt + output, the loss
    mask on the last output and on every regenerated assistant turn inside the prompt (an
    image item's prompt served, its image tokens masked 0)."""
    output = item.output_ids or []
    kwargs = run.generation.chat_template_kwargs
    if item.chat_template_kwargs is not None:
        kwargs = item.chat_template_kwargs
    encode = template_encoder(tokenizer, kwargs, item.tools)
    mask = whole_conversation_mask(
        item.id, item.messages or [], item.prompt_ids, len(output), encode
    )
    images = images or TEXT_ONLY
    prompt = images.served_prompt(item)
    if item.image_refs:
        assert images.placeholder_id is not None and item.image_token_counts is not None
        mask = expanded_mask(item.prompt_ids, mask, images.placeholder_id, item.image_token_counts)
    row = {
        "id": item.item_key,
        "sample": item.sample_index,
        "turns": item.turn_index + 1,
        "input_ids": prompt + output,
        "loss_mask": mask,
        "finish_reason": item.finish_reason,
        **images.fields(item),
    }
    check_specforge_row(row)
    return _with_metadata(row, item)


def whole_conversations(
    run: run_queries.RunInfo, fmt: ExportFormat, *, per_turn: bool, whole: bool
) -> bool:
    """Does this export write one row per chain (True) or per turn item? Per turn is SpecForge's
    default (what it recommends for Kimi); conversations of a `--turns all` run default to the
    whole regenerated conversation."""
    if per_turn and whole:
        raise ConfigurationError("choose one of --per-turn and --whole-conversation")
    if whole and not run.generation.turns.chains:
        raise ConfigurationError(
            f"--whole-conversation needs a run enqueued with --turns all; run {run.name} "
            + (
                "holds boundary samples (--turns each), each on its original history"
                if run.generation.turns.boundary_samples
                else "regenerated only the last turn (its earlier assistant turns are the input's)"
            )
        )
    if fmt == "conversations" and run.generation.turns.chains:
        return not per_turn
    return whole


def iter_rows(
    db: Engine,
    run: run_queries.RunInfo,
    fmt: ExportFormat,
    tokenizer: ChatTokenizer | None,
    *,
    whole: bool = False,
    weight_version: str | None = None,
    allow_mixed_weights: bool = False,
    images: ImageRows | None = None,
) -> Iterator[tuple[reads.StoredItem, dict[str, Any]]]:
    with db.connect() as conn:
        keep = weight_filter(conn, run, weight_version, allow_mixed_weights)
        for item in reads.iter_items(conn, run.id, final_turns_only=whole):
            if not keep(item):
                continue
            if fmt == "specforge" and whole:
                assert tokenizer is not None
                yield item, whole_conversation_row(item, run, tokenizer, images)
            elif fmt == "specforge":
                row = specforge_row(item, images)
                if not run.generation.turns.final_only:
                    row["turn"] = item.turn_index
                yield item, row
            else:
                assert tokenizer is not None
                row = conversations_row(item, run, tokenizer, images)
                if run.generation.turns.boundary_samples:
                    row["turn"] = item.turn_index
                yield item, row


def current_umask() -> int:
    """The process's umask (os.umask can only be read by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_export_file(out: Path, run_name: str) -> None:
    """Refuse an export path that is a folder, or whose folder does not exist (an export
    never creates folders: a typo must not leave a tree of them behind)."""
    if out.is_dir():
        raise ConfigurationError(
            f"cannot export to {out}: it is a folder; name a file in it, e.g. "
            f"{out / (run_name + '.jsonl')}"
        )
    if not out.parent.is_dir():
        raise ConfigurationError(
            f"cannot export to {out}: the folder {out.parent} does not exist; create it first"
        )


class _JsonlFile:
    """A JSONL file written under a temporary name, renamed when complete."""

    def __init__(self, out: Path) -> None:
        self.out = out
        fd, self.tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        # mkstemp makes the file 0600; an export is as readable as any file the user writes
        # (and as the Parquet shards are): 0666 less the umask
        os.fchmod(fd, 0o666 & ~current_umask())
        self.fh = os.fdopen(fd, "w", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self.fh.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")))
        self.fh.write("\n")

    def commit(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp_name, self.out)

    def abort(self) -> None:
        self.fh.close()
        Path(self.tmp_name).unlink(missing_ok=True)


def export_run(
    db: Engine,
    run: run_queries.RunInfo,
    fmt: ExportFormat,
    out: Path,
    *,
    tokenizer: ChatTokenizer | None = None,
    per_turn: bool = False,
    whole_conversation: bool = False,
    selection: Selection | None = None,
    weight_version: str | None = None,
    allow_mixed_weights: bool = False,
    image_store: Location | None = None,
    with_images: bool = False,
    text_only: bool = False,
) -> ExportReport:
    """Write every done sample of run to out (atomically: a temp file renamed when complete).
    One weight version per export unless allow_mixed_weights (app.outputs.provenance).

    Image rows point at image_store (default the configured one); with_images copies every
    image they reference to `<out's folder>/images/<sha256>.<ext>`, once, checking its
    sha256, points at the copies by that relative path, and lists them in
    `manifest_path(out)`. text_only leaves out every sample whose prompt holds an image (a
    text-only draft's data), counted in `image_rows_left_out`.

    A `--turns all` run: one row per turn (per_turn), or per chain whose every turn is done
    (whole_conversation; the default of the conversations format). With a selection, eval rows
    go to `eval_path(out)`, excluded rows nowhere, and `manifest_path(out)` records the split."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    whole = whole_conversations(run, fmt, per_turn=per_turn, whole=whole_conversation)
    if (fmt == "conversations" or whole) and tokenizer is None:
        raise ValueError(f"the {fmt} export needs the run's tokenizer")
    out = out.expanduser()
    check_export_file(out, run.name)
    report = ExportReport(path=out, format=fmt)
    if selection is not None and selection.exclusion is not None:
        with db.connect() as conn:
            selection.find_excluded(reads.iter_items(conn, run.id))
    with db.connect() as conn:
        copy_to = open_location(str(out.parent)) if with_images else None
        images = ImageRows.for_run(conn, run.id, image_store, copy_to)
    files = {"train": _JsonlFile(out)}
    if selection is not None and selection.eval_fraction is not None:
        files["eval"] = _JsonlFile(eval_path(out))
    rows = iter_rows(
        db,
        run,
        fmt,
        tokenizer,
        whole=whole,
        weight_version=weight_version,
        allow_mixed_weights=allow_mixed_weights,
        images=images,
    )
    _write_rows(rows, files, report, images, selection=selection, text_only=text_only)
    if selection is not None:
        report.selection = selection
    if selection is not None or with_images:
        _write_manifest(run, fmt, files, selection, images.manifest() if with_images else None)
    report.images = len(images.copied)
    log.info(
        "exported %d %s rows of run %s to %s",
        report.rows,
        fmt,
        run.name,
        out,
        extra={"action": "exported"},
    )
    return report


def _write_rows(
    rows: Iterator[tuple[reads.StoredItem, dict[str, Any]]],
    files: dict[str, _JsonlFile],
    report: ExportReport,
    images: ImageRows,
    *,
    selection: Selection | None,
    text_only: bool,
) -> None:
    """Each row to its side's file (train, or eval under a selection; an excluded row nowhere),
    counted in report; every file committed at the end, or every one removed on any error."""
    try:
        for item, row in rows:
            if text_only and item.image_refs:
                report.image_rows_left_out += 1
                continue
            side = "train" if selection is None else selection.side(item)
            if side not in files:
                continue
            files[side].write(row)
            if side == "train":
                report.rows += 1
                report.truncated += item.finish_reason == "length"
                report.tokens += len(images.served_prompt(item)) + len(item.output_ids or [])
        for file in files.values():
            file.commit()
    except BaseException:
        for file in files.values():
            file.abort()
        raise


def _write_manifest(
    run: run_queries.RunInfo,
    fmt: str,
    files: dict[str, _JsonlFile],
    selection: Selection | None,
    images: list[dict[str, Any]] | None,
) -> None:
    """`<out>.manifest.json`: the files, the split (if any), and the images copied beside
    the export (with --with-images: each one's relative path, sha256 and size)."""
    manifest: dict[str, Any] = {
        "format": JSONL_MANIFEST_FORMAT,
        "run": run.name,
        "export_format": fmt,
        "files": {side: file.out.name for side, file in files.items()},
    }
    if selection is not None:
        manifest.update(selection.to_json())
    if images is not None:
        manifest["images"] = images
    manifest["created_at"] = common.utcnow().isoformat()
    target = manifest_path(files["train"].out)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, target)

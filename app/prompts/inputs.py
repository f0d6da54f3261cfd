"""Prompt files: streaming JSONL parsing into PromptRecords, with one clear error per bad line.

Also parses the `--chat-template-kwargs` option. No tokenizer here: records hold turns or ids.
One object's fields become a record in `app.prompts.input_records`.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, cast

from app.core.contracts import PromptRecord
from app.core.errors import ConfigurationError, InputError
from app.core.run_kinds import TurnsMode
from app.prompts.chat_path import ContentFormat, json_type
from app.prompts.input_formats import TableInput, iter_rows, open_table, prompt_columns
from app.prompts.input_records import ReadRules, build_record
from app.prompts.input_turns import BadRow

logger = logging.getLogger(__name__)

DEFAULT_MAX_LINE_BYTES = 32 * 1024 * 1024
_SKIP_CHUNK_BYTES = 1024 * 1024
_UTF8_BOM = b"\xef\xbb\xbf"


def read_prompts(
    path: Path,
    *,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    field: str | None = None,
    content_format: ContentFormat = "string",
    pass_turn_fields: bool = False,
    turns: TurnsMode = TurnsMode.LAST,
    reorders_tool_results: bool = True,
    request_fields: bool = True,
    renders_every_tool: bool = False,
) -> Iterator[PromptRecord | InputError]:
    """Yield a PromptRecord or an InputError for every non-blank line of a JSONL file, or for
    every row of a Parquet / datasets input (see `app.prompts.input_formats`; errors say "row N").

    Lines are read one at a time in binary (a `.gz` file is decompressed on the fly) and
    numbered from 1; a bad line yields its InputError and reading goes on. A line may hold:

    - `messages`: a list of `{"role", "content"}` turns (roles system, developer, user,
      assistant, tool); a turn keeps the fields SGLang's request models keep for its role (every
      field with pass_turn_fields), `reasoning` and `thinking` being aliases of
      `reasoning_content`;
    - `conversations`: ShareGPT turns `{"from", "value"}` (human/user, gpt/chatgpt/assistant,
      system, tool/function/observation) or `{"role", "content"}` turns;
    - `prompt`: a string, one user turn;
    - `input_ids`: a non-empty list of non-negative ints, used as the prompt ids verbatim
      (text only: such a row has no images).

    A user turn or a tool result may hold image parts beside its text parts: OpenAI's
    `{"type": "image_url", "image_url": {"url": ...}}`, SGLang's `input_image`, or
    `{"type": "image", "image": ...}`, each read as an `image_url` part. A LLaVA /
    ShareGPT4V row gives its images beside the turns (`"image": ref` or `"images": [ref,
    ...]`) and marks each one's place with `<image>` in the turns' text: each marker becomes
    an image part there, the text around it text parts, and a marker count other than the
    images' is the line's error. Video and audio parts are the line's error, named. The
    references are read and stored at enqueue (`workers.intake.images`).

    Optional `id` (string or int) is the item key; without it the key is a hash of the turns
    (or ids), so the same prompt twice is reported as a duplicate. An optional non-empty
    `system` string becomes a leading system turn (an error if the turns have their own).
    `tools` (a list of OpenAI tools, or a JSON string of one) goes to the template as
    `tools=`; `chat_template_kwargs` (an object) and `reasoning_effort` are the row's template
    kwargs, merged over the run's. Every other top-level field is kept as row metadata.

    The turns are normalized as SGLang's chat path does (`app.prompts.chat_path`, for the template's
    `content_format`): tool-call arguments given as JSON strings parsed (invalid JSON is the
    line's error), content parts joined with a space for "string" templates and kept as a
    list for "openai" ones, null content "" and null fields dropped. Trailing assistant turns
    are dropped: the prompt ends at the last user (or tool) turn, and the answer after it is
    what gets regenerated.

    A line with a bad turn is that line's error, except in `--turns each` (turns "each"), where
    its record holds the turns before the bad one and `bad_turn` says which and why, and in
    `--turns last` when the bad turn is among the trailing assistant turns the prompt drops.

    `field` names the field (column) holding the prompt instead: its value is read as turns,
    a prompt string or ids, whichever it holds.
    """
    path = Path(path)
    table = open_table(path)
    rules = ReadRules(
        field,
        content_format,
        pass_turn_fields,
        reorders_tool_results,
        request_fields,
        renders_every_tool,
    )
    if table is not None:
        records = _table_records(table, rules)
    else:
        records = _jsonl_records(path, max_line_bytes, rules)
    unit = "line" if table is None else "row"
    return _unique(
        records if TurnsMode(turns).boundary_samples else _bad_turns_refused(records, unit, turns),
        unit,
    )


def _bad_turns_refused(
    entries: Iterator[tuple[PromptRecord, bool] | InputError], unit: str, turns: TurnsMode
) -> Iterator[tuple[PromptRecord, bool] | InputError]:
    for entry in entries:
        if isinstance(entry, InputError) or entry[0].bad_turn is None:
            yield entry
        elif TurnsMode(turns).final_only and entry[0].bad_turn_in_tail:
            yield replace(entry[0], bad_turn=None, bad_turn_in_tail=False), entry[1]
        else:
            yield InputError(entry[0].bad_turn[1], entry[0].line, unit=unit)


def _jsonl_records(
    path: Path, max_line_bytes: int, rules: ReadRules
) -> Iterator[tuple[PromptRecord, bool] | InputError]:
    with _open(path) as stream:
        for line_no, raw, complete in _lines(stream, max_line_bytes, path):
            if raw is None:
                yield InputError(f"line is longer than {max_line_bytes} bytes", line_no)
                continue
            if not raw.strip():
                continue
            try:
                yield _parse_line(raw, line_no, complete, first=line_no == 1, rules=rules)
            except InputError as error:
                yield error


def _table_records(
    table: TableInput, rules: ReadRules
) -> Iterator[tuple[PromptRecord, bool] | InputError]:
    columns = prompt_columns(table, rules.field)
    for row_no, row in iter_rows(table, columns):
        try:
            yield build_record(row, row_no, rules)
        except BadRow as bad:
            yield InputError(str(bad), row_no, unit="row")


def _unique(
    entries: Iterator[tuple[PromptRecord, bool] | InputError], unit: str
) -> Iterator[PromptRecord | InputError]:
    """Records, with a second record of the same key reported as a duplicate of the first."""
    seen: dict[str, int] = {}
    for entry in entries:
        if isinstance(entry, InputError):
            yield entry
            continue
        record, explicit = entry
        first = seen.setdefault(record.key, record.line)
        if first == record.line:
            yield record
        elif explicit:
            yield InputError(
                f"duplicate id {record.key!r} (first seen on {unit} {first})",
                record.line,
                unit=unit,
            )
        else:
            yield InputError(
                f"duplicate prompt: same content as {unit} {first}", record.line, unit=unit
            )


def parse_chat_template_kwargs(text: str | None) -> dict[str, Any]:
    """The JSON object given to `--chat-template-kwargs` (None or blank: no kwargs)."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigurationError(
            f"--chat-template-kwargs is not valid JSON ({exc}); "
            "give a JSON object such as '{\"thinking\": false}'"
        ) from exc
    if not isinstance(value, dict):
        raise ConfigurationError(
            f"--chat-template-kwargs must be a JSON object such as "
            f"'{{\"thinking\": false}}', not a JSON {json_type(value)}"
        )
    return value


# --- reading lines --------------------------------------------------------------------------


def check_input(path: Path) -> None:
    """Refuse at once an input file that cannot be opened, before a tokenizer loads or a server
    is asked anything (a folder is a `datasets` folder, read by input_formats)."""
    if not path.is_dir():
        _open(path).close()


def _open(path: Path) -> IO[bytes]:
    try:
        if path.suffix == ".gz":
            return cast(IO[bytes], gzip.open(path, "rb"))
        return path.open("rb")
    except OSError as exc:
        raise InputError(f"cannot open the prompts file {str(path)!r}: {exc.strerror}") from exc


def _lines(
    stream: IO[bytes], max_line_bytes: int, path: Path
) -> Iterator[tuple[int, bytes | None, bool]]:
    """(line number, bytes without the newline or None if too long, ended by a newline)."""
    line_no = 0
    while True:
        chunk = _readline(stream, max_line_bytes + 1, path, line_no)
        if not chunk:
            return
        line_no += 1
        complete = chunk.endswith(b"\n")
        if len(chunk) > max_line_bytes and not complete:
            # Too long: skip to the end of the line without holding it in memory.
            while chunk and not chunk.endswith(b"\n"):
                chunk = _readline(stream, _SKIP_CHUNK_BYTES, path, line_no)
            yield line_no, None, True
            continue
        yield line_no, chunk.rstrip(b"\n").removesuffix(b"\r"), complete


def _readline(stream: IO[bytes], size: int, path: Path, line_no: int) -> bytes:
    """One readline; a file that cannot be read on (not gzip, truncated .gz) is an InputError."""
    try:
        return stream.readline(size)
    except (OSError, EOFError, zlib.error) as exc:
        where = f"after line {line_no}" if line_no else "at its start"
        raise InputError(f"cannot read the prompts file {str(path)!r} {where}: {exc}") from exc


def _parse_line(
    raw: bytes,
    line_no: int,
    complete: bool,
    *,
    first: bool,
    rules: ReadRules,
) -> tuple[PromptRecord, bool]:
    """The record of one line, and whether its key is an explicit id."""
    if first:
        raw = raw.removeprefix(_UTF8_BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"line is not valid UTF-8 (bad byte at offset {exc.start})"
        raise InputError(reason, line_no) from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise InputError("invalid JSON: nested too deeply", line_no) from None
    except ValueError as exc:
        if not complete:
            raise InputError(
                "truncated last line: no newline at the end of the file and the JSON is "
                f"incomplete ({exc})",
                line_no,
            ) from None
        raise InputError(f"invalid JSON: {exc}", line_no) from None
    if not isinstance(data, dict):
        raise InputError(f"line is a JSON {json_type(data)}, not an object", line_no)
    try:
        return build_record(data, line_no, rules)
    except BadRow as bad:
        raise InputError(str(bad), line_no) from None

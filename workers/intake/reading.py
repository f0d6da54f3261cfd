"""The first two stages of an enqueue: read (the input in chunks of records, bad lines refused)
and plan (which records are new to the run, and the turns each becomes in the run's mode)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.core.contracts import PromptRecord
from app.core.errors import InputError
from app.core.run_kinds import TurnsMode
from app.prompts.chat_path import ContentFormat
from app.prompts.conversation import TurnPlan
from app.prompts.input_formats import open_table
from app.prompts.input_records import report_bad_turns
from app.prompts.inputs import read_prompts
from workers.intake import cycles, turns
from workers.intake.images import ImageResolver
from workers.intake.reporting import Reporter

CHUNK_LINES = 512


@dataclass
class ReadChunk:
    """Up to CHUNK_LINES input lines: the records read from them, and where they end."""

    records: list[PromptRecord]
    first_line: int | None  # of the chunk (a refused line included)
    lines: int  # the highest line number read so far


@dataclass
class PlannedChunk:
    """The records of a chunk to build prompts for, with the turns of each."""

    records: list[PromptRecord]
    lines: int
    # `--turns all`: each chat record's turn plans, by key (turn 0 is built now)
    plans: dict[str, list[TurnPlan]] = field(default_factory=dict)
    # `--turns each`: the regenerated assistant turn of each record (None in other modes)
    turn_of: list[int] | None = None


class Reader:
    """The read stage: opens the input and reads its first line at once (a missing, unreadable
    or empty input is refused before anything is written), then yields chunks of records."""

    def __init__(
        self,
        path: Path,
        *,
        prompt_field: str | None,
        content_format: ContentFormat,
        pass_turn_fields: bool,
        turns: TurnsMode,
        row_check: Callable[[PromptRecord], InputError | None] = lambda record: None,
        reorders_tool_results: bool = True,
        request_fields: bool = True,
        renders_every_tool: bool = False,
    ) -> None:
        self._entries = read_prompts(
            path,
            field=prompt_field,
            content_format=content_format,
            pass_turn_fields=pass_turn_fields,
            turns=turns,
            reorders_tool_results=reorders_tool_results,
            request_fields=request_fields,
            renders_every_tool=renders_every_tool,
        )
        # errors name a "row" of a Parquet or datasets input, a "line" of JSONL
        self.unit = "row" if open_table(path) is not None else "line"
        first = next(self._entries, None)
        if first is None:
            raise InputError(
                f"the prompts file {str(path)!r} is empty (no non-blank lines): nothing to enqueue"
            )
        self._first: PromptRecord | InputError = first
        self._row_check = row_check
        self._lines = 0

    def chunks(self, reporter: Reporter) -> Iterator[ReadChunk]:
        """The input's records CHUNK_LINES lines at a time; bad lines go to the reporter,
        and each record's fields are counted in its report."""
        entries = itertools.chain([self._first], self._entries)
        while chunk := list(itertools.islice(entries, CHUNK_LINES)):
            records: list[PromptRecord] = []
            for entry in chunk:
                if not isinstance(entry, InputError):
                    entry = self._row_check(entry) or entry
                if isinstance(entry, InputError):
                    reporter.fail(entry)
                else:
                    records.append(entry)
                    reporter.report.count_fields(entry)
            self._lines = max(self._lines, *(entry.line or 0 for entry in chunk))
            yield ReadChunk(records, chunk[0].line, self._lines)


class Planner:
    """The plan stage: drops the records whose key the run already holds, stores the images
    of the others (a record whose image cannot be used is its line's error), then splits each
    into the items its turns mode makes (last: the record itself; all: turn 0 of a chain;
    each: one record per boundary sample, each on its original history)."""

    def __init__(
        self,
        mode: TurnsMode,
        *,
        existing_keys: Callable[[Iterable[str]], set[str]] | None,
        reporter: Reporter,
        efforts: Sequence[str | float] = (),
        samples_per_prompt: int = 1,
        images: ImageResolver | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        self._mode = TurnsMode(mode)
        # `--turns all`: the run's parser for rows with tool turns (None: they are refused)
        self._tool_call_parser = tool_call_parser
        self._images = images
        # `--reasoning-effort a,b,c`: a chat row is templated once per effort, each record
        # holding the samples of its effort
        self._efforts = efforts
        self._samples_per_prompt = samples_per_prompt
        # None for a new run: it has no keys but this input's (which are unique)
        self._existing_keys = existing_keys
        self._reporter = reporter

    def plan(self, chunk: ReadChunk) -> PlannedChunk:
        records = chunk.records
        present = (
            set() if self._existing_keys is None else self._existing_keys(r.key for r in records)
        )
        fresh = [r for r in records if r.key not in present]
        # a bad later turn of `--turns each` costs the boundaries that hold it, named
        report_bad_turns(fresh, self._reporter.fail)
        report = self._reporter.report
        report.already_present += len(records) - len(fresh)
        if self._images is not None:  # a line whose image cannot be used is no prompt
            stored = self._with_images(fresh)
            report.prompts -= len(fresh) - len(stored)
            report.images_read = self._images.reads
            report.image_bytes_read = self._images.bytes_read
            report.images_refused = self._images.refused
            fresh = stored
        report.prompts += len(records)
        fresh = cycles.expand_efforts(fresh, self._efforts, self._samples_per_prompt)
        planned = PlannedChunk(fresh, chunk.lines)
        fail = self._reporter.fail
        if self._mode.chains:  # template turn 0 now; later turns wait for it
            planned.records = turns.first_turns(fresh, planned.plans, fail, self._tool_call_parser)
        elif self._mode.boundary_samples:  # every boundary now, each on its original history
            planned.records, planned.turn_of = turns.boundary_records(fresh, fail)
        return planned

    def _with_images(self, records: list[PromptRecord]) -> list[PromptRecord]:
        assert self._images is not None
        out: list[PromptRecord] = []
        for record in records:
            resolved = self._images.resolve(record)
            if isinstance(resolved, InputError):
                self._reporter.fail(resolved)
            else:
                out.append(resolved)
        return out

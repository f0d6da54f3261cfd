"""`tokenmill verify`: re-checks a run's stored items against its pinned configuration.

Streams the finished items once (template, stop/EOS, max_new_tokens, server counts), keeping
only counters and the first few mismatches per check; optionally checks a Parquet export.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from app.core.errors import ConfigurationError, InputError
from app.core.images import ImagePins
from app.ledger import image_tokens, reads, retries, run_queries
from app.outputs.image_rows import count_problem, served_prompt
from app.outputs.jsonl_checks import check_jsonl_images, is_jsonl_export
from app.outputs.parquet_export import check_export
from app.prompts.chat_path import ChatInputs, check_version
from app.prompts.tokenization import ChatTokenizer
from app.storage.image_store import ImageError, get_image, image_location
from app.storage.shards import Location

log = logging.getLogger(__name__)

EXAMPLES_PER_CHECK = 5
TEMPLATE_BATCH = 64
# re-renders stored items on a server (a run rendered by the server): ids or why not, in order
Rerender = Callable[[Sequence[reads.StoredItem]], Sequence[list[int] | str]]

CHECK_TEMPLATE = "template"
CHECK_STOP = "stop_token"
CHECK_LENGTH = "max_new_tokens"
CHECK_COMPLETION = "completion_tokens"
CHECK_PROMPT = "prompt_tokens"
CHECK_WEIGHTS = "weight_version"
CHECK_SAMPLING = "sampling_params"
CHECK_IMAGE_COUNTS = "image_token_counts"
CHECK_IMAGE_STORE = "image_store"
CHECKS = (
    CHECK_TEMPLATE,
    CHECK_STOP,
    CHECK_LENGTH,
    CHECK_COMPLETION,
    CHECK_PROMPT,
    CHECK_WEIGHTS,
    CHECK_SAMPLING,
    CHECK_IMAGE_COUNTS,
    CHECK_IMAGE_STORE,
)
IMAGE_CHECKS = (CHECK_IMAGE_COUNTS, CHECK_IMAGE_STORE)
CHECK_TITLES = {
    CHECK_TEMPLATE: "chat template re-applied reproduces prompt_ids",
    CHECK_STOP: "stopped outputs end with a stop/EOS id",
    CHECK_LENGTH: "truncated outputs have exactly max_new_tokens ids",
    CHECK_COMPLETION: "len(output_ids) == the server's completion_tokens",
    CHECK_PROMPT: "len(prompt_ids as served) == the server's prompt_tokens",
    CHECK_WEIGHTS: "each sample's weight_version is the one the run pinned",
    CHECK_SAMPLING: "each sample's sampling_params are the run's for it, with its row's over them",
    CHECK_IMAGE_COUNTS: "image items have one image_token_count >= 1 per image and placeholder",
    CHECK_IMAGE_STORE: "every stored image an item uses still hashes to its sha256",
}


@dataclass(frozen=True)
class Mismatch:
    item_id: int
    key: str
    sample: int
    turn: int
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "item_id": self.item_id,
            "id": self.key,
            "sample": self.sample,
            "turn": self.turn,
            "detail": self.detail,
        }


@dataclass
class CheckTally:
    """One check: items it applied to, items it could not check, mismatches (first few kept)."""

    name: str
    checked: int = 0
    not_checkable: int = 0
    mismatches: int = 0
    examples: list[Mismatch] = field(default_factory=list)

    def passed(self) -> None:
        self.checked += 1

    def failed(self, item: reads.StoredItem, detail: str) -> None:
        self.checked += 1
        self.mismatches += 1
        if len(self.examples) < EXAMPLES_PER_CHECK:
            self.examples.append(
                Mismatch(item.id, item.item_key, item.sample_index, item.turn_index, detail)
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.name,
            "description": CHECK_TITLES[self.name],
            "checked": self.checked,
            "not_checkable": self.not_checkable,
            "mismatches": self.mismatches,
            "examples": [m.to_json() for m in self.examples],
        }


@dataclass
class ExportSummary:
    url: str
    rows: int
    shards: int
    problems: list[str]


@dataclass
class VerifyReport:
    run: str
    items: int = 0
    findings: list[str] = field(default_factory=list)
    checks: dict[str, CheckTally] = field(
        default_factory=lambda: {name: CheckTally(name) for name in CHECKS}
    )
    export: ExportSummary | None = None
    # the run's failed items by reason, the most common first: a run with any is not clean
    failed: list[tuple[str, int]] = field(default_factory=list)

    @property
    def failed_items(self) -> int:
        return sum(n for _, n in self.failed)

    @property
    def clean(self) -> bool:
        exported_ok = self.export is None or not self.export.problems
        return (
            not self.findings
            and exported_ok
            and not self.failed
            and not any(t.mismatches for t in self.checks.values())
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "run": self.run,
            "clean": self.clean,
            "items": self.items,
            "findings": list(self.findings),
            "failed": {"items": self.failed_items, "by_reason": dict(self.failed)},
            "checks": [tally.to_json() for tally in self.checks.values()],
        }
        if self.export is not None:
            data["export"] = {
                "url": self.export.url,
                "rows": self.export.rows,
                "shards": self.export.shards,
                "problems": list(self.export.problems),
            }
        return data


def tokenizer_findings(run: run_queries.RunInfo, tokenizer: ChatTokenizer) -> list[str]:
    """Lines saying how the tokenizer differs from what the run pinned (none if it matches)."""
    found: list[str] = []
    changes = tokenizer.changes_from(run.generation.tokenizer_hash, run.generation.tokenizer_files)
    if changes:
        found.append(
            f"the tokenizer files in {tokenizer.path} are not the ones the run pinned: "
            f"{'; '.join(changes)} (template mismatches below may come from this)"
        )
    if tokenizer.chat_template_hash != run.generation.chat_template_hash:
        found.append(
            f"the chat template in {tokenizer.path} is not the one the run pinned: hash "
            f"{tokenizer.chat_template_hash[:12]} now, "
            f"{run.generation.chat_template_hash[:12]} pinned "
            "(template mismatches below may come from this)"
        )
    return found


def verify_run(
    db: Engine,
    run: run_queries.RunInfo,
    tokenizer: ChatTokenizer | None,
    *,
    export_url: str | None = None,
    storage_options: dict[str, Any] | None = None,
    image_store: Location | None = None,
    on_progress: Callable[[int], None] = lambda n: None,
    rerender: Rerender | None = None,
) -> VerifyReport:
    """Check every done item of run; with tokenizer None the template check is skipped
    (counted as not checkable). Nothing per item is kept beyond a few examples.

    rerender: how a run rendered by the server re-renders stored items (its server's
    /v1/tokenize), used instead of the tokenizer's template.

    Image items: the template check re-renders the ids sent (one placeholder per image), the
    counts must rebuild the served prompt (whose length is the server's prompt_tokens), and
    every image is read back from image_store (default the run's pinned storage), each distinct
    image once. export_url: a Parquet export folder, or a JSONL export file (its image
    references are checked)."""
    report = VerifyReport(run=run.name)
    if tokenizer is not None:
        report.findings += tokenizer_findings(run, tokenizer)
        try:
            check_version(run.generation.normalization_version, run=run.name)
        except ConfigurationError as exc:
            # the prompts cannot be rebuilt with the rules they were made with
            report.findings.append(f"{exc}; the template check is skipped")
            tokenizer = None
    stops = set(run.generation.eos_token_ids) | set(run.generation.sampling.stop_token_ids)
    pending: list[reads.StoredItem] = []
    with db.connect() as conn:
        report.failed = retries.failed_by_reason(conn, run.id)
        images = StoredImages(
            report, image_tokens.run_image_pins(conn, run.id), image_store, run.storage_url
        )
        for item in reads.iter_items(conn, run.id, storage_options=storage_options):
            report.items += 1
            sent = run.generation.sampling.for_sample(item.sample_index, item.row_sampling_params)
            mine = stops | set(sent.get("stop_token_ids") or [])
            _check_finish(report, item, mine, sent.get("max_new_tokens"))
            _check_counts(report, item, images.check(item))
            _check_provenance(report, item, sent, pinned_version(run))
            if item.messages is None or (tokenizer is None and rerender is None):
                report.checks[CHECK_TEMPLATE].not_checkable += 1
            else:
                pending.append(item)
                if len(pending) >= TEMPLATE_BATCH:
                    _check_templates(
                        report, tokenizer, run.generation.chat_template_kwargs, pending, rerender
                    )
                    pending = []
            if report.items % 1000 == 0:
                on_progress(report.items)
        if pending:
            _check_templates(
                report, tokenizer, run.generation.chat_template_kwargs, pending, rerender
            )
        if export_url is not None and is_jsonl_export(export_url):
            result = check_jsonl_images(conn, run.id, Path(export_url), storage_options)
            report.export = ExportSummary(export_url, result.rows, result.shards, result.problems)
        elif export_url is not None:
            result = check_export(conn, run.id, export_url, storage_options)
            report.export = ExportSummary(export_url, result.rows, result.shards, result.problems)
    on_progress(report.items)
    log.info(
        "verified run %s: %d items, %s",
        run.name,
        report.items,
        {name: tally.mismatches for name, tally in report.checks.items()},
        extra={"action": "verified"},
    )
    return report


# --- the checks -----------------------------------------------------------------------------


def _check_templates(
    report: VerifyReport,
    tokenizer: ChatTokenizer | None,
    kwargs: dict[str, Any],
    batch: Sequence[reads.StoredItem],
    rerender: Rerender | None = None,
) -> None:
    """Re-render each item from what it stored: its normalized turns, its tools and its merged
    kwargs (the run's when it has none of its own); by rerender when given."""
    tally = report.checks[CHECK_TEMPLATE]
    if rerender is not None:
        answers: Sequence[list[int] | str | InputError] = list(rerender(batch))
    else:
        assert tokenizer is not None
        answers = tokenizer.apply_each(_template_inputs(kwargs, batch))
    for item, ids in zip(batch, answers, strict=True):
        if not isinstance(ids, list):
            tally.failed(item, str(ids))
        elif ids != item.prompt_ids:
            tally.failed(item, _ids_difference(item.prompt_ids, ids))
        else:
            tally.passed()


def _template_inputs(kwargs: dict[str, Any], batch: Sequence[reads.StoredItem]) -> list[ChatInputs]:
    return [
        ChatInputs(
            item.messages or [],
            item.tools,
            kwargs if item.chat_template_kwargs is None else item.chat_template_kwargs,
            normalized=True,
            assistant_prefix=item.assistant_prefix,
        )
        for item in batch
    ]


def _ids_difference(stored: list[int], templated: list[int]) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(stored, templated, strict=False)) if a != b),
        min(len(stored), len(templated)),
    )
    stored_id = stored[at] if at < len(stored) else "(end)"
    templated_id = templated[at] if at < len(templated) else "(end)"
    return (
        f"prompt_ids differ from the re-applied template at position {at}: stored "
        f"{stored_id}, template {templated_id} ({len(stored)} stored ids, "
        f"{len(templated)} from the template)"
    )


def pinned_version(run: run_queries.RunInfo) -> str | None:
    """The weight version a run's samples must have: its `--weight-version`, else the one
    its fingerprint pinned when a server first served it."""
    if run.weight_version is not None:
        return run.weight_version
    version = (run.fingerprint or {}).get("weight_version")
    return None if version is None else str(version)


def _check_provenance(
    report: VerifyReport, item: reads.StoredItem, expected: dict[str, Any], pinned: str | None
) -> None:
    """The sample's weights against the pin, and what it was sent against what the run and
    its row ask for that sample (results stored before either was recorded: not checkable)."""
    weights = report.checks[CHECK_WEIGHTS]
    if item.weight_version is None or pinned is None:
        weights.not_checkable += 1
    elif item.weight_version != pinned:
        weights.failed(item, f"weight_version {item.weight_version}; the run pinned {pinned}")
    else:
        weights.passed()
    sampling = report.checks[CHECK_SAMPLING]
    if item.sampling_params is None:
        sampling.not_checkable += 1
    elif item.sampling_params != expected:
        keys = sorted(set(item.sampling_params) | set(expected))
        diff = [
            f"{k}: sent {item.sampling_params.get(k)!r}, expected {expected.get(k)!r}"
            for k in keys
            if item.sampling_params.get(k) != expected.get(k)
        ]
        sampling.failed(item, "; ".join(diff))
    else:
        sampling.passed()


def _check_finish(
    report: VerifyReport, item: reads.StoredItem, stops: set[int], max_new_tokens: int | None
) -> None:
    output = item.output_ids or []
    if item.finish_reason == "length":
        tally = report.checks[CHECK_LENGTH]
        if max_new_tokens is None or len(output) == max_new_tokens:  # null: the context's rest
            tally.passed()
        else:
            tally.failed(
                item,
                f"finish_reason length with {len(output)} output ids; max_new_tokens is "
                f"{max_new_tokens}",
            )
        return
    tally = report.checks[CHECK_STOP]
    if item.finish_reason != "stop":
        tally.failed(item, f"finish_reason {item.finish_reason!r} is neither stop nor length")
    elif output and output[-1] in stops:
        tally.passed()
    else:
        tally.failed(item, _stop_difference(output, item.matched_stop, stops))


def _stop_difference(output: list[int], matched: str | None, stops: set[int]) -> str:
    """Why a stopped output does not end with a stop id, in the server's terms.

    SGLang's matched stop is an id, a stop string, or a list of ids; tokenmill never sends
    stop strings, so a string match means the server applied one of its own, and the
    sequence then ends without the EOS the training data needs: a mismatch either way.
    """
    known = ", ".join(str(s) for s in sorted(stops)) or "none"
    if not output:
        return "finish_reason stop with no output ids"
    head = f"finish_reason stop but the last output id {output[-1]} is not a stop/EOS id ({known})"
    if matched is None:
        return f"{head}; the server reported no matched stop"
    try:
        value = json.loads(matched)
    except ValueError:
        value = matched
    if isinstance(value, int) and not isinstance(value, bool):
        if value in stops:
            return f"{head}; the server reported stopping on id {value}"
        return f"{head}; the server stopped on id {value}, which the run does not list"
    if isinstance(value, list):
        return f"{head}; the server matched the stop ids {matched}"
    return (
        f"{head}; the server matched the stop string {matched!r}, which tokenmill does not "
        "send (a server-side default), so the sequence has no EOS"
    )


class StoredImages:
    """The image checks of verify: each image item's counts, and its images read back from
    the store (each distinct image once; its problem, if any, named for every item using it)."""

    def __init__(
        self,
        report: VerifyReport,
        pins: ImagePins | None,
        store: Location | None,
        storage_url: str | None = None,
    ):
        self.report = report
        self.placeholder_id = None if pins is None else pins.placeholder_id
        self.store = store
        self.storage_url = storage_url  # the run's pinned storage, opened when store is None
        self._store_problems: dict[str, str | None] = {}  # sha256 -> why it fails, or None

    def check(self, item: reads.StoredItem) -> list[int] | None:
        """Check item's images; its served prompt ids, or None when they cannot be rebuilt."""
        if not item.image_refs and item.image_token_counts is None:
            return item.prompt_ids
        counts = self.report.checks[CHECK_IMAGE_COUNTS]
        problem = count_problem(item, self.placeholder_id)
        served = None
        if problem is None:
            counts.passed()
            served = served_prompt(item, self.placeholder_id)
        else:
            counts.failed(item, problem)
        self._check_store(item)
        return served

    def _check_store(self, item: reads.StoredItem) -> None:
        tally = self.report.checks[CHECK_IMAGE_STORE]
        refs = item.image_refs
        if not refs:
            return
        store = self._store()
        if store is None:
            tally.not_checkable += 1
            return
        bad = []
        for index, ref in enumerate(refs):
            if ref.sha256 not in self._store_problems:
                try:
                    get_image(store, ref)
                    self._store_problems[ref.sha256] = None
                except ImageError as exc:
                    self._store_problems[ref.sha256] = str(exc)
            problem = self._store_problems[ref.sha256]
            if problem is not None:
                bad.append(f"image {index}: {problem}")
        if bad:
            tally.failed(item, "; ".join(bad))
        else:
            tally.passed()

    def _store(self) -> Location | None:
        if self.store is None and self.placeholder_id is not None:
            from app.core.settings import get_settings

            self.store = image_location(get_settings(), self.storage_url)
        return self.store


def _check_counts(report: VerifyReport, item: reads.StoredItem, served: list[int] | None) -> None:
    completion = report.checks[CHECK_COMPLETION]
    output = item.output_ids or []
    if item.completion_tokens is None:
        completion.not_checkable += 1
    elif item.completion_tokens == len(output):
        completion.passed()
    else:
        completion.failed(
            item,
            f"{len(output)} output ids stored; the server reported completion_tokens "
            f"{item.completion_tokens}",
        )
    prompt = report.checks[CHECK_PROMPT]
    if item.prompt_tokens is None or served is None:  # served None: the counts are wrong
        prompt.not_checkable += 1
    elif item.prompt_tokens == len(served):
        prompt.passed()
    else:
        what = "prompt ids stored"
        if served is not item.prompt_ids:
            what = f"prompt ids served ({len(item.prompt_ids)} sent + image tokens)"
        prompt.failed(
            item, f"{len(served)} {what}; the server reported prompt_tokens {item.prompt_tokens}"
        )

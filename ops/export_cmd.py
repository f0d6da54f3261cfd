"""`tokenmill export`: a run's results as SpecForge or conversations JSONL, or Parquet, with
held-out splits and exclusions; thin over app/outputs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import click

from app.core.constants import EXPORT_FORMATS
from app.core.errors import (
    ConfigurationError,
    RunMismatch,
)
from ops.options import (
    counted,
    err_console,
    handle_errors,
    open_db,
)
from ops.pipeline_cmd import pinned_folder_changes

if TYPE_CHECKING:
    from app.ledger import run_queries
    from app.outputs.export import ExportFormat, ExportReport
    from app.outputs.split import Selection
    from app.prompts.tokenization import ChatTokenizer


@click.command("export")
@click.argument("run_name")
@click.option(
    "--format",
    "fmt",
    type=click.Choice((*EXPORT_FORMATS, "parquet")),
    default="specforge",
    show_default=True,
    help="specforge (input_ids + loss_mask), conversations (turns as text), or parquet shards.",
)
@click.option(
    "--out",
    required=True,
    help="A JSONL file; for parquet a folder URL (local path, file://, s3://...), where the "
    "shards and .manifest.json go (options from TOKENMILL_STORAGE_OPTIONS).",
)
@click.option(
    "--per-turn",
    is_flag=True,
    help="A --turns all run: one row per regenerated turn (the specforge default; what "
    "SpecForge recommends for Kimi).",
)
@click.option(
    "--whole-conversation",
    is_flag=True,
    help="A --turns all run: one row per conversation whose every turn is done; specforge "
    "masks every regenerated assistant turn (the conversations default).",
)
@click.option(
    "--split",
    "split_text",
    default=None,
    metavar="eval=FRACTION",
    help="Hold out this share of row keys (every sample and turn of a row on one side) in "
    "OUT's .eval twin (r1.jsonl -> r1.eval.jsonl); OUT.manifest.json records the split.",
)
@click.option(
    "--seed",
    "split_seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of --split: the same seed gives the same split.",
)
@click.option(
    "--exclude",
    "exclude_file",
    type=click.Path(path_type=Path),
    default=None,
    help="A JSONL or Parquet file of prompts (an eval set): training rows whose prompt, "
    "rendered with the run's pinned template, is one of them are dropped and counted.",
)
@click.option(
    "--weight-version",
    default=None,
    metavar="V",
    help="Export only the samples made with this weight_version.",
)
@click.option(
    "--allow-mixed-weights",
    is_flag=True,
    help="Export samples of several weight versions together (refused otherwise).",
)
@click.option(
    "--with-images",
    is_flag=True,
    help="Copy every image the export references beside it (OUT's folder, or the parquet "
    "folder: images/<sha256>.<ext>, each once, its hash checked), point the rows at the "
    "copies by relative path, and list them with hashes and sizes in the manifest.",
)
@click.option(
    "--text-only",
    is_flag=True,
    help="Leave out the samples whose prompt holds an image (data for a text-only draft); "
    "the count left out is printed. specforge and conversations exports.",
)
@handle_errors
def export_cmd(
    run_name: str,
    fmt: str,
    out: str,
    per_turn: bool,
    whole_conversation: bool,
    split_text: str | None,
    split_seed: int,
    exclude_file: Path | None,
    weight_version: str | None,
    allow_mixed_weights: bool,
    with_images: bool,
    text_only: bool,
) -> None:
    """Write RUN_NAME's finished samples to --out: JSONL, or Parquet shards + .manifest.json.
    Every sample carries its weight_version and sampling_params; one weight version per export
    unless --allow-mixed-weights. Image rows carry the prompt ids as served (each image's
    tokens), their images (sha256, uri, size) and image_token_counts."""
    if fmt == "parquet" and (split_text or exclude_file or text_only):
        raise ConfigurationError(
            "--split, --exclude and --text-only apply to the specforge and conversations exports"
        )
    if fmt == "parquet":
        from ops.storage_cmd import export_to_storage

        export_to_storage(run_name, out, weight_version, allow_mixed_weights, with_images)
        return
    from app.ledger import run_queries
    from app.outputs.export import export_run

    db = open_db()
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
    tokenizer = None
    if whole_conversation or fmt == "conversations" or exclude_file:
        tokenizer = _export_tokenizer(run, whole_conversation=whole_conversation)
    selection = None
    if split_text or exclude_file:
        selection = _export_selection(run, tokenizer, split_text, split_seed, exclude_file)
    report = export_run(
        db,
        run,
        cast("ExportFormat", fmt),
        Path(out),
        tokenizer=tokenizer,
        per_turn=per_turn,
        whole_conversation=whole_conversation,
        selection=selection,
        weight_version=weight_version,
        allow_mixed_weights=allow_mixed_weights,
        with_images=with_images,
        text_only=text_only,
    )
    _print_export_report(report, Path(out), selection, with_images=with_images, text_only=text_only)


def _export_tokenizer(run: run_queries.RunInfo, *, whole_conversation: bool) -> ChatTokenizer:
    """The run's tokenizer with its pinned chat template (conversations, --whole-conversation,
    --exclude): refused when its custom code changed, a warning when other files did."""
    from rich.markup import escape

    from app.prompts.tokenization import load_for_run

    # the run's pinned --trust-remote-code covers the code it was made with, not changed code
    changes = pinned_folder_changes(run)
    if changes and run.generation.trust_remote_code:
        raise RunMismatch(
            f"the tokenizer files at {run.generation.tokenizer_path} changed since run {run.name} "
            f"pinned them, so their code is not run: {'; '.join(changes)}"
        )
    tokenizer = load_for_run(
        run.generation.tokenizer_path,
        trust_remote_code=run.generation.trust_remote_code,
        chat_pins=run.generation.chat_pins,
    )
    if whole_conversation and tokenizer.chat_template_hash != run.generation.chat_template_hash:
        # the loss mask spans come from the run's own template
        raise ConfigurationError(
            f"the chat template at {run.generation.tokenizer_path} differs from the one run "
            f"{run.name} pinned; --whole-conversation needs the run's own template"
        )
    if changes:
        err_console().print(
            f"[yellow]warning:[/yellow] the tokenizer at {escape(run.generation.tokenizer_path)} "
            f"changed since the run was created: {escape('; '.join(changes))}",
            markup=True,
            soft_wrap=True,
        )
    return tokenizer


def _export_selection(
    run: run_queries.RunInfo,
    tokenizer: ChatTokenizer | None,
    split_text: str | None,
    split_seed: int,
    exclude_file: Path | None,
) -> Selection:
    """Which rows go where: --split's held-out fraction and --exclude's prompts."""
    from app.outputs.split import Selection, load_exclusion, parse_split

    return Selection(
        eval_fraction=parse_split(split_text) if split_text else None,
        seed=split_seed,
        exclusion=(
            load_exclusion(exclude_file, run, tokenizer) if exclude_file and tokenizer else None
        ),
    )


def _print_export_report(
    report: ExportReport,
    out: Path,
    selection: Selection | None,
    *,
    with_images: bool,
    text_only: bool,
) -> None:
    """What the export wrote: samples and tokens, images copied, the split's files."""
    from rich.markup import escape

    from app.outputs.split import manifest_path

    console = err_console()
    left_out = f"; left out {report.image_rows_left_out} image samples" if text_only else ""
    console.print(
        f"wrote {counted(report.rows, 'sample')} ({report.truncated} truncated, "
        f"{counted(report.tokens, 'token')}) to {escape(str(report.path))}{left_out}"
    )
    if with_images:
        console.print(
            f"copied {report.images} images to {escape(str(out.parent / 'images'))}; "
            f"listed in {escape(str(manifest_path(out)))}"
        )
    if selection is not None:
        for line in selection.summary(out):
            console.print(escape(line))

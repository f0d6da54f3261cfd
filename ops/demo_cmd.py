"""`tokenmill demo`: the whole pipeline on embedded defaults, no services, no network.

Builds the Kimi-shaped fixture tokenizer, starts an emulator, runs, exports and checks.
"""

from __future__ import annotations

import json
import shlex
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ops.options import build_sampling, err_console, get_settings, handle_errors

if TYPE_CHECKING:
    from app.core.settings import Settings

PLACEHOLDER_ID = 163605  # the fixture's <|media_pad|>, as on Kimi-K2.5


def demo_prompts_path() -> Path:
    return Path(str(resources.files("emulator") / "data" / "demo_prompts.jsonl"))


def demo_image_prompts_path() -> Path:
    return Path(str(resources.files("emulator") / "data" / "demo_image_prompts.jsonl"))


def write_demo_images(folder: Path) -> None:
    """The images the demo's image rows show, drawn with Pillow: a bar chart, the same chart
    on a dashboard with an error-rate line, a receipt (sizes differ, so do their token counts)."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    chart = Image.new("RGB", (480, 320), "white")
    draw = ImageDraw.Draw(chart)
    for i, height in enumerate((120, 210, 90, 260, 170)):
        draw.rectangle((40 + 85 * i, 300 - height, 100 + 85 * i, 300), fill=(40, 90 + 30 * i, 200))
    draw.line((30, 300, 460, 300), fill="black", width=2)
    chart.save(folder / "chart.png")
    dashboard = Image.new("RGB", (800, 450), (245, 245, 245))
    dashboard.paste(chart, (20, 60))
    draw = ImageDraw.Draw(dashboard)
    draw.rectangle((0, 0, 800, 40), fill=(30, 30, 60))
    draw.text((12, 12), "errors / minute", fill="white")
    draw.line([(520, 380), (580, 350), (640, 360), (700, 280), (780, 200)], fill="red", width=4)
    dashboard.save(folder / "dashboard.png")
    receipt = Image.new("RGB", (300, 640), "white")
    draw = ImageDraw.Draw(receipt)
    for i, (item, price) in enumerate((("coffee", "3.20"), ("bagel", "2.80"), ("juice", "4.10"))):
        draw.text((20, 60 + 40 * i), item, fill="black")
        draw.text((220, 60 + 40 * i), price, fill="black")
    draw.line((20, 200, 280, 200), fill="black")
    draw.text((20, 215), "TOTAL", fill="black")
    draw.text((220, 215), "10.10", fill="black")
    receipt.save(folder / "receipt.jpg", quality=90)


def demo_input(folder: Path) -> Path:
    """The demo's input in folder: the bundled text prompts, then the image rows, whose
    relative image paths name the images written beside it (demo_images/)."""
    write_demo_images(folder / "demo_images")
    path = folder / "demo_prompts.jsonl"
    path.write_bytes(demo_prompts_path().read_bytes() + demo_image_prompts_path().read_bytes())
    return path


def check_export(path: Path, tokenizer_dir: Path, prompts: Path) -> tuple[int, int]:
    """Re-derive every exported prompt from the input turns (each image placeholder repeated
    as many times as the sample says its image took); count rows and mismatches."""
    from app.core.images import expand_placeholders
    from app.prompts.chat_path import merge_template_kwargs
    from app.prompts.inputs import read_prompts
    from app.prompts.tokenization import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)

    expected: dict[str, list[int]] = {}
    for record in read_prompts(prompts, content_format=tokenizer.content_format):
        if isinstance(record, Exception):
            continue
        expected[record.key] = (
            tokenizer.apply(
                record.messages,
                merge_template_kwargs({}, record.chat_template_kwargs, record.reasoning_effort),
                record.tools,
            )
            if record.messages
            else list(record.input_ids or [])
        )
    rows = bad = 0
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            rows += 1
            prompt = expected[row["id"]]
            if row.get("image_token_counts"):
                prompt = expand_placeholders(prompt, PLACEHOLDER_ID, row["image_token_counts"])
            n = len(prompt)
            ok = row["input_ids"][:n] == prompt and row["loss_mask"] == [0] * n + [1] * (
                len(row["input_ids"]) - n
            )
            bad += not ok
    return rows, bad


def shown(path: Path) -> str:
    """The path as a newcomer would type it: relative when it is under the current folder."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def demo_settings(base: Settings) -> tuple[Settings, dict[str, str]]:
    """Where the demo keeps its run, and the variables commands need to find it there.

    With no database configured the run goes to the default embedded ledger, where `status`,
    `report`, `verify` and `export` look anyway. A configured database may be shared, so it
    gets no demo run: the demo keeps a SQLite ledger of its own and its commands name it. The
    demo's images stay in its own folder's store too, which the commands name when it is not
    the configured one.
    """
    from app.core.settings import Settings

    overrides: dict[str, Any] = {"inflight": 32, "broker_url": None, "storage_url": None}
    env: dict[str, str] = {}
    if base.database_url is None:
        own = Settings(data_dir=base.data_dir, database_url=None, **overrides)
    else:
        own = Settings(data_dir=base.data_dir / "demo", database_url=None, **overrides)
        env["TOKENMILL_DATABASE_URL"] = f"sqlite:///{shown(own.data_dir / 'ledger.sqlite3')}"
    if own.resolved_storage_url() != base.resolved_storage_url():
        env["TOKENMILL_STORAGE_URL"] = shown(own.data_dir / "storage")
    return own, env


def inspect_commands(run_name: str, env: dict[str, str], out_dir: Path) -> list[str]:
    """The shell lines that look at a finished demo run: status, report, verify, export."""
    prefix = [f"{name}={shlex.quote(value)}" for name, value in env.items()]
    commands = [
        ["status", run_name],
        ["report", run_name, "--out", shown(out_dir / f"{run_name}.report")],
        ["verify", run_name],
        [
            "export",
            run_name,
            "--format",
            "parquet",
            "--out",
            shown(out_dir / f"{run_name}.parquet"),
        ],
    ]
    return [" ".join([*prefix, shlex.join(["tokenmill", *args])]) for args in commands]


@click.command("demo")
@click.option(
    "--samples-per-prompt",
    type=click.IntRange(1, 8),
    default=2,
    show_default=True,
    help="Samples generated for each bundled prompt.",
)
@click.option(
    "--max-new-tokens",
    type=int,
    default=1024,
    show_default=True,
    help="Generation budget per sample.",
)
@handle_errors
def demo_cmd(samples_per_prompt: int, max_new_tokens: int) -> None:
    """Run the whole pipeline locally: fixture tokenizer, emulator, run, export, verify."""
    from app.ledger import database, migrate, reads, run_queries
    from app.outputs.export import export_run
    from app.prompts.tokenization import load_tokenizer
    from emulator.fixtures.kimi import ensure_kimi_tokenizer
    from ops.emulator_proc import start_emulator
    from workers.engine.runner import EmbeddedRunner
    from workers.intake.producer import EnqueueOptions, enqueue

    console = err_console()
    base = get_settings()
    settings, env = demo_settings(base)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = database.get_engine(settings)
    migrate.ensure_schema(db, auto_upgrade=True)
    ledger_path = settings.data_dir / "ledger.sqlite3"
    console.print(f"demo ledger: {shown(ledger_path)} (SQLite, no services)")
    tokenizer_dir = ensure_kimi_tokenizer(base.data_dir / "tokenizers")
    tokenizer = load_tokenizer(tokenizer_dir)
    prompts = demo_input(settings.data_dir / "input")
    # the emulator renders with the same folder, so the runner's parity preflight has a server
    # rendering to compare the prompts with
    flags = ["--max-running", "32", "--median-tokens", "160", "--step-ms", "4", "--mm", "kimi"]
    emulator = start_emulator([*flags, "--tokenizer", str(tokenizer_dir)])
    console.print(f"SGLang emulator at {emulator.url}")
    try:
        run_name = time.strftime("demo-%Y%m%d-%H%M%S")
        opts: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.7,
            "top_p": 0.95,
            "top_k": -1,
            "min_p": 0.0,
            "seed": 1234,
        }
        report = enqueue(
            db,
            tokenizer,
            EnqueueOptions(
                input_path=prompts,
                run=run_name,
                sampling=build_sampling(opts),
                samples_per_prompt=samples_per_prompt,
            ),
            publish=None,
            settings=settings,  # the demo's own image store, where its runner reads them
        )
        console.print(f"enqueued {report.inserted} items from {report.prompts} prompts")
        with db.connect() as conn:
            run = run_queries.get_run(conn, run_name)
        runner = EmbeddedRunner(db, settings, run, [emulator.url])
        started = time.monotonic()
        runner.start()
        try:
            last = [0.0]

            def tick(c: reads.RunCounts) -> None:
                if time.monotonic() - last[0] > 2:
                    last[0] = time.monotonic()
                    console.print(
                        f"  {c.done + c.failed}/{c.total} finished, {c.output_tokens} output tokens"
                    )

            counts = runner.wait(on_tick=tick)
        finally:
            runner.stop()
        console.print(
            f"run {run_name}: {counts.done} done ({counts.truncated} truncated), "
            f"{counts.failed} failed in {time.monotonic() - started:.1f}s"
        )
    finally:
        emulator.stop()
    out_dir = base.data_dir / "demo" / "exports"
    out_dir.mkdir(parents=True, exist_ok=True)  # the demo's own folder (exports make none)
    specforge = export_run(db, run, "specforge", out_dir / f"{run_name}.specforge.jsonl")
    convs = export_run(
        db, run, "conversations", out_dir / f"{run_name}.conversations.jsonl", tokenizer=tokenizer
    )
    rows, bad = check_export(specforge.path, tokenizer_dir, prompts)
    console.print(f"checked {rows} exported samples against the chat template: {bad} mismatches")
    click.echo(f"specforge:     {specforge.path} ({specforge.rows} rows)")
    click.echo(f"conversations: {convs.path} ({convs.rows} rows)")
    if bad or counts.failed:
        raise SystemExit(1)
    click.echo("look at the run (from this folder):")
    for line in inspect_commands(run_name, env, out_dir):
        click.echo(f"  {line}")

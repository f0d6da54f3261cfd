"""Shared CLI plumbing: sampling options, settings and database opening, error reporting.

Every option that has a setting names its `TOKENMILL_*` environment variable and default in
--help as click names an option's own: `[env var: TOKENMILL_X; default: V]` (setting_option).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import unquote, urlsplit

import click

from app.core import constants
from app.core.errors import ConfigurationError, TokenmillError
from app.core.run_kinds import TurnsMode

# Start-up: every command module imports this one, so it imports only click and app.core.errors
# when loaded; rich, SQLAlchemy, pydantic, kombu and alembic load when a command uses them.
if TYPE_CHECKING:
    from rich.console import Console
    from sqlalchemy import Engine

    from app.core.contracts import SamplingParams
    from app.core.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def err_console() -> Console:
    """Where messages and progress go: stderr (a command's own output goes to stdout). Lines
    are never broken by rich (soft wrap): a printed path or command stays whole to copy."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


@functools.cache
def out_console() -> Console:
    """A command's own output (summaries): stdout, lines never broken by rich (soft wrap)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def get_settings() -> Settings:
    """The process's settings (app.core.settings, imported on first use)."""
    from app.core import settings

    return settings.get_settings()


class SettingOption(click.Option):
    """An option whose default is a setting: --help shows its variable and default the way
    click shows an option's own (`[env var: TOKENMILL_X; default: V]`), while the value stays
    None unless given, so the command reads the setting (app.core.settings is the only reader
    of the environment). `shown_default` is the setting's default as printed (a unit test
    compares it with the field's), so --help needs no settings loaded."""

    def __init__(self, *args: Any, setting: str, shown_default: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.setting = setting
        self.shown_default = shown_default

    def get_help_extra(self, ctx: click.Context) -> Any:
        extra = dict(super().get_help_extra(ctx))
        return {"envvars": (self.setting,), "default": self.shown_default} | extra


def setting_option(
    *decls: str, setting: str, shown_default: str, **kwargs: Any
) -> Callable[[F], F]:
    """click.option for an option that overrides the setting `setting` (see SettingOption)."""
    decorator: Callable[[F], F] = click.option(
        *decls, cls=SettingOption, setting=setting, shown_default=shown_default, **kwargs
    )
    return decorator


LOG_FORMATS = ("text", "json")

log_format_option = setting_option(
    "--log-format",
    type=click.Choice(LOG_FORMATS, case_sensitive=False),
    default=None,
    setting="TOKENMILL_LOG_FORMAT",
    shown_default="text",
    help="text, or json (one JSON object per line, for log shippers).",
)


_log_format_option: list[str] = []  # --log-format, when given


def setup_logging(level: str, log_format: str | None = None) -> None:
    """Log to stderr at level, as text or JSON lines (None: TOKENMILL_LOG_FORMAT, read at the
    first record), through app.core.logs' one configuration."""
    from app.core import logs

    _log_format_option[:] = [log_format] if log_format else []
    if log_format is None:
        _capture_warnings_if_json()
    elif log_format.lower() == "json":
        logging.captureWarnings(True)  # a bare warning line would break a JSON-lines reader
    logs.apply(logs.log_config(level, log_format or _configured_log_format))


def _capture_warnings_if_json() -> None:
    """At the first warning, route warnings into logging if the configured format is JSON
    (a bare warning line would break a JSON-lines reader), else show them as Python does."""
    original = warnings.showwarning

    def show_first(*args: Any, **kwargs: Any) -> None:
        warnings.showwarning = original
        if _configured_log_format().lower() == "json":
            logging.captureWarnings(True)  # replaces warnings.showwarning with logging's
        warnings.showwarning(*args, **kwargs)

    warnings.showwarning = show_first


def _configured_log_format() -> str:
    try:
        return get_settings().log_format
    except ValueError:  # invalid settings: the command itself reports them
        return "text"


def ledger_name(settings: Settings) -> str:
    """The ledger as a user recognizes it: the embedded one's file, else its URL (redacted)."""
    from app.core.settings import redact_url

    if settings.embedded:
        return str(settings.data_dir / "ledger.sqlite3")
    return redact_url(settings.resolved_database_url())


def broker_name(settings: Settings) -> str:
    """The broker as a user recognizes it: the embedded one's folder, else its URL (redacted)."""
    from app.core.settings import redact_url

    if settings.broker_url is None:
        return f"the folder {settings.broker_folder()}"
    return redact_url(settings.resolved_broker_url())


_announced: set[str] = set()


def announce_embedded(settings: Settings, *, broker: bool = False) -> None:
    """Say once per process that the embedded default ledger (and broker) is in use, so a
    forgotten TOKENMILL_DATABASE_URL (or TOKENMILL_BROKER_URL) is never a surprise. With JSON
    logs it is a log record (a bare line would break a JSON-lines reader)."""
    notes = []
    if settings.embedded and "ledger" not in _announced:
        notes.append(
            f"ledger: {ledger_name(settings)} (the embedded default; "
            "TOKENMILL_DATABASE_URL names another)"
        )
        _announced.add("ledger")
    if broker and settings.broker_url is None and "broker" not in _announced:
        notes.append(
            f"broker: {broker_name(settings)} (the embedded default; "
            "TOKENMILL_BROKER_URL names another)"
        )
        _announced.add("broker")
    log_format = (_log_format_option or [settings.log_format])[0]
    for note in notes:
        if log_format.lower() == "json":
            logging.getLogger("ops").info("%s", note)
        else:
            # plain click, not rich: a read command that needs no table never imports rich
            click.secho(note, err=True, dim=True)


def check_broker(settings: Settings) -> None:
    """Refuse a TOKENMILL_BROKER_URL whose scheme no transport has, before anything is written."""
    from app.core.broker_url import check_broker_url

    check_broker_url(settings.resolved_broker_url())


def open_db(settings: Settings | None = None) -> Engine:
    """The ledger engine; the embedded SQLite ledger is created/upgraded on first use (and
    named on stderr, once)."""
    from app.ledger import database, migrate

    settings = settings or get_settings()
    announce_embedded(settings)
    try:
        engine = database.get_engine(settings)
    except ValueError as exc:  # e.g. a port that is not a number
        raise ConfigurationError(f"TOKENMILL_DATABASE_URL is not a usable URL: {exc}") from exc
    migrate.ensure_schema(engine, auto_upgrade=settings.embedded)
    return engine


def handle_errors(func: F) -> F:
    """Turn tokenmill, database, broker and settings errors into one clear line and exit
    code 2 instead of a traceback; the line never holds a configured password."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            message = _error_line(exc)
            if message is None:
                raise
            # what the failure left behind, added where it happened (`exc.add_note`)
            notes = [_scrub(str(note)) for note in getattr(exc, "__notes__", ())]
            _fail("; ".join([message, *notes]))

    return wrapper  # type: ignore[return-value]


def _error_line(exc: Exception) -> str | None:
    """The one line handle_errors prints for exc, None for an error it lets through. A library
    that is not loaded cannot have raised: only loaded ones are asked (importing them here
    would put their start-up cost on every command)."""
    if isinstance(exc, TokenmillError):
        return _scrub(str(exc))
    if "sqlalchemy" in sys.modules:
        from sqlalchemy.exc import DBAPIError, SQLAlchemyError

        if isinstance(exc, SQLAlchemyError):
            # A DBAPIError's own text appends SQL and parameters: keep the driver's message.
            cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
            return f"the database {_redacted_url('database')} failed: {first_line(cause)}"
    if "kombu" in sys.modules:
        from kombu.exceptions import OperationalError as BrokerError

        if isinstance(exc, BrokerError):
            return f"the broker {_redacted_url('broker')} failed: {first_line(exc)}"
    if "botocore" in sys.modules:  # s3fs lets botocore's own errors through (no credentials)
        from botocore.exceptions import BotoCoreError

        if isinstance(exc, BotoCoreError):
            return _scrub(
                f"the object storage failed: {first_line(exc)} (TOKENMILL_STORAGE_OPTIONS or "
                "the AWS environment gives its credentials and endpoint)"
            )
    if "pydantic" in sys.modules:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            from app.core.settings import describe_invalid

            return _scrub(describe_invalid(exc))
    return None


def _fail(message: str) -> NoReturn:
    from rich.markup import escape

    err_console().print(f"[red]error:[/red] {escape(message)}", markup=True, soft_wrap=True)
    raise SystemExit(2)


def _configured_urls() -> dict[str, str]:
    try:
        settings = get_settings()
    except ValueError:  # invalid settings (pydantic's ValidationError is a ValueError)
        return {}
    return {
        "database": settings.resolved_database_url(),
        "broker": settings.resolved_broker_url(),
    }


def _redacted_url(which: str) -> str:
    url = _configured_urls().get(which)
    if not url:
        return "(not configured)"
    from app.core.settings import redact_url

    if which == "database":
        from sqlalchemy import make_url
        from sqlalchemy.exc import SQLAlchemyError

        try:
            make_url(url)
        except (ValueError, SQLAlchemyError):
            return "(an unparsable URL)"  # it may hold a password redact_url cannot find
    return redact_url(url)


def _passwords() -> set[str]:
    """The passwords of the configured URLs, as written and percent-decoded."""
    found: set[str] = set()
    for url in _configured_urls().values():
        try:
            password = urlsplit(url).password
        except ValueError:
            continue
        if password:
            found |= {password, unquote(password)}
    return found


def _scrub(text: str) -> str:
    """text with every configured password replaced."""
    for secret in _passwords():
        text = text.replace(secret, "***")
    return text


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 row`, `2 rows`: a count with its noun in the number it takes."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, passwords scrubbed (drivers may quote DSNs)."""
    text = str(exc).strip()
    return _scrub(text.splitlines()[0]) if text else type(exc).__name__


def sampling_options(func: F) -> F:
    """--max-new-tokens, --temperature, --top-p, --top-k, --min-p, --seed, samples, kwargs."""
    decorators = [
        click.option(
            "--max-new-tokens",
            type=int,
            default=2048,
            show_default=True,
            help="Generation budget per sample; sent explicitly.",
        ),
        click.option(
            "--temperature",
            default="1.0",
            show_default=True,
            metavar="T[,T...]",
            help="Softmax temperature: one value, or a cycle where sample k takes the k-th value "
            "(modulo), e.g. 0.6,0.8,1.0.",
        ),
        click.option(
            "--top-p",
            default="1.0",
            show_default=True,
            metavar="P[,P...]",
            help="Nucleus sampling mass, or a cycle of them.",
        ),
        click.option("--top-k", type=int, default=-1, show_default=True, help="-1 disables top-k."),
        click.option(
            "--min-p",
            default="0.0",
            show_default=True,
            metavar="P[,P...]",
            help="Smallest probability, relative to the likeliest token's, or a cycle of them.",
        ),
        click.option(
            "--reasoning-effort",
            default=None,
            metavar="E[,E...]",
            help="The template's reasoning_effort (none, low, medium, high, ...), or a cycle: "
            "sample k's prompt is templated with the k-th effort. A row's own wins. Pinned.",
        ),
        click.option(
            "--weight-version",
            default=None,
            metavar="V",
            help="Only servers reporting this weight_version serve the run (others skip it). "
            "Pinned.",
        ),
        click.option(
            "--seed",
            type=int,
            default=None,
            help="Sample k of a prompt uses seed + k (reproducible, distinct samples).",
        ),
        click.option(
            "--samples-per-prompt",
            type=click.IntRange(1, 1000),
            default=1,
            show_default=True,
            help="Samples generated for each prompt (sample k uses seed + k).",
        ),
        click.option(
            "--chat-template-kwargs",
            default=None,
            metavar="JSON",
            help="Extra template variables, e.g. '{\"thinking\": false}'.",
        ),
        click.option(
            "--turns",
            type=click.Choice([mode.value for mode in TurnsMode]),
            default=TurnsMode.LAST.value,
            show_default=True,
            help="last: regenerate the answer to the last user turn. all: regenerate every "
            "assistant turn in order, each prompt built from the regenerated history (a row "
            "with tool turns: the target's own calls, the dataset's cached results spliced "
            "in; see --tool-results). each: one independent sample per assistant turn (and "
            "a trailing user or tool turn), each on the original history before it: boundary "
            "samples, for agentic data. Pinned by the run.",
        ),
        click.option(
            "--tool-results",
            type=click.Choice(["cached"]),
            default="cached",
            show_default=True,
            help="--turns all on rows with tool turns: the i-th regenerated call gets the "
            "dataset's i-th tool result (tools are never run); the chain ends, its turns so "
            "far kept, at the first turn that does not match (another tool, parallel calls, a "
            "malformed call, no call, results exhausted).",
        ),
        click.option(
            "--parallel-calls",
            type=click.Choice(list(constants.PARALLEL_CALLS)),
            default=constants.PARALLEL_CALLS_END,
            show_default=True,
            help="--turns all on rows with tool turns: end: a turn of parallel calls (the "
            "target's or the dataset's) ends its chain. in-order: it goes on when the target "
            "makes as many calls as the dataset's turn, the i-th to the dataset's i-th tool; "
            "each cached result then answers the regenerated call in its place. Pinned by the "
            "run.",
        ),
        click.option(
            "--tool-call-parser",
            type=click.Choice(["kimi_k2", "qwen25", "qwen", "hermes", "deepseekv31"]),
            default=None,
            show_default="SGLang's template detection",
            help="Read the target's calls as a server started with --tool-call-parser NAME "
            "does (--turns all on rows with tool turns); pinned by the run.",
        ),
        click.option(
            "--trust-remote-code",
            is_flag=True,
            default=False,
            help="Allow the tokenizer folder's own Python code (off unless asked).",
        ),
        click.option(
            "--image-root",
            type=click.Path(exists=True, file_okay=False, path_type=Path),
            default=None,
            metavar="PATH",
            show_default="the input file's folder",
            help="The folder that relative image paths of the rows (image parts, LLaVA "
            "'image'/'images') are read from. Each image is stored once under its sha256 in "
            "the storage URL's images/ folder.",
        ),
    ]
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def render_options(func: F) -> F:
    """--render-with URL, --require-parity and the template choice (all pinned by the run)."""
    decorators = [
        click.option(
            "--chat-template-name",
            default=None,
            metavar="NAME",
            show_default="the first, as SGLang picks",
            help="Render with this one of the tokenizer's named templates, as a server started "
            "with --hf-chat-template-name NAME does; pinned by the run.",
        ),
        click.option(
            "--chat-template",
            "chat_template_file",
            default=None,
            metavar="FILE",
            help="Render with this .jinja file, as a server started with --chat-template FILE "
            "does; pinned by the run with the file's sha256.",
        ),
        click.option(
            "--pass-turn-fields",
            is_flag=True,
            default=False,
            help="Pass every field of a turn to the template; by default a turn keeps only "
            "the fields SGLang's request models keep for its role (a user turn: role and "
            "content), as the deployed server does. Pinned by the run.",
        ),
        click.option(
            "--no-request-fields",
            "no_request_fields",
            is_flag=True,
            default=False,
            help="Keep a row's tool_choice and continue_final_message as metadata only and "
            "render as if they were absent (by default they are applied as SGLang applies "
            'them: "none" renders no tools, a named choice only that tool; a continued final '
            "assistant turn ends the prompt). Pinned by the run.",
        ),
        click.option(
            "--render-with",
            default=None,
            metavar="URL",
            help="Build every prompt with this SGLang server's /v1/tokenize (its own chat "
            "path) instead of the local chat template; pinned by the run, later turns too.",
        ),
        click.option(
            "--require-parity",
            is_flag=True,
            default=False,
            help="Keep a server paused when its rendering of the run's prompts differs from "
            "the stored ones (checked when it is first seen healthy).",
        ),
    ]
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def build_sampling(kwargs: dict[str, Any]) -> SamplingParams:
    from app.core.contracts import SamplingParams
    from app.prompts.row_sampling import parse_cycle

    try:
        cycles = {
            name: parse_cycle(str(kwargs[name]), name.replace("_", "-"))
            for name in ("temperature", "top_p", "min_p")
        }
        return SamplingParams(
            max_new_tokens=kwargs["max_new_tokens"],
            temperature=cycles["temperature"][0],
            top_p=cycles["top_p"][0],
            top_k=kwargs["top_k"],
            min_p=cycles["min_p"][0],
            seed=kwargs["seed"],
            # one value is no cycle: the run reads as it always did
            temperature_cycle=cycles["temperature"] if len(cycles["temperature"]) > 1 else (),
            top_p_cycle=cycles["top_p"] if len(cycles["top_p"]) > 1 else (),
            min_p_cycle=cycles["min_p"] if len(cycles["min_p"]) > 1 else (),
        )
    except ValueError as exc:
        raise ConfigurationError(f"invalid sampling option: {exc}") from exc


def build_efforts(kwargs: dict[str, Any]) -> tuple[str | float, ...]:
    """`--reasoning-effort` as the cycle the run pins."""
    from app.prompts.row_sampling import parse_efforts

    try:
        return parse_efforts(kwargs.get("reasoning_effort"))
    except ValueError as exc:
        raise ConfigurationError(f"invalid --reasoning-effort: {exc}") from exc


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


field_option = click.option(
    "--field",
    "prompt_field",
    default=None,
    metavar="NAME",
    show_default="the first of messages, conversations, prompt, input_ids",
    help="The field (Parquet/datasets column) holding the prompt: turns, a prompt string or "
    "token ids.",
)

priority_option = click.option(
    "--priority",
    type=int,
    default=None,
    metavar="N",
    show_default="0",
    help="The run's priority, higher first: free slots of the fleet go to the highest-priority "
    "run with items, runs of one priority share them round robin; nothing in flight is "
    "aborted. Pinned by the run; `tokenmill priority RUN N` changes a live run's.",
)

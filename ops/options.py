"""Shared CLI plumbing: sampling options, settings and database opening, error reporting.

Every option that has a setting names its `TOKENMILL_*` environment variable in --help.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import unquote, urlsplit

import click

from app.core.errors import ConfigurationError, TokenmillError

# Start-up: every command module imports this one, so it imports only click and app.core.errors
# when loaded; rich, SQLAlchemy, pydantic, kombu and alembic load when a command uses them.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from sqlalchemy import Engine

    from app.core.contracts import SamplingParams
    from app.core.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def err_console() -> Console:
    """Where messages and progress go: stderr (a command's own output goes to stdout)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)


@functools.cache
def out_console() -> Console:
    """A command's own output (tables, summaries): stdout."""
    from rich.console import Console

    return Console(highlight=False)


def get_settings() -> Settings:
    """The process's settings (app.core.settings, imported on first use)."""
    from app.core import settings

    return settings.get_settings()


def print_table(table: Table) -> None:
    """A table on stdout, whole: rich drops columns that do not fit the terminal, so a table
    whose columns' minimum widths add up to more is printed wider instead."""
    from rich.console import Console

    out = out_console()
    needed = sum((column.min_width or 0) + 2 for column in table.columns)
    if needed <= out.width:
        out.print(table)
    else:  # Console.print never renders wider than the console it is called on
        Console(highlight=False, width=needed, force_terminal=out.is_terminal).print(table)


LOG_FORMATS = ("text", "json")

log_format_option = click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS, case_sensitive=False),
    default=None,
    help="text, or json (one JSON object per line, for log shippers); "
    "env TOKENMILL_LOG_FORMAT, default text.",
)


TEXT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str, log_format: str | None = None) -> None:
    """Log to stderr at level, as text or JSON lines (None: TOKENMILL_LOG_FORMAT)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format is None:
        # decided at the first record or warning: reading the settings loads pydantic, which
        # `--help` and commands that never log need not pay for
        handler.setFormatter(_ConfiguredFormatter())
        _capture_warnings_if_json()
    elif log_format.lower() == "json":
        handler.setFormatter(_formatter("json"))
        logging.captureWarnings(True)  # a bare warning line would break a JSON-lines reader
    else:
        handler.setFormatter(_formatter("text"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
    for noisy in ("httpx", "httpcore", "alembic.runtime.migration"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from app.prompts.tokenization import quiet_transformers  # transformers itself loads lazily

    quiet_transformers()


def _formatter(log_format: str) -> logging.Formatter:
    if log_format.lower() == "json":
        from app.core.logs import JsonFormatter

        return JsonFormatter()
    return logging.Formatter(TEXT_LOG_FORMAT)


class _ConfiguredFormatter(logging.Formatter):
    """Text or JSON lines as TOKENMILL_LOG_FORMAT says, chosen at the first record."""

    def __init__(self) -> None:
        super().__init__(TEXT_LOG_FORMAT)
        self._chosen: logging.Formatter | None = None

    def format(self, record: logging.LogRecord) -> str:
        if self._chosen is None:
            self._chosen = _formatter(_configured_log_format())
        return self._chosen.format(record)


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


def open_db(settings: Settings | None = None) -> Engine:
    """The ledger engine; the embedded SQLite ledger is created/upgraded on first use."""
    from app.ledger.database import get_engine
    from app.ledger.migrate import ensure_schema

    settings = settings or get_settings()
    try:
        engine = get_engine(settings)
    except ValueError as exc:  # e.g. a port that is not a number
        raise ConfigurationError(f"TOKENMILL_DATABASE_URL is not a usable URL: {exc}") from exc
    ensure_schema(engine, auto_upgrade=settings.embedded)
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
            _fail(message)

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
            return f"the database {_redacted_url('database')} failed: {_first_line(cause)}"
    if "kombu" in sys.modules:
        from kombu.exceptions import OperationalError as BrokerError

        if isinstance(exc, BrokerError):
            return f"the broker {_redacted_url('broker')} failed: {_first_line(exc)}"
    if "pydantic" in sys.modules:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            problems = "; ".join(
                f"TOKENMILL_{'_'.join(map(str, error['loc'])).upper()}: {_scrub(error['msg'])}"
                for error in exc.errors()
            )
            return f"invalid configuration: {problems}"
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


def _first_line(exc: BaseException) -> str:
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
            help="One value, or a cycle: sample k takes the k-th value (modulo), e.g. 0.6,0.8,1.0.",
        ),
        click.option(
            "--top-p", default="1.0", show_default=True, metavar="P[,P...]", help="Or a cycle."
        ),
        click.option("--top-k", type=int, default=-1, show_default=True, help="-1 disables top-k."),
        click.option(
            "--min-p", default="0.0", show_default=True, metavar="P[,P...]", help="Or a cycle."
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
            "--samples-per-prompt", type=click.IntRange(1, 1000), default=1, show_default=True
        ),
        click.option(
            "--chat-template-kwargs",
            default=None,
            metavar="JSON",
            help="Extra template variables, e.g. '{\"thinking\": false}'.",
        ),
        click.option(
            "--turns",
            type=click.Choice(["last", "all", "each"]),
            default="last",
            show_default=True,
            help="last: regenerate the answer to the last user turn. all: regenerate every "
            "assistant turn in order, each prompt built from the regenerated history (no tool "
            "turns). each: one independent sample per assistant turn (and a trailing user or "
            "tool turn), each on the original history before it: boundary samples, for "
            "agentic data. Pinned by the run.",
        ),
        click.option(
            "--trust-remote-code",
            is_flag=True,
            default=False,
            help="Allow the tokenizer folder's own Python code (off unless asked).",
        ),
    ]
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def render_options(func: F) -> F:
    """--render-with URL and --require-parity (both pinned by the run)."""
    decorators = [
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
    help="The field (Parquet/datasets column) holding the prompt: turns, a prompt string or "
    "token ids. Default: the first of messages, conversations, prompt, input_ids.",
)

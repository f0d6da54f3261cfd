"""Configuration of tokenmill: the only module that reads the environment.

Every value has an embedded default so one machine with no services runs the whole pipeline.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger(__name__)

ENV_PREFIX = "TOKENMILL_"
# TOKENMILL_* names that are not settings of this object: the emulator's flags
# (emulator/cli.py), the test suite's and benchmarks' services, docker-compose's bucket
OTHER_ENV_PREFIXES = ("TOKENMILL_EMULATOR_", "TOKENMILL_TEST_", "TOKENMILL_BENCH_")
OTHER_ENV_NAMES = ("TOKENMILL_BUCKET",)
MAX_INFLIGHT = 4096  # the largest fixed TOKENMILL_INFLIGHT


def default_data_dir() -> Path:
    return Path.cwd() / ".tokenmill"


class Settings(BaseSettings):
    """All settings, each also an environment variable `TOKENMILL_<NAME>`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)
    database_url: str | None = None
    # Postgres connections a process holds at most: a shared pool of db_pool - 1 (a worker's
    # group commits, claims and background threads take turns on it) and one of its own for
    # each window's lease heartbeat; whatever the window's size
    db_pool: int = Field(default=4, ge=2, le=256)
    # the database URL goes through a transaction pooler (PgBouncer, pool_mode = transaction):
    # psycopg then prepares no server-side statement (no state outlives a transaction)
    db_pooler: bool = False
    broker_url: str | None = None
    storage_url: str | None = None
    # passed to fsspec as the filesystem's options, e.g. for s3fs
    # {"endpoint_url": "http://127.0.0.1:9000", "key": "...", "secret": "..."} (a JSON object)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    # every process of the fleet sees the local storage folder at the same path (one machine,
    # or a folder every node mounts there: NFS): a local storage folder is then allowed with a
    # ledger or broker beyond loopback. single_machine is its older name and means the same
    storage_shared: bool = False
    single_machine: bool = False
    # rows per Parquet shard, of exports and of compaction
    shard_rows: int = Field(default=50_000, ge=1)
    # periodic compaction (beat): every compact_interval_s, runs with at least
    # compact_min_items finished items still in the ledger get their arrays moved to shards
    compact_interval_s: float = Field(default=600.0, gt=0)
    compact_min_items: int = Field(default=10_000, ge=1)

    # the server a worker process serves; unset, its name is host:port of sglang_url, a loopback
    # host standing for node_name (workers/engine/identity.py has the rule)
    sglang_url: str = "http://127.0.0.1:30000"
    server_name: str | None = None
    # the GPU node a worker runs on (its server's node): unset, this machine's host name
    node_name: str | None = None
    # the servers' --api-key (one for the fleet), sent as `Authorization: Bearer ...`
    sglang_api_key: SecretStr | None = None

    # requests a worker keeps in flight to its server: "auto" sizes the window from the server's
    # /server_info (its running batch plus a queue margin, shared among the server's workers)
    # and keeps it full from /v1/loads (workers/engine/sizing.py); a number is a fixed window
    inflight: int | Literal["auto"] = "auto"
    # auto: how often a worker reads its server's /v1/loads (each read is one small GET)
    autosize_probe_s: float = Field(default=2.0, gt=0)
    # item ids per task message: a message costs ~4-5 ms of worker CPU (bench/overhead.py)
    batch_size: int = Field(default=32, ge=1, le=1000)
    # Celery pool threads taking messages; the window does the sending
    worker_threads: int = Field(default=4, ge=1, le=256)
    # how long a message waits unclaimed for room in the window before its ids go back to the
    # queue (taking what fits): a busy worker never sits on items an idle server could run
    room_wait_s: float = Field(default=1.0, gt=0)
    # claimed items waiting beyond the in-flight ones: at most this many seconds of the
    # server's recent completions (0: always max(batch size, inflight/4))
    backlog_s: float = Field(default=0.1, ge=0)
    # at the end of a run, a worker with free slots runs a second copy of items still running
    # on other servers (first result wins; the other copy is aborted); checked this often
    hedge: bool = True
    hedge_interval_s: float = Field(default=0.2, gt=0)
    # a `--turns each` conversation's items go to one server one at a time, shortest first,
    # each once the one before it finished; a slot that would idle takes the next one once
    # the one before has been out this long (its prefill is done: the history is cached)
    group_stagger_s: float = Field(default=5.0, ge=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)

    connect_timeout_s: float = Field(default=5.0, gt=0)
    generate_timeout_s: float = Field(default=3600.0, gt=0)
    probe_timeout_s: float = Field(default=30.0, gt=0)
    # `tokenmill run` probes /health of every server it uses this often (never two probes to
    # one server at once), so it sees a drain (SIGTERM: 503 while /generate answers) at once
    probe_interval_s: float = Field(default=1.0, ge=0.1)
    # how long a draining server's requests in flight may take before they are given back
    server_drain_timeout_s: float = Field(default=90.0, ge=0)
    info_timeout_s: float = Field(default=30.0, gt=0)

    # `--render-with`: /v1/tokenize requests in flight, the read timeout of one, and how long
    # an enqueue waits for a render server that is down before it stops (a rerun completes it)
    render_window: int = Field(default=16, ge=1, le=1024)
    render_timeout_s: float = Field(default=120.0, gt=0)
    render_wait_s: float = Field(default=600.0, ge=0)
    # prompts a server re-renders when it is first seen healthy for a run (the parity preflight)
    parity_sample: int = Field(default=8, ge=0)

    lease_s: float = Field(default=300.0, gt=0)
    heartbeat_s: float = Field(default=30.0, gt=0)
    max_attempts: int = Field(default=5, ge=1)
    retry_backoff_s: float = Field(default=2.0, ge=0)
    retry_backoff_max_s: float = Field(default=120.0, ge=0)
    unavailable_wait_s: float = Field(default=5.0, ge=0)

    # watchdog: probes, thresholds, stall detection, worker-side pause enforcement
    watchdog_interval_s: float = Field(default=10.0, gt=0)
    failures_to_down: int = Field(default=3, ge=1)
    successes_to_up: int = Field(default=2, ge=1)
    stall_s: float = Field(default=600.0, gt=0)
    pause_check_s: float = Field(default=2.0, gt=0)
    reconcile_interval_s: float = Field(default=60.0, gt=0)
    # a queued item absent from the broker this long is published again
    reconcile_grace_s: float = Field(default=120.0, ge=0)
    restart_timeout_s: float = Field(default=1800.0, gt=0)

    visibility_timeout_s: int = Field(default=6 * 3600, ge=60)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    # "json": one JSON object per log line (CLI and workers), for log shippers
    log_format: Literal["text", "json"] = "text"

    # `tokenmill flower`: where it listens and its basic-auth credentials; beyond loopback it
    # refuses to start without a password
    flower_host: str = "127.0.0.1"
    flower_port: int = Field(default=5555, ge=1, le=65535)
    flower_user: str = "admin"
    flower_password: SecretStr | None = None

    # `tokenmill metrics`: beyond loopback it refuses to serve without both credentials
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=9464, ge=0, le=65535)
    metrics_user: str | None = None
    metrics_password: SecretStr | None = None
    metrics_cache_s: float = Field(default=2.0, ge=0)

    @field_validator("data_dir")
    @classmethod
    def _absolute_dir(cls, value: Path) -> Path:
        # a relative TOKENMILL_DATA_DIR names a folder of the current one, also where it becomes
        # a file:// URL (storage) or is handed to another process
        return value.expanduser().absolute()

    @field_validator("inflight", mode="before")
    @classmethod
    def _auto_or_count(cls, value: object) -> object:
        # one error naming the variable (a union would report each of its arms)
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            number = int(str(value).strip()) if not isinstance(value, bool) else None
        except ValueError:
            number = None
        if number is None or not 1 <= number <= MAX_INFLIGHT:
            raise ValueError(f"give 'auto' or a number from 1 to {MAX_INFLIGHT}, not {value!r}")
        return number

    @field_validator("sglang_url")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return value.rstrip("/")

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _normal_case(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str):
            return value
        return value.strip().upper() if info.field_name == "log_level" else value.strip().lower()

    @property
    def embedded(self) -> bool:
        """True when no services are configured: SQLite ledger, filesystem broker."""
        return self.database_url is None

    def resolved_database_url(self) -> str:
        if self.database_url:
            return normalize_database_url(self.database_url)
        return f"sqlite:///{self.data_dir / 'ledger.sqlite3'}"

    def resolved_node_name(self) -> str:
        return self.node_name or socket.gethostname()

    def resolved_broker_url(self) -> str:
        # the folder broker has no host; naming one keeps kombu from warning that it chose one
        return self.broker_url or "filesystem://localhost/"

    def broker_folder(self) -> Path:
        return self.data_dir / "broker"

    def resolved_storage_url(self) -> str:
        return self.storage_url or (self.data_dir / "storage").as_uri()


SECRET_OPTION_WORDS = ("secret", "password", "token", "key", "credential")


def redact_options(options: dict[str, Any]) -> dict[str, Any]:
    """storage_options with the values of secret-looking keys replaced, for `tokenmill config`."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, dict):
            out[name] = redact_options(value)
        elif any(word in name.lower() for word in SECRET_OPTION_WORDS) and value is not None:
            out[name] = "***"
        else:
            out[name] = value
    return out


def normalize_database_url(url: str) -> str:
    """Use psycopg 3 for plain postgres URLs."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def redact_url(url: str) -> str:
    """The URL with its password replaced, for logs and status output."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    host = netloc[1] if len(netloc) == 2 else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def setting_env_names() -> list[str]:
    """The environment variable of every setting, e.g. TOKENMILL_INFLIGHT."""
    return [ENV_PREFIX + name.upper() for name in Settings.model_fields]


def unknown_env_names(environ: Mapping[str, str]) -> list[str]:
    """One line per TOKENMILL_* variable that is no setting (a typo is otherwise silently
    ignored), naming the closest setting when one is close."""
    known = setting_env_names()
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known or upper in OTHER_ENV_NAMES:
            continue
        if upper.startswith(OTHER_ENV_PREFIXES):
            continue
        close = difflib.get_close_matches(upper, known, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        lines.append(f"{name} is not a tokenmill setting and is ignored{hint}")
    return lines


def describe_invalid(exc: ValidationError) -> str:
    """One line naming every invalid setting by its variable and why, e.g.
    "invalid configuration: TOKENMILL_LEASE_S: Input should be a valid number" (a check of
    our own says its message without pydantic's "Value error, " before it)."""
    problems = "; ".join(
        f"{ENV_PREFIX}{'_'.join(map(str, error['loc'])).upper()}: "
        + error["msg"].removeprefix("Value error, ")
        for error in exc.errors()
    )
    return f"invalid configuration: {problems}"


_env_checked = False


def _warn_unknown_env() -> None:
    """Warn once per process; the flag is set first, as a log handler may read the settings."""
    global _env_checked
    if _env_checked:
        return
    _env_checked = True
    for line in unknown_env_names(os.environ):
        log.warning("%s", line, extra={"action": "unknown_setting"})


def child_environment(
    extra: Mapping[str, str] | None = None, *, without_settings: bool = False
) -> dict[str, str]:
    """The environment for a child process: this process's (without any TOKENMILL_* variable
    when without_settings: the child reads only the settings given), then extra."""
    env = {
        k: v for k, v in os.environ.items() if not (without_settings and k.startswith(ENV_PREFIX))
    }
    env.update(extra or {})
    return env


@functools.cache
def get_settings() -> Settings:
    """The process's settings, read once; unknown TOKENMILL_* variables are warned about."""
    settings = Settings()
    _warn_unknown_env()
    return settings


__all__ = [
    "SecretStr",
    "Settings",
    "child_environment",
    "describe_invalid",
    "get_settings",
    "normalize_database_url",
    "redact_options",
    "redact_url",
    "unknown_env_names",
]

"""The one error tree of tokenmill.

Library exceptions are translated into these once, at the boundary, with ``raise ... from``.
"""

from __future__ import annotations


class TokenmillError(Exception):
    """Something went wrong in tokenmill."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


# --- outcomes of a generation request -------------------------------------------------


class GenerationError(TokenmillError):
    """A generation request did not produce a result."""


class PermanentError(GenerationError):
    """The server rejected the request; sending it again cannot succeed."""

    def __init__(self, message: str | None = None, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ServerRefusal(PermanentError):
    """The server rejected the request for a reason that can depend on the server: its
    context length or other request limits, its tokenizer or vocabulary. Final only once a
    second server of the run agrees (or no other exists); another server may serve it."""


class RetryableError(GenerationError):
    """The request failed in a way that may succeed when tried again (5xx, timeout, reset)."""

    def __init__(self, message: str | None = None, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ServerUnavailable(GenerationError):
    """The server is down, loading or shutting down; the item is not at fault."""

    def __init__(self, message: str | None = None, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class BackPressure(RetryableError):
    """The server is up but full (its request queue, or a gateway's 429): the request was fine,
    so it is sent again after a backoff and spends no attempt."""


class AuthRequired(ServerUnavailable):
    """The server answers 401/403: it wants an API key tokenmill does not send (or another)."""


# --- configuration and input ----------------------------------------------------------


class ConfigurationError(TokenmillError):
    """The configuration is invalid."""


class BrokerUnavailable(TokenmillError):
    """The broker could not be reached."""


class RunMismatch(ConfigurationError):
    """The run already exists with a different tokenizer, template or sampling parameters."""


class TokenizerError(ConfigurationError):
    """The tokenizer could not be loaded or has no usable chat template."""


class ServerCannotRender(ConfigurationError):
    """The server refuses to render a one-message chat on /v1/tokenize (no tokenizer or chat
    template): none of a run's prompts can be compared on it."""

    def __init__(self, server: str, refusal: str) -> None:
        self.server, self.refusal = server, refusal
        super().__init__(
            f"{server} cannot render chat prompts: /v1/tokenize refused a one-message chat "
            f"({refusal}); start it with the model's tokenizer and chat template (the "
            "emulator: --tokenizer DIR), or name a --server that has them"
        )


class InputError(TokenmillError):
    """A line of the input could not be used."""

    def __init__(self, reason: str, line: int | None = None, *, unit: str = "line") -> None:
        self.reason = reason
        self.line = line
        # "row" for Parquet and datasets inputs, whose rows stand in for lines
        self.unit = unit
        where = f"{unit} {line}: " if line is not None else ""
        super().__init__(f"{where}{reason}")


class NotFound(TokenmillError):
    """The requested object does not exist."""


class SchemaOutOfDate(ConfigurationError):
    """The database schema is not at the latest migration; run `tokenmill db upgrade`."""


class RunArchived(TokenmillError):
    """The run is archived: its items left the ledger's hot table, and it takes no new items."""


class ArchiveRefused(TokenmillError):
    """The run cannot be archived yet: it has unfinished or uncompacted items."""


class ServerBusy(TokenmillError):
    """The server still has workers or leased items; it stays registered."""

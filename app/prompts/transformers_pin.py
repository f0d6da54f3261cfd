"""The transformers version prompts are rendered as: the one the SGLang server pins, whatever
version the client has, or a refusal that names both.

SGLang 0.5.23 pins transformers 5.19.0. Client versions are known by how their
`apply_chat_template` differs from the server's: transformers 5.24 copies a turn's reasoning into
`thinking` (first) and `reasoning_content` (last) before the template runs
(`_alias_reasoning_fields`), which 5.19 does not do; `as_server_renders` undoes that for the
one call. A version not listed in KNOWN_CLIENTS is refused, since its differences are unknown.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from app.core.errors import ConfigurationError

SGLANG_VERSION = "0.5.23"
# the transformers version each supported SGLang version installs
SERVER_TRANSFORMERS = {"0.5.23": "5.19.0"}
# client versions whose differences from the server's rendering are known and undone here
KNOWN_CLIENTS = frozenset({"5.19.0", "5.24.0"})

_PATCH_LOCK = threading.Lock()
_IMPORT_LOCK = threading.Lock()


def imported_transformers() -> ModuleType:
    """transformers with AutoTokenizer resolved, imported by one thread at a time: the package
    swaps itself for a lazy module while it is first imported, and a thread importing from it
    meanwhile gets "cannot import name 'AutoTokenizer' from 'transformers'" (a worker's turn
    advancer, parity check and reconcile reach it from threads of their own). Every use of
    transformers in app/ calls this first; once imported it costs an uncontended lock."""
    with _IMPORT_LOCK:
        import transformers
        from transformers import AutoTokenizer  # noqa: F401  (resolves the lazy class)

        return transformers


@dataclass(frozen=True)
class TransformersPin:
    """The client's transformers version and the server's it renders as."""

    client: str
    server: str

    def to_json(self) -> dict[str, str]:
        return {"client": self.client, "renders_as": self.server}


def client_version() -> str:
    return str(imported_transformers().__version__)


def transformers_pin(sglang_version: str = SGLANG_VERSION) -> TransformersPin:
    """The pin for this client; ConfigurationError naming both versions when the client's
    rendering cannot be made the server's."""
    server = SERVER_TRANSFORMERS[sglang_version]
    client = client_version()
    if client != server and client not in KNOWN_CLIENTS:
        raise ConfigurationError(
            f"transformers {client} is installed, but SGLang {sglang_version} renders with "
            f"transformers {server}, and tokenmill does not know how {client} renders "
            f"differently; install transformers=={server} (pip install "
            f"'transformers=={server}'), or build the prompts on the server with --render-with"
        )
    return TransformersPin(client, server)


@contextlib.contextmanager
def as_server_renders() -> Iterator[None]:
    """Inside: apply_chat_template renders without the reasoning aliasing transformers 5.19
    does not have (a no-op on a client that has none)."""
    imported_transformers()
    from transformers.utils import chat_template_utils

    if not hasattr(chat_template_utils, "_alias_reasoning_fields"):
        yield
        return
    with _PATCH_LOCK:
        original = chat_template_utils._alias_reasoning_fields
        chat_template_utils._alias_reasoning_fields = _unaliased
        try:
            yield
        finally:
            chat_template_utils._alias_reasoning_fields = original


def _unaliased(chat: Any) -> Any:
    return list(chat)

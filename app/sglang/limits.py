"""The limits a server enforces itself: its context length (`--context-length`, in
`/server_info`), which its own length checks use and which may be smaller than the model
folder's `config.json` says. The server's value wins; the folder's is the fallback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ContextChoice:
    """The context length a run holds its prompts to, and the line that names a difference."""

    context_length: int | None
    notice: str | None


def context_length_of(server_info: dict[str, Any]) -> int | None:
    """The server's context length from its /server_info (None: it does not say)."""
    for key in ("context_length", "max_model_len"):
        value = server_info.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def choose_context(servers: dict[str, int | None], folder: int | None) -> ContextChoice:
    """The smallest context length the servers give, else the folder's; a notice when a
    server's differs from the folder's."""
    given = {name: n for name, n in servers.items() if n is not None}
    if not given:
        return ContextChoice(folder, None)
    smallest = min(given.values())
    differing = {name: n for name, n in given.items() if n != folder}
    if not differing:
        return ContextChoice(smallest, None)
    shown = ", ".join(f"{name} {n}" for name, n in sorted(differing.items()))
    said = "gives none" if folder is None else f"says {folder}"
    return ContextChoice(
        smallest,
        f"the servers' context length ({shown}; their --context-length) differs from the "
        f"tokenizer folder's (config.json {said}): prompts are held to {smallest}, the "
        "server's",
    )

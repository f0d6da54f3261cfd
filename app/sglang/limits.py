"""The limits a server enforces itself: its context length (`--context-length`, in
`/server_info`), which its own length checks use and which may be smaller than the model
folder's `config.json` says (the server's value wins; the folder's is the fallback); and the
limits a run pins with the fingerprint (context length, largest input, KV pool), which decide
whether a server admits a run's requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final


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


# The limits SGLang 0.5.23 checks each request against, as /server_info names them: the
# tokenizer manager's context length, the scheduler's largest input and its KV pool.
LIMIT_KEYS: Final = ("context_length", "max_req_input_len", "max_total_num_tokens")


def limits_of(server_info: dict[str, Any]) -> dict[str, int] | None:
    """The request limits a server reports in its /server_info (None: it reports none)."""
    found: dict[str, int] = {}
    context = context_length_of(server_info)
    if context is not None:
        found["context_length"] = context
    for key in LIMIT_KEYS[1:]:
        value = server_info.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found[key] = value
    return found or None


@dataclass(frozen=True)
class RequestNeed:
    """The largest request of a run (or one item): its longest prompt and the most tokens it
    asks to generate."""

    input_tokens: int
    max_new_tokens: int

    def __str__(self) -> str:
        return (
            f"{self.input_tokens + self.max_new_tokens} tokens ({self.input_tokens} of prompt + "
            f"{self.max_new_tokens} new)"
        )


def refusal(limits: dict[str, Any] | None, need: RequestNeed) -> str | None:
    """Why a server with these limits refuses a request of need, as SGLang decides it (the
    input at or past the context length, input + max_new_tokens past it, an input past the
    scheduler's largest, a request past the KV pool); None: it admits it, or says no limits."""
    if not limits:
        return None
    total = need.input_tokens + need.max_new_tokens
    checks = (
        ("context_length", need.input_tokens >= limits.get("context_length", total + 1)),
        ("context_length", total > limits.get("context_length", total)),
        ("max_req_input_len", need.input_tokens > limits.get("max_req_input_len", total)),
        ("max_total_num_tokens", total > limits.get("max_total_num_tokens", total)),
    )
    for key, refused in checks:
        if refused:
            return f"{key} {limits[key]} < {need}"
    return None


def largest_input(limits: dict[str, Any] | None, max_new_tokens: int) -> int | None:
    """The longest prompt these limits admit with max_new_tokens to generate (None: they say
    nothing): the bound of the requests a run pinned its limits for."""
    if not limits:
        return None
    bounds = []
    if "context_length" in limits:
        context = int(limits["context_length"])
        bounds.append(min(context - 1, context - max_new_tokens))
    if "max_req_input_len" in limits:
        bounds.append(int(limits["max_req_input_len"]))
    if "max_total_num_tokens" in limits:
        bounds.append(int(limits["max_total_num_tokens"]) - max_new_tokens)
    return min(bounds) if bounds else None


def limit_changes(pinned: dict[str, Any] | None, now: dict[str, Any] | None) -> list[str]:
    """Lines like "context_length: 8192 → 1024" for every limit that differs."""
    before, after = pinned or {}, now or {}
    return [
        f"{key}: {before.get(key)} → {after.get(key)}"
        for key in LIMIT_KEYS
        if before.get(key) != after.get(key)
    ]

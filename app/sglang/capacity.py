"""A server's capacity and live load as SGLang 0.5.23 reports them: `/server_info` (server args
and `internal_states[]` per DP rank) and `/v1/loads` (`LoadSnapshot` per DP rank).

Plain parsing, no I/O: the client fetches the bodies, these functions read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Capacity:
    """What the server runs at once, over all its DP ranks."""

    max_running: int  # requests in the running batch (effective_max_running_requests_per_dp x dp)
    max_total_tokens: int | None  # the KV pool in tokens (token_capacity / max_total_num_tokens)
    chunked_prefill: int | None  # chunked_prefill_size (None: off or not reported)
    dp_size: int
    # where max_running came from: "internal_states" (what the scheduler really uses) or
    # "server_args" (--max-running-requests, when internal_states do not say)
    source: str

    def to_json(self) -> dict[str, Any]:
        return {
            "max_running": self.max_running,
            "max_total_tokens": self.max_total_tokens,
            "chunked_prefill": self.chunked_prefill,
            "dp_size": self.dp_size,
            "source": self.source,
        }


@dataclass(frozen=True)
class Load:
    """The server's load now, summed over its DP ranks (`/v1/loads`)."""

    running: int  # num_running_reqs
    waiting: int  # num_waiting_reqs: requests queued on the server
    token_usage: float  # the fullest rank's KV pool use, 0..1
    max_running: int | None  # the scheduler's max_running_requests, all ranks (None: unknown)
    max_total_tokens: int | None


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = int(value)
    return number if number > 0 else None


def _per_rank_sum(
    states: Sequence[Any], read: Callable[[Mapping[str, Any]], int | None], dp_size: int
) -> int | None:
    """The sum over ranks of a per-rank figure: one state per rank, or one standing for all."""
    values = [read(s) for s in states if isinstance(s, Mapping)]
    known = [v for v in values if v is not None]
    if not known:
        return None
    if len(known) >= dp_size:
        return sum(known)
    return known[0] * dp_size


def capacity_of(server_info: Mapping[str, Any]) -> Capacity | None:
    """The capacity `/server_info` reports; None when it says nothing of its running batch."""
    dp_size = _positive_int(server_info.get("dp_size")) or 1
    states = server_info.get("internal_states")
    states = states if isinstance(states, list) else []
    running = _per_rank_sum(
        states, lambda s: _positive_int(s.get("effective_max_running_requests_per_dp")), dp_size
    )
    source = "internal_states"
    if running is None:
        # the server arg is the whole server's (the scheduler divides it among DP ranks)
        running = _positive_int(server_info.get("max_running_requests"))
        source = "server_args"
    if running is None:
        return None

    def token_capacity(state: Mapping[str, Any]) -> int | None:
        memory = state.get("memory_usage")
        return _positive_int(memory.get("token_capacity")) if isinstance(memory, Mapping) else None

    tokens = _per_rank_sum(states, token_capacity, dp_size)
    if tokens is None:
        top = _positive_int(server_info.get("max_total_num_tokens"))
        tokens = None if top is None else top * dp_size
    return Capacity(
        max_running=running,
        max_total_tokens=tokens,
        chunked_prefill=_positive_int(server_info.get("chunked_prefill_size")),
        dp_size=dp_size,
        source=source,
    )


def load_of(body: Mapping[str, Any]) -> Load:
    """The load of a `/v1/loads` body (`{"loads": [LoadSnapshot.to_dict(), ...]}`); ValueError
    when it holds no loads."""
    loads = body.get("loads")
    if not isinstance(loads, list) or not any(isinstance(x, Mapping) for x in loads):
        raise ValueError("/v1/loads answered no loads")
    ranks = [x for x in loads if isinstance(x, Mapping)]

    def total(key: str) -> int:
        return sum(_positive_int(r.get(key)) or 0 for r in ranks)

    def total_or_none(key: str) -> int | None:
        value = total(key)
        return value if value > 0 else None

    usage = [r.get("token_usage") for r in ranks]
    return Load(
        running=total("num_running_reqs"),
        waiting=total("num_waiting_reqs"),
        token_usage=max((float(u) for u in usage if isinstance(u, int | float)), default=0.0),
        max_running=total_or_none("max_running_requests"),
        max_total_tokens=total_or_none("max_total_num_tokens"),
    )

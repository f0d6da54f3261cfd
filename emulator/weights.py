"""The emulator's live weights: what /model_info reports, the model-update lock, in-place updates
(`/update_weights_from_disk`, `/update_weight_version`) and each request's weight-version spans.

As SGLang 0.5.23: every /generate holds the update lock shared from parsing to its last answer;
an update takes it exclusively (a waiting update blocks new requests), loads, flushes the radix
cache, then the new `weight_version` is what every answer carries. `/update_weight_version`
takes no lock and, by default, aborts what is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.core.errors import TokenmillError

# the update body's fields and their types (io_struct.UpdateWeightFromDiskReqInput)
DISK_FIELDS: dict[str, tuple[type, ...]] = {
    "model_path": (str,),
    "load_format": (str,),
    "abort_all_requests": (bool,),
    "weight_version": (str,),
    "is_async": (bool,),
    "torch_empty_cache": (bool,),
    "keep_pause": (bool,),
    "recapture_cuda_graph": (bool,),
    "token_step": (int,),
    "flush_cache": (bool,),
    "manifest": (dict,),
    "rid": (str,),
}
VERSION_FIELDS: dict[str, tuple[type, ...]] = {
    "new_version": (str,),
    "abort_all_requests": (bool,),
    "rid": (str,),
}
UPDATED = "Succeeded to update model weights."
FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)


class BadBody(TokenmillError, ValueError):
    """The body does not validate (FastAPI's 400 with SGLang's ErrorResponse shape)."""


def check_body(
    body: Any, fields: dict[str, tuple[type, ...]], required: str, struct: str
) -> dict[str, Any]:
    """The body as the request model takes it: an object, the required field present, every
    known field of its type (null where optional); unknown fields are ignored."""
    if not isinstance(body, dict):
        raise BadBody(f"1 validation error for {struct}: Input should be an object")
    if not isinstance(body.get(required), str):
        what = "Field required" if required not in body else "Input should be a valid string"
        raise BadBody(f"1 validation error for {struct}\n{required}\n  {what}")
    for name, types in fields.items():
        value = body.get(name)
        if value is None or name == required:
            continue
        ok = isinstance(value, types) and not (types == (int,) and isinstance(value, bool))
        if not ok:
            expected = {str: "string", bool: "boolean", int: "integer", dict: "dictionary"}
            raise BadBody(
                f"1 validation error for {struct}\n{name}\n  Input should be a valid "
                f"{expected[types[0]]}"
            )
    return body


@dataclass
class VersionEvent:
    """A weight-version change while a request had produced output (utils/weight_versions)."""

    old_version: str
    num_output_tokens: int


def version_spans(
    events: list[VersionEvent], current: str, num_output_tokens: int
) -> list[dict[str, Any]]:
    """`meta_info.weight_versions` of a finished request: one span per version its output
    tokens came under (compute_weight_version_spans, then the visible ones)."""
    changes = [(e.old_version, e.num_output_tokens) for e in events] + [
        (current, num_output_tokens)
    ]
    spans: list[dict[str, Any]] = []
    for version, end in changes:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": version, "start": start, "end": end})
    return [s for s in spans if s["start"] < num_output_tokens or s["start"] == 0]


class UpdateLock:
    """A writer-preferring asyncio reader/writer lock (SGLang's RWLock): readers share it,
    a writer has it alone, and a waiting writer keeps new readers out."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writing and not self._readers)
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()

    @property
    def updating(self) -> bool:
        return self._writing or self._writers_waiting > 0


@dataclass
class Weights:
    """The weights a server holds now: /model_info's fields a weight update moves."""

    model_path: str
    weight_version: str
    load_format: str = "auto"
    updates: int = 0
    lock: UpdateLock = field(default_factory=UpdateLock)


def load_error(model_path: str) -> str | None:
    """Why loading model_path fails, or None. A local path (absolute, or starting with `.`)
    must exist; any other name is taken as a hub id, which the emulator never downloads."""
    if model_path.startswith(("/", ".")) and not os.path.exists(model_path):
        return f"Failed to get weights iterator: Cannot find any model weights with `{model_path}`."
    return None

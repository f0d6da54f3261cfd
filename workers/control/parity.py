"""Parity: a server re-renders a run's stored prompts through its /v1/tokenize and each one is
compared with the stored ids; the preflight does it for a small sample when a server is first
seen healthy for a run, records a `parity` event and keeps the result on the server.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Engine

from app.core.constants import EVENT_PARITY
from app.core.errors import GenerationError, InputError, PermanentError, ServerCannotRender
from app.core.settings import Settings, get_settings
from app.ledger import common, event_log, reads, registry, run_queries
from app.prompts.transformers_pin import SERVER_TRANSFORMERS, client_version
from app.sglang.render import (
    RENDER_PROBE,
    RenderClient,
    RenderRequest,
    prompt_request,
    render_client,
)
from app.storage.image_store import image_location
from workers.intake.images import StoredImages

log = logging.getLogger(__name__)

# tokens shown on each side of the first difference
CONTEXT_TOKENS = 12


@dataclass(frozen=True)
class Mismatch:
    """One stored prompt the server renders differently: where, and both sides around it."""

    item_id: int
    item_key: str
    sample_index: int
    turn_index: int
    position: int | None  # first differing token; None when the server refused the prompt
    stored_tokens: int
    server_tokens: int
    before: str = ""  # the common text just before the difference
    stored: str = ""  # the stored prompt from the difference on (a few tokens)
    server: str = ""  # the server's rendering from the difference on
    stored_ids: list[int] = field(default_factory=list)
    server_ids: list[int] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "item": self.item_id,
            "key": self.item_key,
            "sample": self.sample_index,
            "turn": self.turn_index,
            "position": self.position,
            "stored_tokens": self.stored_tokens,
            "server_tokens": self.server_tokens,
            "before": self.before,
            "stored": self.stored,
            "server": self.server,
            "stored_ids": self.stored_ids,
            "server_ids": self.server_ids,
            "error": self.error,
        }


@dataclass
class ParityReport:
    run: str
    server: str
    checked: int = 0
    equal: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    # the transformers versions the prompts were rendered with and this client has, and the
    # server's SGLang version with the transformers version it pins (versions_of)
    versions: dict[str, str | None] = field(default_factory=dict)
    # the server renders no chat at all (render_preflight): its refusal; nothing was checked
    refusal: str | None = None

    @property
    def mismatched(self) -> int:
        return len(self.mismatches)

    @property
    def status(self) -> str:
        """equal; differs; or unchecked: the server refused every prompt (a server without
        /v1/tokenize or without a tokenizer cannot say how it renders them)."""
        if self.refusal is not None:
            return "unchecked"
        if not self.mismatches:
            return "equal"
        if not self.equal and all(m.position is None for m in self.mismatches):
            return "unchecked"
        return "differs"

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "server": self.server,
            "checked": self.checked,
            "equal": self.equal,
            "mismatched": self.mismatched,
            "versions": dict(self.versions),
            "mismatches": [m.to_json() for m in self.mismatches],
        }


def versions_of(run: run_queries.RunInfo, server_version: str | None) -> dict[str, str | None]:
    """The client's and the server's versions side by side: the transformers the run's prompts
    were rendered with (and rendered as), the one installed here, the server's SGLang and the
    transformers that SGLang version pins (None where unknown)."""
    pins = run.generation.chat_pins or {}
    return {
        "run_transformers": pins.get("transformers"),
        "run_renders_as": pins.get("renders_as"),
        "client_transformers": client_version(),
        "server_sglang": server_version,
        "server_transformers": SERVER_TRANSFORMERS.get(server_version or ""),
    }


def first_difference(stored: Sequence[int], rendered: Sequence[int]) -> int | None:
    """Index of the first token where the two differ (the shorter length if one is a prefix
    of the other), or None when they are equal."""
    for i, (a, b) in enumerate(zip(stored, rendered, strict=False)):
        if a != b:
            return i
    return None if len(stored) == len(rendered) else min(len(stored), len(rendered))


def item_request(
    item: reads.StoredItem, run: run_queries.RunInfo, images: StoredImages | None = None
) -> RenderRequest:
    """What the server re-renders for a stored item: what built its prompt (its turns, its
    row's tools, its merged kwargs or else the run's), as `--render-with` sends it: image
    parts as data URIs of the stored images (InputError if one cannot be read)."""
    kwargs = item.chat_template_kwargs
    if kwargs is None:
        kwargs = run.generation.chat_template_kwargs
    messages = item.messages or []
    if images is not None:
        messages = images.for_server(messages)
    return prompt_request(
        messages, kwargs, tools=item.tools, assistant_prefix=item.assistant_prefix
    )


def _requests(
    items: Sequence[reads.StoredItem], run: run_queries.RunInfo, images: StoredImages
) -> list[RenderRequest | PermanentError]:
    out: list[RenderRequest | PermanentError] = []
    for item in items:
        try:
            out.append(item_request(item, run, images))
        except InputError as exc:  # compared as a prompt the server could not render
            out.append(PermanentError(exc.reason))
    return out


def render_preflight(client: RenderClient, server: str) -> None:
    """The server renders a one-message chat before any stored prompt is sent: a server with
    no tokenizer or chat template refuses every prompt, and that is said once
    (ServerCannotRender), not once per prompt. An outage raises as in check_run."""
    try:
        client.render_patiently(RENDER_PROBE[0])
    except PermanentError as exc:
        raise ServerCannotRender(server, str(exc)) from exc


def check_run(
    db: Engine,
    run: run_queries.RunInfo,
    client: RenderClient,
    *,
    server: str,
    sample: int | None = None,
    seed: int = 0,
    page: int = 256,
    images: StoredImages | None = None,
) -> ParityReport:
    """Re-render the run's prompts (all, or a seeded sample) and compare each with its stored
    ids, images sent from the image store (images: the run's pinned store unless given).
    An outage of the server raises (ServerUnavailable, RetryableError): nothing is known; a
    server that renders no chat at all raises ServerCannotRender (render_preflight)."""
    if images is None:
        images = StoredImages(lambda: image_location(get_settings(), run.storage_url))
    with db.connect() as conn:
        if sample is None:
            ids = reads.prompt_item_ids(conn, run.id)
        else:  # through the indexes: a preflight of a 10M-item run reads what it samples
            ids = reads.sample_prompt_item_ids(conn, run.id, sample, seed)
    if ids:
        render_preflight(client, server)
    report = ParityReport(
        run=run.name, server=server, versions=versions_of(run, client.server_version())
    )
    for start in range(0, len(ids), page):
        with db.connect() as conn:
            page_items = reads.stored_prompts(conn, ids[start : start + page])
        stored = [i for i in page_items if i.messages is not None]
        prepared = _requests(stored, run, images)
        rendered = iter(client.render_many([r for r in prepared if isinstance(r, RenderRequest)]))
        answers = [next(rendered) if isinstance(r, RenderRequest) else r for r in prepared]
        for item, answer in zip(stored, answers, strict=True):
            report.checked += 1
            mismatch = _compare(client, item, answer)
            if mismatch is None:
                report.equal += 1
            else:
                report.mismatches.append(mismatch)
    return report


def _compare(
    client: RenderClient, item: reads.StoredItem, answer: list[int] | PermanentError
) -> Mismatch | None:
    where = Mismatch(
        item_id=item.id,
        item_key=item.item_key,
        sample_index=item.sample_index,
        turn_index=item.turn_index,
        position=None,
        stored_tokens=len(item.prompt_ids),
        server_tokens=0,
    )
    if isinstance(answer, PermanentError):
        return replace(where, error=str(answer))
    position = first_difference(item.prompt_ids, answer)
    if position is None:
        return None
    lo = max(0, position - CONTEXT_TOKENS)
    stored_ids = item.prompt_ids[position : position + CONTEXT_TOKENS]
    server_ids = answer[position : position + CONTEXT_TOKENS]
    try:
        before, stored, server = client.detokenize(
            [item.prompt_ids[lo:position], stored_ids, server_ids]
        )
    except GenerationError as exc:  # the ids still say where they differ
        log.warning(
            "could not decode the difference of item %d (%s)",
            item.id,
            exc,
            extra={"action": "parity_undecodable"},
        )
        before, stored, server = "", "", ""
    return replace(
        where,
        position=position,
        server_tokens=len(answer),
        before=before,
        stored=stored,
        server=server,
        stored_ids=list(stored_ids),
        server_ids=list(server_ids),
    )


# --- the preflight -------------------------------------------------------------------------------


def preflight(
    db: Engine, settings: Settings, run: run_queries.RunInfo, server: str, url: str
) -> ParityReport | None:
    """Check `settings.parity_sample` of the run's prompts on the server, keep the result on a
    registered server, and record a `parity` event when the outcome is new for it (a first
    check, or a change); None if the server could not answer."""
    if settings.parity_sample <= 0:
        return None
    try:
        with render_client(url, settings, wait_s=0.0) as client:
            report = check_run(
                db,
                run,
                client,
                server=server,
                sample=settings.parity_sample,
                images=StoredImages(lambda: image_location(settings, run.storage_url)),
            )
    except ServerCannotRender as exc:
        report = ParityReport(run=run.name, server=server, refusal=exc.refusal)
    except GenerationError as exc:
        log.warning(
            "parity preflight of run %s on %s not done: %s",
            run.name,
            server,
            exc,
            extra={"action": "parity_skipped"},
        )
        return None
    status = report.status
    result = {
        "status": status,
        "checked": report.checked,
        "mismatched": report.mismatched,
        "at": common.utcnow().isoformat(),
    }
    if not report.checked and report.refusal is None:  # no prompt from messages: nothing to check
        with db.begin() as conn:
            registry.record_parity(conn, server, run.name, result)
        return report
    message = (
        f"{server} renders {report.equal} of {report.checked} sampled prompts of run "
        f"{run.name} as stored"
    )
    if status == "unchecked":
        why = report.refusal if report.refusal is not None else report.mismatches[0].error
        message = (
            f"{server} cannot render the prompts of run {run.name} ({why}); their parity is not "
            "checked"
        )
    elif report.mismatches:
        first = report.mismatches[0]
        message += (
            f"; {report.mismatched} differ (item {first.item_id}"
            + (f" at token {first.position}" if first.position is not None else "")
            + "): see `tokenmill parity "
            + f"{run.name} --server {server}`"
        )
    with db.begin() as conn:
        before = registry.parity_status(conn, server, run.name)
        registry.record_parity(conn, server, run.name, result)
        if before != status:  # a re-check with the same outcome is not news
            event_log.record_event(
                conn,
                EVENT_PARITY,
                message,
                run_id=run.id,
                server=server,
                details=report.to_json() | {"mismatches": report.to_json()["mismatches"][:5]},
            )
    if before != status:
        (log.warning if status != "equal" else log.info)("%s", message)
    return report


class ParityGate:
    """The preflight as the watchdog uses it: each active run is checked on a healthy server
    the first time it is seen (or every time with again=True, when the server comes back)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def blocking_runs(self, db: Engine, server: registry.ServerInfo, *, again: bool) -> list[str]:
        """`--require-parity` runs whose prompts the server renders differently."""
        with db.connect() as conn:
            # a run the server never serves (`tokenmill run`'s, one bound elsewhere) is not its
            # to check: a check would cost the server renders for nothing
            active = registry.active_runs(conn, server.name)
        known = server.parity or {}
        blocking = []
        for run_id, name, required in active:
            status = (known.get(name) or {}).get("status")
            if again or status is None:
                with db.connect() as conn:
                    run = run_queries.get_run_by_id(conn, run_id)
                report = preflight(db, self.settings, run, server.name, server.url)
                if report is not None:
                    status = report.status
            if required and status == "differs":
                blocking.append(name)
        return blocking

"""Multi-turn chains (`--turns all`): the items of a conversation at enqueue, and advancing a
chain when a turn finishes, its next prompt templated from the regenerated history.

Advancing is idempotent (a conditional waiting → pending update); workers do it right after
committing results, reconcile and the embedded runner catch up on whatever was missed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine

from app.core import constants
from app.core.constants import EVENT_TURNS_BLOCKED, TOOL_CALL_PARSERS
from app.core.contracts import PromptRecord
from app.core.errors import GenerationError, InputError, PermanentError, TokenmillError
from app.core.settings import get_settings
from app.ledger import event_log, reads, run_queries, turns
from app.ledger import queue as ledger_queue
from app.ledger.queue import NewItem
from app.ledger.reads import StoredItem
from app.ledger.run_queries import RunInfo
from app.ledger.turns import WaitingTurn
from app.outputs.export import assistant_turn
from app.prompts import tool_calls
from app.prompts.chat_path import check_version, image_urls, normalize_messages
from app.prompts.conversation import (
    TurnPlan,
    next_history,
    split_boundaries,
    split_turns,
    tool_turn_position,
)
from app.prompts.image_pins import check_image_prompt
from app.prompts.tokenization import ChatTokenizer, load_for_run
from app.prompts.tokenizer_files import folder_changes
from app.sglang.render import RenderClient, prompt_request, render_client
from app.storage.image_store import image_location
from workers.intake.images import StoredImages, images_of, refs_json

log = logging.getLogger(__name__)

ADVANCE_PAGE = 500
# a run whose tokenizer could not be used is tried again after this long (it may be fixed)
BLOCKED_RETRY_S = 60.0


# --- enqueue ---------------------------------------------------------------------------------


def first_turns(
    records: Sequence[PromptRecord],
    plans: dict[str, list[TurnPlan]],
    fail: Callable[[InputError], None],
    tool_call_parser: str | None = None,
) -> list[PromptRecord]:
    """Records whose messages are turn 0's prompt turns; each chat record's turn plans go to
    plans (by key). Pre-tokenized records stay single-turn; a conversation that cannot be
    split is reported through fail and dropped. A row with tool turns becomes an on-policy
    agentic chain (the dataset's cached tool results spliced in after the regenerated calls,
    read with tool_call_parser, the run's); with no parser it is refused."""
    out: list[PromptRecord] = []
    for record in records:
        if record.messages is None:
            out.append(record)
            continue
        conversation = record.conversation or record.messages
        tool_at = tool_turn_position(conversation)
        if tool_at is not None and tool_call_parser is None:
            fail(
                InputError(
                    f"messages[{tool_at}] is a tool call or tool result, and the run has no "
                    "tool-call parser to read the regenerated calls with (SGLang's template "
                    "detection names none implemented here for this tokenizer): pass "
                    f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}), or use --turns each",
                    record.line,
                )
            )
            continue
        if record.assistant_prefix is not None:
            fail(
                InputError(
                    "continue_final_message: --turns all regenerates every assistant turn, so "
                    "none is continued; use --turns last or each (the final turn continued), "
                    "or --no-request-fields",
                    record.line,
                )
            )
            continue
        try:
            split = split_turns(conversation, keep_calls=tool_at is not None)
        except InputError as exc:
            fail(InputError(exc.reason, record.line))
            continue
        plans[record.key] = split
        out.append(replace(record, messages=split[0].context, conversation=None))
    return out


def boundary_records(
    records: Sequence[PromptRecord], fail: Callable[[InputError], None]
) -> tuple[list[PromptRecord], list[int]]:
    """`--turns each`: one record per boundary sample of each chat record (shortest first;
    the row's tools, kwargs and metadata kept), and the turn index of each; pre-tokenized
    records stay one item of turn 0. A continued final turn (continue_final_message) is the
    last boundary's prefix; the earlier boundaries have none. A conversation that cannot be
    split is reported through fail and dropped."""
    out: list[PromptRecord] = []
    turn_of: list[int] = []
    for record in records:
        if record.messages is None:
            out.append(record)
            turn_of.append(0)
            continue
        try:
            split = split_boundaries(record.conversation or record.messages)
        except InputError as exc:
            fail(InputError(exc.reason, record.line))
            continue
        for boundary in split:
            last = boundary is split[-1]
            prefix = record.assistant_prefix if last else None
            out.append(
                replace(
                    record, messages=boundary.messages, conversation=None, assistant_prefix=prefix
                )
            )
            turn_of.append(boundary.index)
    return out, turn_of


def chain_items(
    record: PromptRecord,
    prompt_ids: list[int],
    samples: int,
    plans: list[TurnPlan] | None,
    kwargs: dict[str, Any] | None = None,
    chat_pins: dict[str, Any] | None = None,
) -> list[NewItem]:
    """Turn 0 of every sample with its prompt, then each later turn waiting, holding the
    original turns it will need (samples are independent chains). Every item keeps the row's
    tools, its merged template kwargs (None: the run's) and its metadata, and its images: a
    later turn's are those of every turn of the row before its answer (regenerated answers
    hold none). With the run's chat_pins, the last turn of an agentic chain (a parser pinned,
    the row with tools or tool turns) is marked: its ending is recorded once it is done."""
    later = (plans or [])[1:]
    history = list(record.messages or [])
    later_images: list[list[dict[str, Any]] | None] = []
    for plan in later:
        history += plan.context
        later_images.append(refs_json(images_of(history, record)))
    agentic = tool_calls.chain_parser(chat_pins, "all", record.tools, history) is not None
    first = NewItem(
        record.key,
        0,
        record.line,
        record.messages,
        prompt_ids,
        tools=record.tools,
        chat_template_kwargs=kwargs,
        metadata=record.metadata,
        sampling_params=record.sampling_params,
        images=refs_json(images_of(record.messages, record)),
        assistant_prefix=record.assistant_prefix,
    )
    new: list[NewItem] = []
    for k in record.samples if record.samples is not None else range(samples):
        new.append(replace(first, sample_index=k, ends_chain=agentic and not later))
        for plan, images in zip(later, later_images, strict=True):
            new.append(
                replace(
                    first,
                    sample_index=k,
                    messages=plan.context,
                    prompt_ids=[],
                    turn_index=plan.index,
                    waiting=True,
                    images=images,
                    ends_chain=agentic and plan is later[-1],
                )
            )
    return new


def link_chains(conn: Connection, run_id: int, new_items: Sequence[NewItem]) -> None:
    """Point the later turns just inserted at the item of the turn before them."""
    keys = sorted({n.item_key for n in new_items if n.turn_index > 0})
    if keys:
        turns.link_turns(conn, run_id, keys)


# --- advancing ---------------------------------------------------------------------------------


class TokenizerCache:
    """Each run's tokenizer, loaded once per process from the run's tokenizer path and used
    only if its hashes are the run's pinned ones (never a prompt from another template)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[int, RunInfo] = {}
        self._tokenizers: dict[int, ChatTokenizer] = {}
        self._blocked: dict[int, float] = {}
        self._reported: set[int] = set()
        self._renderers: dict[str, RenderClient] = {}
        self._stored_images: dict[str | None, StoredImages] = {}

    def stored_images(self, storage_url: str | None) -> StoredImages:
        """A run's image store (its pinned URL) as render servers take its images (opened
        once per process and URL)."""
        with self._lock:
            images = self._stored_images.get(storage_url)
            if images is None:
                images = self._stored_images[storage_url] = StoredImages(
                    lambda: image_location(get_settings(), storage_url)
                )
            return images

    def renderer(self, url: str) -> RenderClient:
        """The render client of a `--render-with` run's server (one per process and URL)."""
        with self._lock:
            client = self._renderers.get(url)
            if client is None:
                client = self._renderers[url] = render_client(url, get_settings())
            return client

    def run(self, db: Engine, run_id: int) -> RunInfo:
        with self._lock:
            cached = self._runs.get(run_id)
        if cached is None:
            with db.connect() as conn:
                cached = run_queries.get_run_by_id(conn, run_id)
            with self._lock:
                self._runs[run_id] = cached
        return cached

    def tokenizer(self, db: Engine, run: RunInfo) -> ChatTokenizer | None:
        """The run's tokenizer, or None (ERROR logged, event recorded once) if it changed or
        cannot be loaded; the turns stay waiting."""
        with self._lock:
            found = self._tokenizers.get(run.id)
            blocked_at = self._blocked.get(run.id)
        if found is not None:
            return found
        if blocked_at is not None and time.monotonic() - blocked_at < BLOCKED_RETRY_S:
            return None
        try:
            tokenizer = self._load(run)
        except TokenmillError as exc:
            self._block(db, run, str(exc))
            return None
        with self._lock:
            self._tokenizers[run.id] = tokenizer
            self._blocked.pop(run.id, None)
        return tokenizer

    @staticmethod
    def _load(run: RunInfo) -> ChatTokenizer:
        check_version(run.normalization_version, run=run.name)
        folder = Path(run.tokenizer_path)
        # hash the files before loading: the tokenizer's own code (trust_remote_code) only
        # runs if it is byte for byte what the run was enqueued with
        changes = folder_changes(folder, run.tokenizer_hash, run.tokenizer_files)
        if changes:
            raise TokenmillError(
                f"the tokenizer files at {run.tokenizer_path} changed since the run was "
                f"created: {'; '.join(changes)}"
            )
        tokenizer = load_for_run(
            folder, trust_remote_code=run.trust_remote_code, chat_pins=run.chat_pins
        )
        if tokenizer.chat_template_hash != run.chat_template_hash:
            raise TokenmillError(
                f"the chat template at {run.tokenizer_path} differs from the run's "
                f"(hash {tokenizer.chat_template_hash[:12]}, pinned {run.chat_template_hash[:12]})"
            )
        return tokenizer

    def _block(self, db: Engine, run: RunInfo, reason: str) -> None:
        with self._lock:
            self._blocked[run.id] = time.monotonic()
            first = run.id not in self._reported
            self._reported.add(run.id)
        message = f"run {run.name}: later turns stay waiting: {reason}"
        log.error(message, extra={"action": "turns_blocked"})
        if first:
            try:
                with db.begin() as conn:
                    event_log.record_event(conn, EVENT_TURNS_BLOCKED, message, run_id=run.id)
            except Exception as exc:
                log.warning(
                    "could not record the event (%s)", exc, extra={"action": "event_failed"}
                )


_shared_cache = TokenizerCache()


def shared_cache() -> TokenizerCache:
    """This process's tokenizer cache (loaded lazily, never at import)."""
    return _shared_cache


@dataclass
class AdvanceReport:
    started: list[int] = field(default_factory=list)  # waiting → pending
    failed: int = 0  # later turns failed because an earlier one failed or was truncated
    blocked: int = 0  # left waiting: the run's tokenizer cannot be used
    ended: dict[str, int] = field(default_factory=dict)  # agentic chains ended, by reason

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "started": len(self.started),
            "failed": self.failed,
            "blocked": self.blocked,
        }
        if self.ended:
            out["ended"] = dict(self.ended)
        return out


def check_turn_images(tokenizer: ChatTokenizer, history: list[Any], prompt_ids: list[int]) -> None:
    """InputError unless a later turn's prompt holds one placeholder per image of its history."""
    images = len(image_urls(history))
    if not images:
        return
    if tokenizer.image_pins is None:
        raise InputError(tokenizer.no_image_pins)
    check_image_prompt(prompt_ids, images, tokenizer.image_pins)


def _fail_chain(db: Engine, turn: WaitingTurn, reason: str, report: AdvanceReport) -> None:
    with db.begin() as conn:
        n = turns.fail_waiting_chain(
            conn, turn.run_id, turn.item_key, turn.sample_index, turn.turn_index, reason
        )
    report.failed += n
    if n:
        log.info(
            "run %d key %s sample %d: %d later turns failed: %s",
            turn.run_id,
            turn.item_key,
            turn.sample_index,
            n,
            reason,
            extra={"action": "turns_failed"},
        )


def agentic_parser(run: RunInfo, item: StoredItem) -> str | None:
    """The run's tool-call parser if this item's chain is agentic, else None."""
    return tool_calls.chain_parser(run.chat_pins, run.turns, item.tools, item.messages)


def _regenerated_history(
    db: Engine, run: RunInfo, tokenizer: ChatTokenizer, turn: WaitingTurn, report: AdvanceReport
) -> list[Any] | None:
    """The next turn's prompt turns, or None when an agentic chain ends at the previous turn
    (its ending recorded, the rest of the chain deleted)."""
    prev = turn.prev
    parser = agentic_parser(run, prev)
    regenerated = assistant_turn(prev, run, tokenizer, parser)
    context = turn.context
    if parser is None and context and context[0].get("role") == "assistant":
        context = context[1:]  # no parser (plain chain): the dataset's call turn is no history
    if parser is None:
        return next_history(prev.messages or [], regenerated, context)
    step = tool_calls.chain_step(
        parser,
        regenerated,
        prev.tools or [],
        prev.messages or [],
        context,
        seed=tool_calls.item_seed(prev.item_key, prev.sample_index, prev.turn_index),
        parallel=str((run.chat_pins or {}).get("parallel_calls", constants.PARALLEL_CALLS_END)),
    )
    if step.ending is None:
        return [*(dict(t) for t in prev.messages or []), *step.turns]
    with db.begin() as conn:
        dropped = turns.end_chain(
            conn,
            prev.id,
            turn.run_id,
            turn.item_key,
            turn.sample_index,
            turn.turn_index,
            step.ending,
        )
    report.ended[step.ending] = report.ended.get(step.ending, 0) + 1
    log.info(
        "run %d key %s sample %d: chain ended at turn %d (%s), %d later turns dropped",
        turn.run_id,
        turn.item_key,
        turn.sample_index,
        prev.turn_index,
        step.ending,
        dropped,
        extra={"action": "chain_ended"},
    )
    return None


def _record_final_endings(
    db: Engine, cache: TokenizerCache, last_ids: Sequence[int], report: AdvanceReport
) -> None:
    """Record how each agentic chain ending at one of these done last turns ended."""
    if not last_ids:
        return
    with db.connect() as conn:
        last = reads.hydrated_items(conn, last_ids)
    plain: list[int] = []
    for item in last:
        assert item.run_id is not None
        run = cache.run(db, item.run_id)
        parser = agentic_parser(run, item)
        if parser is None:
            plain.append(item.id)
            continue
        tokenizer = cache.tokenizer(db, run)
        if tokenizer is None:
            report.blocked += 1
            continue
        answer = assistant_turn(item, run, tokenizer, parser)["content"]
        ending = tool_calls.final_ending(parser, answer, item.tools or [])
        with db.begin() as conn:
            if turns.record_chain_end(conn, item.id, ending):
                report.ended[ending] = report.ended.get(ending, 0) + 1
    if plain:
        with db.begin() as conn:
            turns.unmark_plain_chains(conn, plain)


def _advance_one(
    db: Engine, cache: TokenizerCache, turn: WaitingTurn, report: AdvanceReport
) -> None:
    prev = turn.prev
    if prev.status == "failed":
        _fail_chain(db, turn, f"turn {prev.turn_index} failed: {prev.error}", report)
        return
    if prev.finish_reason != "stop":
        _fail_chain(db, turn, f"turn {prev.turn_index} was truncated at max_new_tokens", report)
        return
    run = cache.run(db, turn.run_id)
    tokenizer = cache.tokenizer(db, run)
    if tokenizer is None:
        report.blocked += 1
        return
    history = _regenerated_history(db, run, tokenizer, turn, report)
    if history is None:
        return
    kwargs = prev.chat_template_kwargs
    if kwargs is None:
        kwargs = run.chat_template_kwargs
    try:
        history = normalize_messages(history, tokenizer.content_format)
        if run.render_with is not None:  # built by the run's render server, as at enqueue
            images = cache.stored_images(run.storage_url)
            sent = images.for_server(history) if image_urls(history) else history
            request = prompt_request(sent, kwargs, tools=prev.tools)
            prompt_ids = cache.renderer(run.render_with).render_patiently(request)
        else:
            prompt_ids = tokenizer.apply(history, kwargs, prev.tools)
        check_turn_images(tokenizer, history, prompt_ids)
    except (InputError, PermanentError) as exc:
        why = exc.reason if isinstance(exc, InputError) else f"the render server refused it: {exc}"
        reason = f"turn {turn.turn_index}: {why} (on the regenerated history)"
        _fail_chain(db, turn, reason, report)
        return
    except GenerationError as exc:  # the render server stayed down: the turn waits
        log.error(
            "run %s item %d: turn %d stays waiting: %s",
            run.name,
            turn.id,
            turn.turn_index,
            exc,
            extra={"action": "turn_waiting"},
        )
        report.blocked += 1
        return
    context = tokenizer.context_length
    if context is not None and len(prompt_ids) >= context:
        reason = (
            f"turn {turn.turn_index}: prompt has {len(prompt_ids)} tokens, at or over the "
            f"model's context length {context}"
        )
        _fail_chain(db, turn, reason, report)
        return
    with db.begin() as conn:
        started = turns.start_turn(conn, turn.id, history, prompt_ids)
    if started:
        report.started.append(turn.id)
        log.info(
            "run %d item %d: turn %d ready, prompt of %d tokens",
            turn.run_id,
            turn.id,
            turn.turn_index,
            len(prompt_ids),
            extra={"action": "turn_ready"},
        )


def advance(
    db: Engine,
    cache: TokenizerCache,
    *,
    prev_ids: Sequence[int] | None = None,
    run_id: int | None = None,
) -> AdvanceReport:
    """Advance the waiting successors of prev_ids (just committed), or every waiting turn
    whose previous turn finished (of run_id, or of every run). Safe to run twice or at once
    in several processes; the started items are pending and still need publishing."""
    report = AdvanceReport()
    if prev_ids is not None:
        ids = list(prev_ids)
        for i in range(0, len(ids), ADVANCE_PAGE):
            chunk = ids[i : i + ADVANCE_PAGE]
            with db.connect() as conn:
                ready = turns.ready_turns(conn, prev_ids=chunk, limit=len(chunk))
            for turn in ready:
                _advance_one(db, cache, turn, report)
            with db.connect() as conn:
                last = turns.unended_last_turns(conn, prev_ids=chunk, limit=len(chunk))
            # only agentic chains' last turns are marked: a plain run's results read none
            _record_final_endings(db, cache, [i for i, _ in last], report)
        return report
    after = 0
    while True:
        with db.connect() as conn:
            ready = turns.ready_turns(conn, run_id=run_id, after_id=after, limit=ADVANCE_PAGE)
        if not ready:
            break
        for turn in ready:
            _advance_one(db, cache, turn, report)
        after = ready[-1].id
    if run_id is not None and agentic_run(cache.run(db, run_id)):
        after = 0
        while True:
            with db.connect() as conn:
                last = turns.unended_last_turns(
                    conn, run_id=run_id, after_id=after, limit=ADVANCE_PAGE
                )
            if not last:
                break
            _record_final_endings(db, cache, [i for i, _ in last], report)
            after = last[-1][0]
    return report


def agentic_run(run: RunInfo) -> bool:
    """Whether the run's chains can be agentic (`--turns all` with a tool-call parser)."""
    return run.turns == "all" and (run.chat_pins or {}).get("tool_call_parser") is not None


def publish_started(db: Engine, ids: list[int], publish: Callable[[list[int]], None]) -> None:
    """Publish started turns, then mark them queued (as the producer does)."""
    if not ids:
        return
    publish(ids)
    with db.begin() as conn:
        ledger_queue.mark_queued(conn, ids)


class TurnAdvancer:
    """A worker's background advancer: the writer hands it the ids it just committed, and it
    starts their next turns off the hot path, a batch at a time. A lost notification (killed
    worker) is caught up by reconcile."""

    def __init__(
        self,
        db: Engine,
        publish: Callable[[list[int]], None],
        cache: TokenizerCache | None = None,
    ) -> None:
        self._db = db
        self._publish = publish
        self._cache = cache or shared_cache()
        self._queue: queue.Queue[list[int] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._unprocessed = 0  # notifications not yet fully advanced
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tm-turns", daemon=True)
            self._thread.start()

    def notify(self, finished_ids: list[int]) -> None:
        """Items just committed as done or failed (cheap: a queue put)."""
        if finished_ids:
            with self._lock:
                self._unprocessed += 1
            self._queue.put(list(finished_ids))

    def idle(self) -> bool:
        with self._lock:
            return self._unprocessed == 0

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, stop, taken = list(first), False, 1
            while len(batch) < ADVANCE_PAGE:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.extend(more)
                taken += 1
            try:
                report = advance(self._db, self._cache, prev_ids=batch)
                publish_started(self._db, report.started, self._publish)
            except Exception:
                log.exception(
                    "advancing the turns after %d results failed; reconcile will",
                    len(batch),
                    extra={"action": "turns_advance_failed"},
                )
            finally:
                with self._lock:
                    self._unprocessed -= taken
            if stop:
                return

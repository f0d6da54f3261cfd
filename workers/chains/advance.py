"""Advancing `--turns all` chains: when a turn finishes, its next turn's prompt is templated
from the regenerated history (or the chain fails, or an agentic chain ends), and a waiting
turn becomes pending. Idempotent (a conditional waiting → pending update): workers do it
right after committing results, reconcile and the embedded runner catch up on what was missed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from app.core import constants
from app.core.errors import GenerationError, InputError, PermanentError
from app.ledger import queue as ledger_queue
from app.ledger import reads, run_queries, turns
from app.outputs.export import assistant_turn
from app.prompts import tool_calls
from app.prompts.chat_path import image_urls, normalize_messages
from app.prompts.conversation import next_history
from app.prompts.image_pins import check_image_prompt
from app.prompts.tokenization import ChatTokenizer
from app.sglang.render import prompt_request
from workers.chains.tokenizers import TokenizerCache

log = logging.getLogger(__name__)

ADVANCE_PAGE = 500


@dataclass
class AdvanceReport:
    started: list[int] = field(default_factory=list)  # waiting → pending
    failed: int = 0  # later turns failed: an earlier one failed (or, plain chains, was truncated)
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


def _fail_chain(db: Engine, turn: turns.WaitingTurn, reason: str, report: AdvanceReport) -> None:
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


def agentic_parser(run: run_queries.RunInfo, item: reads.StoredItem) -> str | None:
    """The run's tool-call parser if this item's chain is agentic, else None."""
    return tool_calls.chain_parser(
        run.generation.chat_pins, run.generation.turns, item.tools, item.messages
    )


def _regenerated_history(
    db: Engine,
    run: run_queries.RunInfo,
    tokenizer: ChatTokenizer,
    turn: turns.WaitingTurn,
    report: AdvanceReport,
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
        parallel=str(
            (run.generation.chat_pins or {}).get("parallel_calls", constants.PARALLEL_CALLS_END)
        ),
    )
    if step.ending is None:
        return [*(dict(t) for t in prev.messages or []), *step.turns]
    _end_chain(db, turn, step.ending, report)
    return None


def _end_chain(db: Engine, turn: turns.WaitingTurn, ending: str, report: AdvanceReport) -> None:
    """An agentic chain ends at the turn before this waiting one: its ending recorded there,
    this turn and the later ones dropped."""
    prev = turn.prev
    with db.begin() as conn:
        dropped = turns.end_chain(
            conn,
            prev.id,
            turn.run_id,
            turn.item_key,
            turn.sample_index,
            turn.turn_index,
            ending,
        )
    report.ended[ending] = report.ended.get(ending, 0) + 1
    log.info(
        "run %d key %s sample %d: chain ended at turn %d (%s), %d later turns dropped",
        turn.run_id,
        turn.item_key,
        turn.sample_index,
        prev.turn_index,
        ending,
        dropped,
        extra={"action": "chain_ended"},
    )


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
        if item.finish_reason != "stop":
            ending = constants.CHAIN_END_TRUNCATED  # the last turn hit max_new_tokens
        else:
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
    db: Engine, cache: TokenizerCache, turn: turns.WaitingTurn, report: AdvanceReport
) -> None:
    prev = turn.prev
    if prev.status == "failed":
        _fail_chain(db, turn, f"turn {prev.turn_index} failed: {prev.error}", report)
        return
    run = cache.run(db, turn.run_id)
    if prev.finish_reason != "stop":
        # an agent loop ends at a truncated turn (no whole turn to go on from); a plain
        # chain's dataset turns would follow a reply the dataset never had: they fail
        if agentic_parser(run, prev) is not None:
            _end_chain(db, turn, constants.CHAIN_END_TRUNCATED, report)
        else:
            reason = f"turn {prev.turn_index} was truncated at max_new_tokens"
            _fail_chain(db, turn, reason, report)
        return
    tokenizer = cache.tokenizer(db, run)
    if tokenizer is None:
        report.blocked += 1
        return
    history = _regenerated_history(db, run, tokenizer, turn, report)
    if history is None:
        return
    kwargs = prev.chat_template_kwargs
    if kwargs is None:
        kwargs = run.generation.chat_template_kwargs
    try:
        history = normalize_messages(history, tokenizer.content_format)
        if (
            run.generation.render_with is not None
        ):  # built by the run's render server, as at enqueue
            images = cache.stored_images(run.storage_url)
            sent = images.for_server(history) if image_urls(history) else history
            request = prompt_request(sent, kwargs, tools=prev.tools)
            prompt_ids = cache.renderer(run.generation.render_with).render_patiently(request)
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


def agentic_run(run: run_queries.RunInfo) -> bool:
    """Whether the run's chains can be agentic (`--turns all` with a tool-call parser)."""
    return run.generation.turns.chains and run.generation.tool_call_parser is not None


def publish_started(db: Engine, ids: list[int], publish: Callable[[list[int]], None]) -> None:
    """Publish started turns, then mark them queued (as the producer does)."""
    if not ids:
        return
    publish(ids)
    with db.begin() as conn:
        ledger_queue.mark_queued(conn, ids)

"""`--turns all` against real Postgres: chains enqueued waiting, advanced from the regenerated
history (not the input's answers), failures and truncations ending a chain, idempotent
advancing, a changed tokenizer leaving turns waiting, and the exports of a finished run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sqlalchemy import Engine, select

from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import RunMismatch
from app.ledger import claims, common, reads, run_queries
from app.ledger import outcomes as ledger_outcomes
from app.outputs.export import export_run
from app.prompts.conversation import WholeConversationError
from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from workers.chains.advance import advance
from workers.chains.tokenizers import TokenizerCache
from workers.intake.producer import EnqueueOptions, EnqueueReport, enqueue

CONV3 = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "ORIGINAL one"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "ORIGINAL two"},
    {"role": "user", "content": "third question"},
]
CONV2 = [
    {"role": "user", "content": "alpha"},
    {"role": "assistant", "content": "ORIGINAL alpha"},
    {"role": "user", "content": "beta"},
    {"role": "assistant", "content": "ORIGINAL beta"},
]
LINES = [
    {"id": "c3", "messages": CONV3},
    {"id": "c2", "messages": CONV2},
    {"id": "p", "prompt": "single"},
]


@pytest.fixture
def tokenizer_dir(kimi_tokenizer_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(kimi_tokenizer_dir, tmp_path / "tok"))


@pytest.fixture
def tokenizer(tokenizer_dir: Path) -> ChatTokenizer:
    return load_tokenizer(tokenizer_dir)


def enqueue_all(
    db: Engine, tokenizer: ChatTokenizer, tmp_path: Path, turns_mode: str = "all"
) -> EnqueueReport:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    options = EnqueueOptions(
        path,
        "mt",
        SamplingParams(max_new_tokens=64, seed=1),
        samples_per_prompt=2,
        turns=turns_mode,
    )
    return enqueue(db, tokenizer, options, publish=None)


def rows(db: Engine, run_id: int) -> dict[tuple[str, int, int], reads.StoredItem]:
    statuses = ("waiting", "pending", "queued", "leased", "done", "failed")
    with db.connect() as conn:
        found = reads.iter_items(conn, run_id, statuses=statuses)
        return {(i.item_key, i.sample_index, i.turn_index): i for i in found}


def answer(tokenizer: ChatTokenizer, text: str, finish: str = "stop") -> GenerateResult:
    """Reasoning, </think>, the answer text, then EOS: what the model would generate."""
    encode = tokenizer.hf_tokenizer.encode
    ids = [*encode("thinking", add_special_tokens=False), tokenizer.think_end_id]
    ids += encode(text, add_special_tokens=False)
    if finish == "stop":
        ids.append(tokenizer.eos_token_ids[0])
    return GenerateResult("r", ids, finish, None, 10, len(ids), 0, 0.1)  # type: ignore[arg-type]


def finish(db: Engine, outcomes: list[ledger_outcomes.Done | ledger_outcomes.Failed]) -> None:
    with db.begin() as conn:
        ids = [o.item_id for o in outcomes]
        claims.claim_items(conn, ids, owner="w", server="s", lease_s=60)
        ledger_outcomes.record_outcomes(conn, outcomes, owner="w", lease_s=60)


def contains(whole: list[int], part: list[int]) -> bool:
    return any(whole[i : i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def test_chains_advance_from_the_regenerated_history(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    report = enqueue_all(pg_engine, tokenizer, tmp_path)
    assert report.inserted == 2 * (3 + 2 + 1)
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "mt")
        counts = reads.run_counts(conn, run)
    assert run.generation.turns == "all"
    assert (counts.pending, counts.waiting) == (6, 6) and not counts.finished
    items_by = rows(pg_engine, run.id)
    t0 = items_by[("c3", 0, 0)]
    assert t0.messages == CONV3[:2] and t0.prompt_ids == tokenizer.apply(CONV3[:2])
    t1 = items_by[("c3", 0, 1)]
    assert (t1.status, t1.prompt_ids, t1.messages) == ("waiting", [], [CONV3[3]])
    with pg_engine.connect() as conn:
        links = dict(conn.execute(select(common.items.c.id, common.items.c.prev_item_id)).all())
    assert links[t1.id] == t0.id and links[items_by[("c3", 0, 2)].id] == t1.id
    assert links[items_by[("c3", 1, 1)].id] == items_by[("c3", 1, 0)].id

    # a second enqueue with another turns mode is refused
    with pytest.raises(RunMismatch, match="turns: all → last"):
        enqueue_all(pg_engine, tokenizer, tmp_path, "last")

    cache = TokenizerCache()
    # turn 0: c3 both samples done; c2 sample 0 failed, sample 1 truncated
    finish(
        pg_engine,
        [
            ledger_outcomes.Done(t0.id, answer(tokenizer, "REGEN c3 s0 t0")),
            ledger_outcomes.Done(items_by[("c3", 1, 0)].id, answer(tokenizer, "REGEN c3 s1 t0")),
            ledger_outcomes.Failed(
                items_by[("c2", 0, 0)].id, "permanent: HTTP 400 prompt too long"
            ),
            ledger_outcomes.Done(
                items_by[("c2", 1, 0)].id, answer(tokenizer, "cut off", finish="length")
            ),
        ],
    )
    turn0 = [t0.id, items_by[("c3", 1, 0)].id, items_by[("c2", 0, 0)].id, items_by[("c2", 1, 0)].id]
    advanced = advance(pg_engine, cache, prev_ids=turn0)
    assert sorted(advanced.started) == sorted([t1.id, items_by[("c3", 1, 1)].id])
    assert advanced.failed == 2
    again = advance(pg_engine, cache, prev_ids=turn0)
    assert again.to_json() == {"started": 0, "failed": 0, "blocked": 0}

    items_by = rows(pg_engine, run.id)
    t1 = items_by[("c3", 0, 1)]
    regen0 = {"role": "assistant", "content": "REGEN c3 s0 t0", "reasoning_content": "thinking"}
    assert t1.status == "pending"
    assert t1.messages == [*CONV3[:2], regen0, CONV3[3]]
    assert t1.prompt_ids == tokenizer.apply(t1.messages)
    failed, truncated = items_by[("c2", 0, 1)], items_by[("c2", 1, 1)]
    assert failed.status == "failed" and failed.attempts == 0
    assert failed.error == "turn 0 failed: permanent: HTTP 400 prompt too long"
    assert truncated.error == "turn 0 was truncated at max_new_tokens"

    # turn 1 of c3 sample 0 done → turn 2's prompt holds turn 1's regenerated answer
    finish(pg_engine, [ledger_outcomes.Done(t1.id, answer(tokenizer, "REGEN c3 s0 t1"))])
    assert len(advance(pg_engine, cache, prev_ids=[t1.id]).started) == 1
    t2 = rows(pg_engine, run.id)[("c3", 0, 2)]
    regen_ids = tokenizer.hf_tokenizer.encode("REGEN c3 s0 t1", add_special_tokens=False)
    assert contains(t2.prompt_ids, regen_ids)
    text = tokenizer.decode(t2.prompt_ids)
    assert "ORIGINAL" not in text and "REGEN c3 s0 t0" in text
    assert t2.prompt_ids == tokenizer.apply(t2.messages or [])

    # finish everything else, then the exports
    items_by = rows(pg_engine, run.id)
    open_ids = [i.id for i in items_by.values() if i.status == "pending"]
    finish(pg_engine, [ledger_outcomes.Done(i, answer(tokenizer, f"REGEN {i}")) for i in open_ids])
    while True:  # the catch-up path: advance whatever finished, until nothing moves
        step = advance(pg_engine, cache, run_id=run.id)
        if not step.started:
            break
        finish(
            pg_engine,
            [ledger_outcomes.Done(i, answer(tokenizer, f"REGEN {i}")) for i in step.started],
        )
    with pg_engine.connect() as conn:
        counts = reads.run_counts(conn, run)
    assert counts.finished and (counts.done, counts.failed, counts.waiting) == (9, 3, 0)

    per_turn = export_run(pg_engine, run, "specforge", tmp_path / "turns.jsonl", per_turn=True)
    assert per_turn.rows == 9
    convs = export_run(pg_engine, run, "conversations", tmp_path / "c.jsonl", tokenizer=tokenizer)
    # whole conversations: c3 and p, 2 samples each (both chains of c2 ended early)
    assert convs.rows == 4
    whole = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    c3 = next(r for r in whole if r["id"] == "c3" and r["sample"] == 0)
    assert [t["role"] for t in c3["conversations"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert c3["conversations"][4]["content"] == "REGEN c3 s0 t1"
    # the Kimi-shaped template drops earlier reasoning: no whole-conversation mask
    with pytest.raises(WholeConversationError, match="--per-turn"):
        export_run(
            pg_engine,
            run,
            "specforge",
            tmp_path / "w.jsonl",
            tokenizer=tokenizer,
            whole_conversation=True,
        )


def test_a_changed_tokenizer_leaves_turns_waiting(
    pg_engine: Engine, tokenizer: ChatTokenizer, tokenizer_dir: Path, tmp_path: Path
) -> None:
    enqueue_all(pg_engine, tokenizer, tmp_path)
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "mt")
    first = rows(pg_engine, run.id)[("c2", 0, 0)]
    finish(pg_engine, [ledger_outcomes.Done(first.id, answer(tokenizer, "fine"))])
    config = tokenizer_dir / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<|im_middle|>", "<|im_middle|> "))
    report = advance(pg_engine, TokenizerCache(), run_id=run.id)
    assert report.to_json() == {"started": 0, "failed": 0, "blocked": 1}
    assert rows(pg_engine, run.id)[("c2", 0, 1)].status == "waiting"
    with pg_engine.connect() as conn:
        kinds = [e.kind for e in conn.execute(select(common.events.c.kind))]
    assert "turns_blocked" in kinds

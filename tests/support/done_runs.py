"""Runs whose items finished, written through the ledger's own queries, for the storage tests:
varied prompt and output arrays, some truncated, a failed and an unfinished item."""

from __future__ import annotations

import random

from sqlalchemy import Engine, update

from app.core.contracts import GenerateResult, SamplingParams
from app.ledger import common, queue, run_queries
from app.ledger import outcomes as ledger_outcomes

EOS = 163586


def spec(name: str) -> run_queries.RunSpec:
    return run_queries.RunSpec(
        name=name,
        tokenizer_path="/models/fixture",
        tokenizer_hash="a" * 64,
        chat_template_hash="b" * 64,
        chat_template_kwargs={"thinking": True},
        sampling=SamplingParams(max_new_tokens=64, seed=1),
        samples_per_prompt=2,
        think_end_id=163607,
        eos_token_ids=[EOS],
    )


def make_done_run(
    db: Engine, name: str, prompts: int, *, seed: int = 1, max_len: int = 60, extra: bool = True
) -> run_queries.RunInfo:
    """A run of `prompts` prompts x 2 samples, all done (every 7th truncated); with extra, one
    more prompt whose first sample failed and second is still pending."""
    rng = random.Random(seed)
    with db.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec(name))
        new = [
            queue.NewItem(
                f"p{i}",
                s,
                i + 1,
                [{"role": "user", "content": f"question {i}"}],
                [rng.randrange(0, 160_000) for _ in range(rng.randint(1, max_len))],
            )
            for i in range(prompts)
            for s in range(2)
        ]
        if extra:
            new += [queue.NewItem("bad", s, prompts + 1, None, [1, 2, 3]) for s in range(2)]
        queue.insert_items(conn, run.id, new)
        ids = queue.pending_ids(conn, run.id, limit=10**7)
    outcomes: list[ledger_outcomes.Outcome] = []
    for n, item_id in enumerate(ids[: 2 * prompts]):
        truncated = n % 7 == 3
        length = 64 if truncated else rng.randint(1, 63)
        out = [rng.randrange(0, 160_000) for _ in range(length - 1)]
        out.append(rng.randrange(0, 160_000) if truncated else EOS)
        result = GenerateResult(
            rid=f"r{item_id}",
            output_ids=out,
            finish_reason="length" if truncated else "stop",
            matched_stop=None if truncated else EOS,
            prompt_tokens=0,
            completion_tokens=len(out),
            cached_tokens=n % 5,
            e2e_latency_s=0.25 + n / 1000,
        )
        outcomes.append(ledger_outcomes.Done(item_id, result))
    if extra:
        outcomes.append(ledger_outcomes.Failed(ids[2 * prompts], "HTTP 400: prompt too long"))
    with db.begin() as conn:
        for start in range(0, len(outcomes), 2000):
            ledger_outcomes.record_outcomes(
                conn, outcomes[start : start + 2000], owner="t", lease_s=60
            )
        # a server name on the done rows, as a worker's claim would have set
        conn.execute(
            update(common.items)
            .where(common.items.c.run_id == run.id, common.items.c.status == "done")
            .values(server="gpu-a")
        )
    return run

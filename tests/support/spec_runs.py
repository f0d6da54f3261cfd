"""Runs whose results carry speculative-decoding counters, written through the ledger's own
queries: per-category acceptance chances, counters drawn step by step as SGLang counts them."""

from __future__ import annotations

import random
from dataclasses import replace

from sqlalchemy import Engine

from app.core.contracts import GenerateResult, SamplingParams, SpecStats
from app.ledger import outcomes as ledger_outcomes
from app.ledger import queue, run_queries
from tests.support.done_runs import EOS, spec

CATEGORIES = {"code": 0.8, "math": 0.65, "chat": 0.45}
NUM_STEPS = 3


def draw_counters(rng: random.Random, tokens: int, accept: float) -> SpecStats:
    """Verify steps of `tokens` output tokens (the first from prefill), each accepting drafts
    while a draw is under `accept`, up to NUM_STEPS; counted before the output is trimmed."""
    histogram = [0] * (NUM_STEPS + 1)
    left, steps, correct = tokens - 1, 0, 0
    while left > 0:
        accepted = 0
        while accepted < NUM_STEPS and rng.random() < accept:
            accepted += 1
        histogram[accepted] += 1
        steps += 1
        correct += accepted
        left -= accepted + 1
    proposed = steps * NUM_STEPS
    return SpecStats(steps, correct, proposed, tokens / steps, correct / proposed, tuple(histogram))


def make_spec_run(
    db: Engine, name: str, *, prompts: int = 90, shift: float = 0.0, seed: int = 1
) -> run_queries.RunInfo:
    """A greedy run of `prompts` prompts (categories in turn), every result with counters;
    `shift` moves every category's acceptance chance (another draft)."""
    rng = random.Random(seed)
    names = list(CATEGORIES)
    with db.begin() as conn:
        greedy = SamplingParams(max_new_tokens=512, temperature=0.0)
        run, _ = run_queries.get_or_create_run(
            conn, replace(spec(name), samples_per_prompt=1, sampling=greedy)
        )
        queue.insert_items(
            conn,
            run.id,
            [
                queue.NewItem(
                    f"p{i}",
                    0,
                    i + 1,
                    [{"role": "user", "content": f"question {i}"}],
                    [1, 2, 3, i],
                    metadata={"category": names[i % len(names)], "source": "fixture"},
                )
                for i in range(prompts)
            ],
        )
        ids = queue.pending_ids(conn, run.id, limit=prompts)
    outcomes: list[ledger_outcomes.Outcome] = []
    lengths = random.Random(99)  # the same outputs for every draft: greedy is lossless
    for n, item_id in enumerate(ids):
        tokens = lengths.randint(40, 400)
        out = [lengths.randrange(300, 1500) for _ in range(tokens - 1)] + [EOS]
        accept = CATEGORIES[names[n % len(names)]] + shift
        result = GenerateResult(
            rid=f"r{item_id}",
            output_ids=out,
            finish_reason="stop",
            matched_stop=EOS,
            prompt_tokens=4,
            completion_tokens=tokens,
            cached_tokens=0,
            e2e_latency_s=0.5,
            spec=draw_counters(rng, tokens, accept),
        )
        outcomes.append(ledger_outcomes.Done(item_id, result))
    with db.begin() as conn:
        ledger_outcomes.record_outcomes(conn, outcomes, owner="t", lease_s=60)
        fingerprint = {"model_path": "m", "speculative": {"draft_model_path": f"/drafts/{name}"}}
        run_queries.pin_fingerprint(conn, run.id, fingerprint)
        return run_queries.get_run(conn, name)

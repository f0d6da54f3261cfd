"""A run's rows as acceptance reads them: each done item with its speculative counters, and what
the run pins about the draft (its speculative settings, greedy or not); `acceptance` computes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.sglang.rules import GREEDY_TEMPERATURE

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from app.ledger import run_queries
    from app.outputs.acceptance import AcceptRow


def load_rows(db: Engine, run: run_queries.RunInfo) -> list[AcceptRow]:
    """The run's done items with their speculative counters (zeros for an item without)."""
    from app.ledger import reads, spec_stats
    from app.outputs.acceptance import AcceptRow, output_digest

    with db.connect() as conn:
        stats = spec_stats.run_spec_stats(conn, run.id)
        rows = []
        for item in reads.iter_items(conn, run.id):
            spec = stats.get(item.id)
            rows.append(
                AcceptRow(
                    key=item.item_key,
                    sample=item.sample_index,
                    turn=item.turn_index,
                    metadata=dict(item.metadata or {}),
                    completion_tokens=(
                        item.completion_tokens
                        if item.completion_tokens is not None
                        else len(item.output_ids or ())
                    ),
                    verify_ct=spec.verify_ct if spec else 0,
                    correct=spec.num_correct_drafts if spec else 0,
                    proposed=spec.num_proposed_drafts if spec else 0,
                    histogram=spec.histogram if spec else (),
                    output_digest=output_digest(item.output_ids),
                )
            )
    return rows


def speculative_of(run: run_queries.RunInfo) -> dict[str, Any] | None:
    """The speculative settings the run's servers reported (None: they did not speculate)."""
    spec = (run.fingerprint or {}).get("speculative")
    return dict(spec) if isinstance(spec, dict) else None


def is_greedy(run: run_queries.RunInfo) -> bool:
    """Greedy decoding, as SGLang decides it from the run's sampling."""
    return (
        run.generation.sampling.temperature < GREEDY_TEMPERATURE
        or run.generation.sampling.top_k == 1
    )

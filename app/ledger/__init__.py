"""The ledger: runs, their items and every state change of an item, in Postgres (or embedded
SQLite), which is the truth. Every state change is a conditional update, so a redelivered
message or a second worker can never create a second result.

Its queries live in submodules by what they serve:

- `common`: the tables, UTC time, the (run_id, status, id) index range, id-order row locks
- `run_queries`: runs, what they pin (RunSpec, RunInfo), fingerprints, archived or not
- `queue`: items inserted, pending ids and keys to publish, pending → queued, republishing
- `claims`: leases (claim_items, claim_next…), hedge candidates and marks, heartbeats
- `outcomes`: Done / Failed / RetryLater / Released written by record_outcomes; leases given back
- `turns`: multi-turn chains (`--turns all`) linked, advanced and failed
- `reads`: RunCounts, StoredItem, iter_items and its keyset pages, stored prompts
- `compaction`: token arrays of done items moved to Parquet shards
- `removal`: a run deleted, its items in pages, then the run with what refers to it
- `event_log`: record_event, has_event
- `spec_stats`: done items' speculative-decoding counters, written with their results
- `image_tokens`: a run's image pins and the count each of its images expands to

This module re-exports them all, and callers use them as `ledger.X` (or `from app.ledger
import X`); calling through the attribute is also what lets a test patch `ledger.X` for them.
A name is imported on first use (`__getattr__`), so a command that reads counts does not load
the claim, outcome, queue and compaction queries.
The submodules import each other, never this module; the package's other modules (registry,
archive, dashboard_queries, metrics_queries) import from here, as `from app import ledger`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# the run and event queries are not in `runs` / `events` modules: those names are the tables
# (`ledger.runs`, `ledger.events`), and a submodule would take its name over on this package
if TYPE_CHECKING:
    # what a Done carries, as ledger.X
    from app.core.contracts import GenerateResult as GenerateResult
    from app.ledger import counters as counters
    from app.ledger.claims import CLAIMABLE as CLAIMABLE
    from app.ledger.claims import ClaimedItem as ClaimedItem
    from app.ledger.claims import _claimable as _claimable  # bench/overhead.py reuses the test
    from app.ledger.claims import claim_items as claim_items
    from app.ledger.claims import claim_next as claim_next
    from app.ledger.claims import claim_next_groups as claim_next_groups
    from app.ledger.claims import claimable_left as claimable_left
    from app.ledger.claims import drop_hedge_marks as drop_hedge_marks
    from app.ledger.claims import extend_leases as extend_leases
    from app.ledger.claims import finished_among as finished_among
    from app.ledger.claims import hedge_candidates as hedge_candidates
    from app.ledger.claims import item_keys as item_keys
    from app.ledger.claims import lease_owners as lease_owners
    from app.ledger.claims import mark_hedged as mark_hedged
    from app.ledger.claims import run_has_items as run_has_items
    from app.ledger.claims import unmark_hedged as unmark_hedged
    from app.ledger.common import as_utc as as_utc
    from app.ledger.common import events as events
    from app.ledger.common import items as items
    from app.ledger.common import items_archive as items_archive
    from app.ledger.common import run_status_order as run_status_order
    from app.ledger.common import run_status_range as run_status_range
    from app.ledger.common import runs as runs
    from app.ledger.common import servers as servers
    from app.ledger.common import tool_sets as tool_sets
    from app.ledger.common import utcnow as utcnow
    from app.ledger.compaction import compactable_ids as compactable_ids
    from app.ledger.compaction import compacted_count as compacted_count
    from app.ledger.compaction import count_compactable as count_compactable
    from app.ledger.compaction import count_uncompacted as count_uncompacted
    from app.ledger.compaction import mark_compacted as mark_compacted
    from app.ledger.compaction import runs_with_compactable as runs_with_compactable
    from app.ledger.compaction import shard_referenced as shard_referenced
    from app.ledger.compaction import shard_uris as shard_uris
    from app.ledger.event_log import has_event as has_event
    from app.ledger.event_log import record_event as record_event
    from app.ledger.image_tokens import pin_run_images as pin_run_images
    from app.ledger.image_tokens import run_image_pins as run_image_pins
    from app.ledger.outcomes import ERROR_MAX_CHARS as ERROR_MAX_CHARS
    from app.ledger.outcomes import Done as Done
    from app.ledger.outcomes import Failed as Failed
    from app.ledger.outcomes import Outcome as Outcome
    from app.ledger.outcomes import Released as Released
    from app.ledger.outcomes import RetryLater as RetryLater
    from app.ledger.outcomes import record_outcomes as record_outcomes
    from app.ledger.outcomes import release_owner as release_owner
    from app.ledger.outcomes import requeue_expired as requeue_expired
    from app.ledger.queue import NewItem as NewItem
    from app.ledger.queue import existing_keys as existing_keys
    from app.ledger.queue import insert_items as insert_items
    from app.ledger.queue import mark_queued as mark_queued
    from app.ledger.queue import oldest_queued as oldest_queued
    from app.ledger.queue import pending_ids as pending_ids
    from app.ledger.queue import pending_keys as pending_keys
    from app.ledger.queue import refresh_statistics as refresh_statistics
    from app.ledger.queue import touch_queued as touch_queued
    from app.ledger.reads import RunCounts as RunCounts
    from app.ledger.reads import StoredItem as StoredItem
    from app.ledger.reads import done_weight_versions as done_weight_versions
    from app.ledger.reads import iter_items as iter_items
    from app.ledger.reads import merged_pages as merged_pages
    from app.ledger.reads import prompt_item_ids as prompt_item_ids
    from app.ledger.reads import run_counts as run_counts
    from app.ledger.reads import sample_prompt_item_ids as sample_prompt_item_ids
    from app.ledger.reads import scanned_run_counts as scanned_run_counts
    from app.ledger.reads import stored_items as stored_items
    from app.ledger.reads import stored_prompts as stored_prompts
    from app.ledger.removal import delete_items_page as delete_items_page
    from app.ledger.removal import delete_run_row as delete_run_row
    from app.ledger.run_queries import RunInfo as RunInfo
    from app.ledger.run_queries import RunSpec as RunSpec
    from app.ledger.run_queries import get_or_create_run as get_or_create_run
    from app.ledger.run_queries import get_run as get_run
    from app.ledger.run_queries import get_run_by_id as get_run_by_id
    from app.ledger.run_queries import list_runs as list_runs
    from app.ledger.run_queries import pin_fingerprint as pin_fingerprint
    from app.ledger.run_queries import run_archived as run_archived
    from app.ledger.run_queries import run_differences as run_differences
    from app.ledger.spec_stats import run_has_spec_stats as run_has_spec_stats
    from app.ledger.spec_stats import run_spec_stats as run_spec_stats
    from app.ledger.turns import WaitingTurn as WaitingTurn
    from app.ledger.turns import fail_waiting_chain as fail_waiting_chain
    from app.ledger.turns import link_turns as link_turns
    from app.ledger.turns import ready_turns as ready_turns
    from app.ledger.turns import start_turn as start_turn

# name -> the module it comes from (a test checks this is the list above)
_EXPORTS: dict[str, str] = {
    "GenerateResult": "app.core.contracts",
    "counters": "app.ledger",
    "CLAIMABLE": "app.ledger.claims",
    "ClaimedItem": "app.ledger.claims",
    "_claimable": "app.ledger.claims",
    "claim_items": "app.ledger.claims",
    "claim_next": "app.ledger.claims",
    "claim_next_groups": "app.ledger.claims",
    "claimable_left": "app.ledger.claims",
    "drop_hedge_marks": "app.ledger.claims",
    "extend_leases": "app.ledger.claims",
    "finished_among": "app.ledger.claims",
    "hedge_candidates": "app.ledger.claims",
    "item_keys": "app.ledger.claims",
    "lease_owners": "app.ledger.claims",
    "mark_hedged": "app.ledger.claims",
    "run_has_items": "app.ledger.claims",
    "unmark_hedged": "app.ledger.claims",
    "as_utc": "app.ledger.common",
    "events": "app.ledger.common",
    "items": "app.ledger.common",
    "items_archive": "app.ledger.common",
    "run_status_order": "app.ledger.common",
    "run_status_range": "app.ledger.common",
    "runs": "app.ledger.common",
    "servers": "app.ledger.common",
    "tool_sets": "app.ledger.common",
    "utcnow": "app.ledger.common",
    "compactable_ids": "app.ledger.compaction",
    "compacted_count": "app.ledger.compaction",
    "count_compactable": "app.ledger.compaction",
    "count_uncompacted": "app.ledger.compaction",
    "mark_compacted": "app.ledger.compaction",
    "runs_with_compactable": "app.ledger.compaction",
    "shard_referenced": "app.ledger.compaction",
    "shard_uris": "app.ledger.compaction",
    "has_event": "app.ledger.event_log",
    "record_event": "app.ledger.event_log",
    "ERROR_MAX_CHARS": "app.ledger.outcomes",
    "Done": "app.ledger.outcomes",
    "Failed": "app.ledger.outcomes",
    "Outcome": "app.ledger.outcomes",
    "Released": "app.ledger.outcomes",
    "RetryLater": "app.ledger.outcomes",
    "record_outcomes": "app.ledger.outcomes",
    "release_owner": "app.ledger.outcomes",
    "requeue_expired": "app.ledger.outcomes",
    "NewItem": "app.ledger.queue",
    "existing_keys": "app.ledger.queue",
    "insert_items": "app.ledger.queue",
    "pin_run_images": "app.ledger.image_tokens",
    "run_image_pins": "app.ledger.image_tokens",
    "mark_queued": "app.ledger.queue",
    "oldest_queued": "app.ledger.queue",
    "pending_ids": "app.ledger.queue",
    "pending_keys": "app.ledger.queue",
    "refresh_statistics": "app.ledger.queue",
    "touch_queued": "app.ledger.queue",
    "RunCounts": "app.ledger.reads",
    "StoredItem": "app.ledger.reads",
    "done_weight_versions": "app.ledger.reads",
    "iter_items": "app.ledger.reads",
    "merged_pages": "app.ledger.reads",
    "prompt_item_ids": "app.ledger.reads",
    "run_counts": "app.ledger.reads",
    "sample_prompt_item_ids": "app.ledger.reads",
    "scanned_run_counts": "app.ledger.reads",
    "stored_items": "app.ledger.reads",
    "stored_prompts": "app.ledger.reads",
    "delete_items_page": "app.ledger.removal",
    "delete_run_row": "app.ledger.removal",
    "RunInfo": "app.ledger.run_queries",
    "RunSpec": "app.ledger.run_queries",
    "get_or_create_run": "app.ledger.run_queries",
    "get_run": "app.ledger.run_queries",
    "get_run_by_id": "app.ledger.run_queries",
    "list_runs": "app.ledger.run_queries",
    "pin_fingerprint": "app.ledger.run_queries",
    "run_archived": "app.ledger.run_queries",
    "run_differences": "app.ledger.run_queries",
    "run_has_spec_stats": "app.ledger.spec_stats",
    "run_spec_stats": "app.ledger.spec_stats",
    "WaitingTurn": "app.ledger.turns",
    "fail_waiting_chain": "app.ledger.turns",
    "link_turns": "app.ledger.turns",
    "ready_turns": "app.ledger.turns",
    "start_turn": "app.ledger.turns",
}


def __getattr__(name: str) -> object:
    """`ledger.X`: imported from its module on first use, then kept as an attribute."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _EXPORTS[name] == __name__:  # a submodule of this package, e.g. counters
        value: object = importlib.import_module(f"{__name__}.{name}")
    else:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

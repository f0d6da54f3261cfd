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
- `event_log`: record_event

This module re-exports them all, and callers use them as `ledger.X` (or `from app.ledger
import X`); calling through the attribute is also what lets a test patch `ledger.X` for them.
The submodules import each other, never this module; the package's other modules (registry,
archive, dashboard_queries, metrics_queries) import from here, as `from app import ledger`.
"""

from __future__ import annotations

# the run and event queries are not in `runs` / `events` modules: those names are the tables
# (`ledger.runs`, `ledger.events`), and a submodule would take its name over on this package
from app.core.contracts import GenerateResult as GenerateResult  # what a Done carries, as ledger.X
from app.ledger import counters as counters
from app.ledger.claims import CLAIMABLE as CLAIMABLE
from app.ledger.claims import ClaimedItem as ClaimedItem
from app.ledger.claims import _claimable as _claimable  # bench/overhead.py reuses the test
from app.ledger.claims import claim_items as claim_items
from app.ledger.claims import claim_next as claim_next
from app.ledger.claims import claim_next_groups as claim_next_groups
from app.ledger.claims import claimable_left as claimable_left
from app.ledger.claims import extend_leases as extend_leases
from app.ledger.claims import finished_among as finished_among
from app.ledger.claims import hedge_candidates as hedge_candidates
from app.ledger.claims import item_keys as item_keys
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
from app.ledger.event_log import record_event as record_event
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
from app.ledger.reads import scanned_run_counts as scanned_run_counts
from app.ledger.reads import stored_items as stored_items
from app.ledger.reads import stored_prompts as stored_prompts
from app.ledger.run_queries import RunInfo as RunInfo
from app.ledger.run_queries import RunSpec as RunSpec
from app.ledger.run_queries import get_or_create_run as get_or_create_run
from app.ledger.run_queries import get_run as get_run
from app.ledger.run_queries import get_run_by_id as get_run_by_id
from app.ledger.run_queries import list_runs as list_runs
from app.ledger.run_queries import pin_fingerprint as pin_fingerprint
from app.ledger.run_queries import run_archived as run_archived
from app.ledger.run_queries import run_differences as run_differences
from app.ledger.turns import WaitingTurn as WaitingTurn
from app.ledger.turns import fail_waiting_chain as fail_waiting_chain
from app.ledger.turns import link_turns as link_turns
from app.ledger.turns import ready_turns as ready_turns
from app.ledger.turns import start_turn as start_turn

"""The ledger: runs, their items and every state change of an item, in Postgres (or embedded
SQLite), which is the truth. Every state change is a conditional update, so a redelivered
message or a second worker can never create a second result.

All SQL lives in this package, as named queries in submodules by what they serve; callers import
the submodule (`from app.ledger import claims`, then `claims.claim_items(...)`):

- `common`: the tables, UTC time, the (run_id, status, id) index range, id-order row locks
- `run_queries`: runs, what they pin (RunSpec, RunInfo), fingerprints, archived or not;
  `pin_checks`: the comparisons a later enqueue into a run must pass; `run_needs`: a run's
  largest request, which a server's limits must admit
- `queue`: items inserted, pending ids and keys to publish, pending → queued, republishing
- `claims`: leases (claim_items, claim_next…; an item a server refused passed over by its
  claims), hedge candidates and marks, heartbeats
- `outcomes`: Done / Failed / RetryLater / Released written by record_outcomes; leases given back
- `turns`: multi-turn chains (`--turns all`) linked, advanced and failed
- `reads`: RunCounts, StoredItem, iter_items and its keyset pages, stored prompts
- `counters`: the item counters kept by triggers, read, recounted and repaired
- `compaction`: token arrays of done items moved to Parquet shards; `archive`: finished runs'
  rows moved to items_archive; `removal`: a run deleted
- `event_log`: record_event, has_event, latest_kind, runs_refused; `registry`: servers, pause
  flags, probes, the timeline
- `spec_stats`: done items' speculative-decoding counters, written with their results
- `image_tokens`: a run's image pins and the count each of its images expands to
- `dashboard_queries`, `metrics_queries`: the read models of the operator views
- `database`: engines and query plans; `migrate`: the schema driven from code
"""

"""Names that other processes depend on: task names, queues, key prefixes, event kinds.

Task names are explicit strings and never renamed: queued messages refer to them.
"""

from __future__ import annotations

from typing import Final, Literal

GENERATE_TASK = "tokenmill.generate"
RECONCILE_TASK = "tokenmill.reconcile"
WATCHDOG_TASK = "tokenmill.watchdog"
COMPACT_TASK = "tokenmill.compact"

WORK_QUEUE = "generate"
# kombu's Redis transport keeps one list per step of a queue's message priority and serves
# step 0 first (workers/intake/publish.py maps a run's priority onto them)
BROKER_PRIORITY_STEPS: Final = tuple(range(10))
PRIORITY_SEP: Final = "\x06\x16"  # between the queue's name and its step (kombu's default)
# how often a worker reads the runs' priorities and claimable counts again (its claim order):
# `tokenmill priority` reaches every worker within this long
PRIORITY_REFRESH_S: Final = 2.0
CONTROL_QUEUE = "tokenmill.control"

REDIS_PREFIX = "tokenmill:"

# The message-normalization rules of app.prompts.chat_path, as every run pins them. Bump the
# suffix when a rule changes, so a run keeps the rules it was created with (or is refused)
# instead of mixing two.
NORMALIZATION_VERSION = "sglang-0.5.23.3"

# the JSONL formats of `tokenmill export` (app.outputs.export), named on the command line
EXPORT_FORMATS: tuple[Literal["specforge", "conversations"], ...] = ("specforge", "conversations")

# the levels `--log-level` and TOKENMILL_LOG_LEVEL take (logging's own names)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Events recorded in the ledger timeline (`events.kind`). Each constant is Final, so its type is
# its Literal and `record_event(kind: EventKind)` fails mypy on a kind that is not listed here.
EVENT_RUN_CREATED: Final = "run_created"
EVENT_ENQUEUED: Final = "enqueued"
EVENT_RECONCILED: Final = "reconciled"
EVENT_FINGERPRINT_PINNED: Final = "fingerprint_pinned"
EVENT_FINGERPRINT_MISMATCH: Final = "fingerprint_mismatch"
# a later turn cannot be templated: the run's tokenizer changed or cannot be loaded
EVENT_TURNS_BLOCKED: Final = "turns_blocked"
# an enqueue stopped before its end (its render server stayed down); a rerun completes it
EVENT_ENQUEUE_STOPPED: Final = "enqueue_stopped"
# a server re-rendered a sample of a run's stored prompts (the parity preflight)
EVENT_PARITY: Final = "parity"
# a server's weights changed in place (its weight_version or model path), and an
# `update-weights` call on it
EVENT_WEIGHTS_CHANGED: Final = "weights_changed"
EVENT_WEIGHTS_UPDATE: Final = "weights_update"
# a server's served prompt ids were not the request's with each image placeholder repeated,
# or it expanded an image of a run to another count than the run's other servers
EVENT_IMAGE_DRIFT: Final = "image_drift"
# a finished, compacted run's rows moved to items_archive (app.ledger.archive)
EVENT_ARCHIVED: Final = "archived"
# a server's health state changed (the watchdog: healthy, suspect, down, recovering)
EVENT_STATE: Final = "state"
# a server's workers were paused or resumed (the durable flag and remote control)
EVENT_PAUSED: Final = "paused"
EVENT_RESUMED: Final = "resumed"
# `tokenmill restart`: begun, the server back, or the restart failed
EVENT_RESTART: Final = "restart"
# a worker's auto-sized window changed size (the server's capacity, or its load), with why
EVENT_WINDOW_RESIZED: Final = "window_resized"
# items failed for good, summed per run, server and reason over an interval (one event for
# the first of a reason, then one per interval with the count: never one per item)
EVENT_ITEM_FAILED: Final = "item_failed"
# `tokenmill retry`: failed items re-queued with fresh attempts, counted by reason
EVENT_RETRIED: Final = "retried"
# `tokenmill servers remove`: a server left the registry
EVENT_SERVER_REMOVED: Final = "server_removed"
# `tokenmill priority RUN N`: a run's priority changed
EVENT_PRIORITY: Final = "priority"

EventKind = Literal[
    "run_created",
    "enqueued",
    "reconciled",
    "fingerprint_pinned",
    "fingerprint_mismatch",
    "turns_blocked",
    "enqueue_stopped",
    "parity",
    "weights_changed",
    "weights_update",
    "image_drift",
    "archived",
    "state",
    "paused",
    "resumed",
    "restart",
    "window_resized",
    "item_failed",
    "retried",
    "server_removed",
    "priority",
]

# Who paused a server (`servers.paused_by`): an operator's pause is never lifted by the watchdog.
PAUSED_BY_OPERATOR: Final = "operator"
PAUSED_BY_WATCHDOG: Final = "watchdog"
PAUSED_BY_FINGERPRINT: Final = "fingerprint"
PAUSED_BY_RESTART: Final = "restart"
# its rendering of a `--require-parity` run's prompts differs from the stored ones
PAUSED_BY_PARITY: Final = "parity"
# its weights changed under the runs it served (an in-place update), or `update-weights`
PAUSED_BY_WEIGHTS: Final = "weights"
# `tokenmill update-weights` at work (the watchdog leaves it to the command)
PAUSED_BY_UPDATE: Final = "update"
# token drift on image items: the served prompt ids were not the request's with each image's
# placeholder repeated, or an image expanded to another count than on the run's other
# servers; the operator's to lift (`tokenmill resume`) once the server is fixed
PAUSED_BY_IMAGES: Final = "images"

# refused what the other servers of its runs serve (10 distinct items in a row, a reason that
# can depend on the server): `failing: <the error>`; the operator's to lift once it is fixed
PAUSED_BY_FAILING: Final = "failing"

PauseReason = Literal[
    "operator",
    "watchdog",
    "fingerprint",
    "restart",
    "parity",
    "weights",
    "update",
    "images",
    "failing",
]

# How an on-policy agentic chain ends (app.prompts.tool_calls.chain_ending): the dataset's
# conversation reached its end, the regenerated turn stopped matching the cached tool results,
# or it hit max_new_tokens (truncated: the loop has no whole turn to go on from).
CHAIN_END_COMPLETE = "complete"
CHAIN_END_NO_CALL = "no_call"
CHAIN_END_OTHER_TOOL = "other_tool"
CHAIN_END_PARALLEL_CALLS = "parallel_calls"
CHAIN_END_MALFORMED_CALL = "malformed_call"
CHAIN_END_RESULTS_EXHAUSTED = "results_exhausted"
CHAIN_END_TRUNCATED = "truncated"
CHAIN_ENDINGS = (
    CHAIN_END_COMPLETE,
    CHAIN_END_NO_CALL,
    CHAIN_END_OTHER_TOOL,
    CHAIN_END_PARALLEL_CALLS,
    CHAIN_END_MALFORMED_CALL,
    CHAIN_END_RESULTS_EXHAUSTED,
    CHAIN_END_TRUNCATED,
)

# the tool-call parsers app.prompts.tool_calls implements, by SGLang's `--tool-call-parser` name
TOOL_CALL_PARSERS = ("kimi_k2", "qwen25", "hermes", "deepseekv31")
# --parallel-calls: how an agentic chain meets a turn of parallel calls (the dataset's or the
# target's): it ends there, or goes on when the calls match the dataset's one by one, in order
PARALLEL_CALLS_END = "end"
PARALLEL_CALLS_IN_ORDER = "in-order"
PARALLEL_CALLS = (PARALLEL_CALLS_END, PARALLEL_CALLS_IN_ORDER)

"""Names that other processes depend on: task names, queues, key prefixes, event kinds.

Task names are explicit strings and never renamed: queued messages refer to them.
"""

from __future__ import annotations

from typing import Literal

GENERATE_TASK = "tokenmill.generate"
RECONCILE_TASK = "tokenmill.reconcile"
WATCHDOG_TASK = "tokenmill.watchdog"
COMPACT_TASK = "tokenmill.compact"

WORK_QUEUE = "generate"
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

# events recorded in the ledger timeline
EVENT_RUN_CREATED = "run_created"
EVENT_ENQUEUED = "enqueued"
EVENT_RECONCILED = "reconciled"
EVENT_FINGERPRINT_PINNED = "fingerprint_pinned"
EVENT_FINGERPRINT_MISMATCH = "fingerprint_mismatch"
# a later turn cannot be templated: the run's tokenizer changed or cannot be loaded
EVENT_TURNS_BLOCKED = "turns_blocked"
# an enqueue stopped before its end (its render server stayed down); a rerun completes it
EVENT_ENQUEUE_STOPPED = "enqueue_stopped"
# a server re-rendered a sample of a run's stored prompts (the parity preflight)
EVENT_PARITY = "parity"
# a server's weights changed in place (its weight_version or model path), and an
# `update-weights` call on it
EVENT_WEIGHTS_CHANGED = "weights_changed"
EVENT_WEIGHTS_UPDATE = "weights_update"
# a server's served prompt ids were not the request's with each image placeholder repeated,
# or it expanded an image of a run to another count than the run's other servers
EVENT_IMAGE_DRIFT = "image_drift"

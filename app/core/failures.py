"""Why an item failed, as a short reason shared by every item failed by the same cause: what
`status`, `verify`, `retry --reason` and the `item_failed` events group and match failures by.

The reason is the stored error with what differs between items of one cause taken out: the
"permanent:" prefix, numbers (token counts, attempt counts, ports) and hashes (image keys).
"""

from __future__ import annotations

import re
from typing import Final

# the longest reason kept (`items.fail_reason`): enough to tell causes apart, never a page
REASON_MAX_CHARS: Final = 160
# the reason of a failure with no error
NO_REASON: Final = "(no error recorded)"

# the worker's words for how it failed, also inside a chain's "turn N failed: ..." reason
_PREFIX = re.compile(r"\bpermanent:\s*")
_GAVE_UP = re.compile(r"\bgave up after \d+ attempts:")
# hex runs as long as a short sha (image keys, request ids), before the numbers go
_HEX = re.compile(r"\b[0-9a-f]{12,}\b", re.IGNORECASE)
# every number but an HTTP status, which tells a 400 from a 413
_NUMBER = re.compile(r"(?<!HTTP )(?<![\w.])\d+(?:\.\d+)?")
_SPACES = re.compile(r"\s+")


def failure_reason(error: str | None) -> str:
    """The reason of a failed item's error, e.g. `permanent: HTTP 400: The input (5012
    tokens) is longer than the model's context length (4096 tokens).` gives `HTTP 400: The
    input (N tokens) is longer than the model's context length (N tokens).`"""
    if not error:
        return NO_REASON
    text = _SPACES.sub(" ", error).strip()
    text = _GAVE_UP.sub("gave up after retries:", text)
    text = _PREFIX.sub("", text)
    text = _HEX.sub("…", text)
    text = _NUMBER.sub("N", text)
    if len(text) > REASON_MAX_CHARS:
        text = text[: REASON_MAX_CHARS - 1] + "…"
    return text

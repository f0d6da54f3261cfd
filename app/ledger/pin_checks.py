"""What a later enqueue into a run is compared by, besides the plain settings: the tokenizer files
a run pinned (their sha256 manifest) and its chat pins (app.prompts.chat_pins builds them).

Pure comparisons of pinned values, each returning the lines that name a difference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# the chat pins a later enqueue must match (the client's own transformers version may change,
# as long as it renders as the same server version)
COMPARED_PINS = (
    "renders_as",
    "chat_template_name",
    "chat_template_file_hash",
    "pass_turn_fields",
    "template_on_server",
    "server_render_sha256",
    "request_fields",
)

# pins a run may lack (rendered on the other side, or created before the pin existed)
_PINNED_LATER = frozenset({"renders_as", "server_render_sha256", "request_fields"})


def file_changes(
    pinned_hash: str,
    pinned_files: Mapping[str, str] | None,
    hash_now: str,
    files_now: Mapping[str, str],
    legacy_hash_now: str,
) -> list[str]:
    """Lines naming each tokenizer file that is changed, new or removed since a run pinned it.

    A run that pinned no manifest (created before it existed) is compared by its hash alone.
    """
    if pinned_files is None:
        if pinned_hash in (hash_now, legacy_hash_now):
            return []
        return [f"tokenizer files: hash {pinned_hash[:12]} pinned, {legacy_hash_now[:12]} now"]
    lines: list[str] = []
    for name in sorted(set(pinned_files) | set(files_now)):
        old, new = pinned_files.get(name), files_now.get(name)
        if old == new:
            continue
        if old is None:
            lines.append(f"tokenizer file {name!r} is new")
        elif new is None:
            lines.append(f"tokenizer file {name!r} was removed")
        else:
            lines.append(f"tokenizer file {name!r} changed (sha256 {old[:12]} → {new[:12]})")
    if not lines and pinned_hash != hash_now:
        lines.append(f"tokenizer files: hash {pinned_hash[:12]} pinned, {hash_now[:12]} now")
    return lines


def pin_differences(existing: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[str]:
    """Lines naming each compared pin that differs (a run without pins had the defaults)."""
    old = dict(existing or {})
    old.setdefault("pass_turn_fields", False)
    diffs = []
    for key in COMPARED_PINS:
        if key in _PINNED_LATER and (old.get(key) is None or new.get(key) is None):
            continue  # a run rendered elsewhere, or created before the pin
        if old.get(key) != new.get(key):
            diffs.append(f"{key.replace('_', ' ')}: {old.get(key)} → {new.get(key)}")
    return diffs

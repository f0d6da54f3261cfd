"""The checks SpecForge applies to pre-tokenized `data.prompts_path` rows, as our own function.

Used by the tests of the `specforge` export and by anyone checking a file before training.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

REQUIRED_FIELDS = ("input_ids", "loss_mask")


def row_problems(
    row: Mapping[str, Any], *, max_length: int | None = None, min_loss_tokens: int = 1
) -> list[str]:
    """What SpecForge would refuse (or silently drop) in one row; empty when it is accepted.

    SpecForge reads a row as pre-tokenized when it has both `input_ids` and `loss_mask`; each
    must be a flat list of integers (token ids not booleans, mask values 0 or 1), of equal,
    non-zero length. It then cuts both to its `max_length` and drops a row with fewer than
    `min_loss_tokens` (default 1) trainable tokens left, so a row whose whole answer lies past
    max_length would vanish from training without a word.
    """
    missing = [name for name in REQUIRED_FIELDS if name not in row]
    if missing:
        return [f"missing {' and '.join(missing)}"]
    problems: list[str] = []
    ids = _int_list(row["input_ids"], "input_ids", problems, allow_bool=False)
    mask = _int_list(row["loss_mask"], "loss_mask", problems, allow_bool=True)
    if ids is None or mask is None:
        return problems
    bad_mask = next((i for i, value in enumerate(mask) if value not in (0, 1)), None)
    if bad_mask is not None:
        problems.append(f"loss_mask[{bad_mask}] is {mask[bad_mask]}, not 0 or 1")
    if len(ids) != len(mask):
        problems.append(f"input_ids has {len(ids)} ids but loss_mask {len(mask)} values")
    if not ids:
        problems.append("input_ids is empty")
    if bad_mask is None:
        kept = mask if max_length is None else mask[:max_length]
        if sum(kept) < min_loss_tokens:
            where = "" if max_length is None else f" within the first {max_length} tokens"
            problems.append(
                f"{sum(kept)} trainable tokens{where}, fewer than {min_loss_tokens}: "
                "SpecForge drops the row"
            )
    return problems


def file_problems(
    path: Path, *, max_length: int | None = None, min_loss_tokens: int = 1
) -> Iterator[tuple[int, str]]:
    """(line number, problem) for every problem of a SpecForge JSONL file, read line by line."""
    with path.open(encoding="utf-8") as stream:
        for line_no, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                yield line_no, f"invalid JSON: {exc}"
                continue
            if not isinstance(row, dict):
                yield line_no, "not a JSON object"
                continue
            for problem in row_problems(
                row, max_length=max_length, min_loss_tokens=min_loss_tokens
            ):
                yield line_no, problem


def _int_list(value: Any, name: str, problems: list[str], *, allow_bool: bool) -> list[int] | None:
    if not isinstance(value, list):
        problems.append(f"{name} is not a list")
        return None
    for index, item in enumerate(value):
        if isinstance(item, list):
            problems.append(f"{name} is not one-dimensional ({name}[{index}] is a list)")
            return None
        if not isinstance(item, int) or (isinstance(item, bool) and not allow_bool):
            problems.append(f"{name}[{index}] is {json.dumps(item)}, not an integer")
            return None
    return [int(item) for item in value]

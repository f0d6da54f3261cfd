"""Held-out splits of an export: `--split eval=F --seed S` sends whole rows (every sample and turn
of a key) to the eval side by a hash of the key, and `--exclude FILE` drops training rows whose
prompt is one of FILE's, rendered with the run's pinned template.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from app.core.errors import ConfigurationError, InputError
from app.core.models import pack_ids
from app.ledger import reads, run_queries
from app.prompts.chat_path import ChatInputs, merge_template_kwargs
from app.prompts.inputs import read_prompts
from app.prompts.tokenization import ChatTokenizer

Side = Literal["train", "eval", "excluded"]
# the hash that places a key: sha256 of "<seed>:<key>", its first 8 bytes as a fraction of 2^64
KEY_HASH = "sha256(seed:key)[:8] / 2^64 < eval fraction"
RENDER_BATCH = 256


def eval_path(out: Path) -> Path:
    """Where the eval side of a split export goes: `r1.jsonl` → `r1.eval.jsonl`."""
    return out.with_name(f"{out.stem}.eval{out.suffix}" if out.suffix else f"{out.name}.eval")


def manifest_path(out: Path) -> Path:
    return out.with_name(out.name + ".manifest.json")


def parse_split(text: str) -> float:
    """`eval=0.02` → 0.02: the share of row keys held out for evaluation."""
    name, sep, value = text.partition("=")
    if not sep or name.strip() != "eval":
        raise ConfigurationError(f"--split {text!r}: expected eval=FRACTION, e.g. eval=0.02")
    try:
        fraction = float(value)
    except ValueError as exc:
        raise ConfigurationError(f"--split {text!r}: {value!r} is not a number") from exc
    if not 0 < fraction < 1:
        raise ConfigurationError(f"--split {text!r}: the eval fraction must be in (0, 1)")
    return fraction


def key_fraction(key: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def prompt_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(pack_ids(list(ids))).hexdigest()


@dataclass
class Exclusion:
    """The prompts of an --exclude file, as the run's template renders them."""

    path: str
    sha256: str
    prompts: int
    digests: set[str]

    def to_json(self) -> dict[str, Any]:
        return {"file": self.path, "sha256": self.sha256, "prompts": self.prompts}


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for name in files:
        with name.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_exclusion(path: Path, run: run_queries.RunInfo, tokenizer: ChatTokenizer) -> Exclusion:
    """Render every prompt of FILE (JSONL, Parquet or a datasets folder) with the run's pinned
    template and kwargs; a line that cannot be read or rendered is an error naming it (a
    prompt silently skipped could leak into training)."""
    if tokenizer.chat_template_hash != run.generation.chat_template_hash:
        raise ConfigurationError(
            f"the chat template at {run.generation.tokenizer_path} differs from the one run "
            f"{run.name} pinned; --exclude renders FILE's prompts with the run's own template"
        )
    if not path.exists():
        raise ConfigurationError(f"--exclude {path}: no such file")
    digests: set[str] = set()
    prompts = 0
    batch: list[tuple[int, ChatInputs]] = []

    def flush() -> None:
        results = tokenizer.apply_each([inputs for _, inputs in batch])
        for (line, _), ids in zip(batch, results, strict=True):
            if isinstance(ids, InputError):
                raise ConfigurationError(f"--exclude {path}: line {line}: {ids.reason}")
            digests.add(prompt_digest(ids))
        batch.clear()

    records = read_prompts(path, content_format=tokenizer.content_format)
    for record in records:
        if isinstance(record, InputError):
            if record.reason.startswith("duplicate"):
                continue  # the same prompt twice excludes it once
            raise ConfigurationError(f"--exclude {path}: {record}")
        prompts += 1
        if record.input_ids is not None:
            digests.add(prompt_digest(record.input_ids))
            continue
        kwargs = merge_template_kwargs(
            run.generation.chat_template_kwargs,
            record.chat_template_kwargs,
            record.reasoning_effort,
        )
        assert record.messages is not None
        inputs = ChatInputs(
            record.messages, record.tools, kwargs, True, assistant_prefix=record.assistant_prefix
        )
        batch.append((record.line, inputs))
        if len(batch) >= RENDER_BATCH:
            flush()
    if batch:
        flush()
    return Exclusion(str(path), _file_sha256(path), prompts, digests)


@dataclass
class Selection:
    """Where each exported item goes, and the counts the manifest records."""

    eval_fraction: float | None = None
    seed: int = 0
    exclusion: Exclusion | None = None
    # row keys of the run with an item whose prompt is one of the excluded ones
    excluded_keys: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0, "excluded": 0})
    keys: dict[str, set[str]] = field(
        default_factory=lambda: {"train": set(), "eval": set(), "excluded": set()}
    )

    def find_excluded(self, items: Iterable[reads.StoredItem]) -> None:
        """First pass: the keys with any item (sample or turn) whose prompt is excluded, so
        every item of such a row leaves the training side."""
        if self.exclusion is None:
            return
        wanted = self.exclusion.digests
        for item in items:
            if prompt_digest(item.prompt_ids) in wanted:
                self.excluded_keys.add(item.item_key)

    def side(self, item: reads.StoredItem) -> Side:
        key = item.item_key
        if self.eval_fraction is not None and key_fraction(key, self.seed) < self.eval_fraction:
            side: Side = "eval"
        elif key in self.excluded_keys:
            side = "excluded"
        else:
            side = "train"
        self.counts[side] += 1
        self.keys[side].add(key)
        return side

    def summary(self, out: Path) -> list[str]:
        """What the export printed: the split's and the exclusion's counts, the manifest."""
        lines = []
        counts, keys = self.counts, self.keys
        if self.eval_fraction is not None:
            lines.append(
                f"held out {counts['eval']} samples of {len(keys['eval'])} rows for eval "
                f"(eval={self.eval_fraction}, seed {self.seed}) in {eval_path(out)}"
            )
        if self.exclusion is not None:
            lines.append(
                f"dropped {counts['excluded']} training samples of {len(keys['excluded'])} rows "
                f"whose prompt is one of the {self.exclusion.prompts} prompts of "
                f"{self.exclusion.path}"
            )
        lines.append(f"split recorded in {manifest_path(out)}")
        return lines

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            # samples: exported items (a sample or turn each); rows: their distinct keys
            "samples": dict(self.counts),
            "rows": {side: len(keys) for side, keys in self.keys.items()},
        }
        if self.eval_fraction is not None:
            data["split"] = {"eval": self.eval_fraction, "seed": self.seed, "by": KEY_HASH}
        if self.exclusion is not None:
            data["exclude"] = {
                **self.exclusion.to_json(),
                "dropped_samples": self.counts["excluded"],
                "dropped_rows": len(self.keys["excluded"]),
            }
        return data

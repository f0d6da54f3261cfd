"""Checks of an image run's exports against the reference (`tests.support.image_reference`):
every specforge sample's ids, mask, counts and image references, the images an export copied
beside it, and the errors that named the refused rows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tests.support.image_reference import expected_prompt_ids, image_counts, image_size
from tests.support.image_rows import ImageRows


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def first_difference(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"position {i}: got {a}, want {b} (of {len(want)} prompt ids)"
    return f"lengths {len(got)} and {len(want)}"


def check_specforge(
    path: Path, rows: ImageRows, tokenizer_dir: Path, samples: int = 1, **cfg: int
) -> list[dict[str, Any]]:
    """Every good row's samples are in the export at path with input_ids = the reference's
    served prompt + output, loss 0 over the whole prompt, the reference counts and the images'
    hashes and sizes in prompt order; nothing else is there. Returns the exported rows."""
    exported = [json.loads(line) for line in path.read_text().splitlines()]
    keys = sorted(row["id"] for row in exported)
    assert keys == sorted(k for k in rows.expected for _ in range(samples)), keys
    for row in exported:
        want = rows.expected[row["id"]]
        prompt = expected_prompt_ids(tokenizer_dir, want, **cfg)
        n = len(prompt)
        ids = row["input_ids"]
        assert ids[:n] == prompt, (row["id"], first_difference(ids[:n], prompt))
        assert len(ids) > n, row["id"]  # an answer follows the prompt
        assert row["loss_mask"] == [0] * n + [1] * (len(ids) - n), row["id"]
        assert row["image_token_counts"] == image_counts(want.images, **cfg), row["id"]
        refs = row["images"]
        assert [r["sha256"] for r in refs] == [sha256_of(p) for p in want.images], row["id"]
        assert [(r["width"], r["height"]) for r in refs] == [image_size(p) for p in want.images]
    return exported


def copied_image(export_dir: Path, sha256: str) -> Path:
    """The one file an export with --with-images holds for this hash (named by it)."""
    found = [p for p in export_dir.rglob(f"{sha256}.*") if p.is_file()]
    assert len(found) == 1, (sha256, found)
    return found[0]


def check_copied_images(export_dir: Path, exported: list[dict[str, Any]]) -> set[str]:
    """Each image reference of the exported rows has its file beside the export, hashing to
    its sha256; returns the distinct hashes."""
    hashes = {ref["sha256"] for row in exported for ref in row["images"]}
    for sha in hashes:
        assert sha256_of(copied_image(export_dir, sha)) == sha
    return hashes


def run_readme_snippet(readme: Path, export: Path) -> None:
    """Run the trainer snippet of docs/images.md (the Python block after "A trainer reads") on
    export."""
    text = readme.read_text(encoding="utf-8")
    after = text[text.index("A trainer reads the samples") :]
    code = after[after.index("```python\n") + 10 : after.index("```\n", after.index("```python"))]
    assert 'Path("out/r1.jsonl")' in code, code
    exec(code.replace('Path("out/r1.jsonl")', f"Path({str(export)!r})"), {})


def check_refusals(stderr: str, rows: ImageRows) -> None:
    """Each bad row's error is printed, naming its line and the part (and source) at fault."""
    lines = [line for line in stderr.splitlines() if "skipped" in line]
    for bad in rows.bad:
        said = [line for line in lines if f"line {bad.line}:" in line]
        assert said, (bad, lines)
        for name in bad.names:
            assert any(name in line for line in said), (bad, said)

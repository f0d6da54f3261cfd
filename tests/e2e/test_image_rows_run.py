"""Sixty multimodal rows through `tokenmill run` on two emulators in Kimi mode, then export and
verify: every exported sample's ids are the fixture template's ids with each `<|media_pad|>`
repeated by its image's NaViT count (computed here, not by tokenmill), the 3 bad rows are
named errors, the images copied beside the export hash to their references, verify is clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.emulator_proc import start_emulator
from tests.support.image_exports import (
    check_copied_images,
    check_refusals,
    check_specforge,
    run_readme_snippet,
    sha256_of,
)
from tests.support.image_rows import build_image_rows
from tests.support.procs import ROOT, clean_env, tokenmill

pytestmark = pytest.mark.e2e

KIMI_FLAGS = ["--mm", "kimi", "--step-ms", "1", "--median-tokens", "6"]
WIDE = {"COLUMNS": "1000"}  # a refused row's error on one line


def test_sixty_image_rows_on_two_kimi_emulators(tmp_path: Path, kimi_tokenizer_dir: Path) -> None:
    rows = build_image_rows(tmp_path, use_image_root=True)
    env = clean_env(tmp_path / "data", **WIDE)
    emulators = [start_emulator(KIMI_FLAGS) for _ in range(2)]
    try:
        run = tokenmill(
            ["run", str(rows.path), "--run", "img", "--tokenizer", str(kimi_tokenizer_dir),
             "--server", emulators[0].url, "--server", emulators[1].url,
             "--image-root", str(rows.image_root), "--max-new-tokens", "8", "--seed", "3",
             "--json"],
            env, tmp_path,
        )  # fmt: skip
    finally:
        for emulator in emulators:
            emulator.stop()
    assert run.returncode == 0, run.stderr
    check_refusals(run.stderr, rows)
    counts = json.loads(run.stdout)
    assert counts["done"] == len(rows.expected) and counts["failed"] == 0, counts

    out = tmp_path / "export"
    out.mkdir()
    exported = tokenmill(
        ["export", "img", "--out", str(out / "img.jsonl"), "--with-images"], env, tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    samples = check_specforge(out / "img.jsonl", rows, kimi_tokenizer_dir)
    hashes = check_copied_images(out, samples)
    assert hashes == {sha256_of(p) for p in rows.distinct_images()}
    run_readme_snippet(ROOT / "docs" / "images.md", out / "img.jsonl")  # as a trainer reads it
    # the store holds each distinct image once, under its content address
    stored = sorted(p.name for p in (tmp_path / "data" / "storage" / "images").iterdir())
    assert sorted(p.split(".")[0] for p in stored) == sorted(hashes), stored

    parquet = tmp_path / "img.parquet"
    shards = tokenmill(
        ["export", "img", "--format", "parquet", "--out", str(parquet), "--with-images"], env
    )
    assert shards.returncode == 0, shards.stderr
    verify = tokenmill(["verify", "img", "--export", str(parquet)], env, tmp_path)
    assert verify.returncode == 0, verify.stdout + verify.stderr

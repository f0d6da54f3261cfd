"""Tokenizer folder hashes: the per-file sha256 manifest a run pins (weights, hidden files and
compiled Python left out), the legacy hash of named files, and the lines naming what changed."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from app.ledger import pin_checks

# Every file of a tokenizer folder can decide the prompt ids (the tokenizer's own code, a
# helper module it imports, the vocabulary, the template), so all are hashed except weights,
# which are large and never read by a tokenizer. Hidden files and folders (a builder's stamp,
# .git) and compiled Python are not part of the tokenizer either.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".h5",
    ".msgpack",
    ".onnx",
    ".npz",
    ".npy",
    ".safetensors.index.json",
    ".bin.index.json",
)
_SKIPPED_SUFFIXES = (".pyc", ".pyo")
_SKIPPED_FOLDERS = frozenset({"__pycache__"})
# Runs created before the per-file manifest hashed only these files (their hash is kept).
_LEGACY_NAMES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
    }
)
_LEGACY_SUFFIXES = (".model", ".tiktoken")


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def tokenizer_files_manifest(folder: Path) -> dict[str, str]:
    """sha256 of every file of folder (subfolders included) except weights, hidden files and
    compiled Python, by its path relative to folder with "/" separators."""
    found: dict[str, str] = {}
    for file in sorted(folder.rglob("*")):
        relative = file.relative_to(folder)
        parts = relative.parts
        if any(p.startswith(".") or p in _SKIPPED_FOLDERS for p in parts):
            continue
        if not file.is_file() or is_weight_file(file.name) or file.name.endswith(_SKIPPED_SUFFIXES):
            continue
        found[relative.as_posix()] = hashlib.sha256(file.read_bytes()).hexdigest()
    return found


def manifest_hash(files: Mapping[str, str]) -> str:
    """sha256 over (path, sha256 of content) of each file, sorted by path."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode("utf-8") + b"\0")
        digest.update(bytes.fromhex(files[name]))
    return digest.hexdigest()


def legacy_tokenizer_files_hash(folder: Path) -> str:
    """The hash of runs created before the manifest: the named tokenizer files only."""
    files = {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in folder.iterdir()
        if f.is_file() and _is_legacy_tokenizer_file(f.name)
    }
    return manifest_hash(files)


def _is_legacy_tokenizer_file(name: str) -> bool:
    if name in _LEGACY_NAMES or name.endswith(_LEGACY_SUFFIXES):
        return True
    return name.startswith("tokenization_") and name.endswith(".py")


def folder_changes(
    folder: Path, pinned_hash: str, pinned_files: Mapping[str, str] | None
) -> list[str]:
    """`file_changes` of a folder not loaded yet (check before its own code runs); none for
    a path that is not a folder (loading it says what is wrong with it)."""
    folder = folder.expanduser()
    if not folder.is_dir():
        return []
    files = tokenizer_files_manifest(folder)
    return pin_checks.file_changes(
        pinned_hash, pinned_files, manifest_hash(files), files, legacy_tokenizer_files_hash(folder)
    )

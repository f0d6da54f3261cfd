"""Inputs cannot make tokenmill read files outside the paths it was given.

A prompt file's lines, ids and `--chat-template-kwargs` are data: a path, a `file://` URL or a
Jinja `{% include %}` in them is tokenized as text, never opened or rendered. An image part's
reference is read, as an image only: a file that does not decode as one is refused and nothing
of it is stored or shown; other content parts that point at files are refused unread. A
tokenizer folder's custom code is never imported unless `--trust-remote-code` is given. Every
`open` of the process is watched with an audit hook.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.core.contracts import SamplingParams
from app.core.errors import ConfigurationError
from app.core.settings import Settings
from app.ledger import reads, run_queries
from app.prompts.tokenization import load_tokenizer
from app.storage import run_store
from workers.intake.producer import EnqueueOptions, enqueue

_opened: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], str | bytes | Path):
        _opened.append(str(args[0] if not isinstance(args[0], bytes) else args[0].decode()))


sys.addaudithook(_audit)  # cannot be removed; it records only inside `watching_opens`


@pytest.fixture
def watching_opens() -> Iterator[list[str]]:
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    path = folder / "secret.txt"
    path.write_text("TOP-SECRET-CANARY")
    return path


def touched(opened: list[str], folder: Path) -> list[str]:
    inside = folder.resolve()
    return [p for p in opened if Path(p).resolve().is_relative_to(inside)]


def test_paths_urls_and_templates_in_a_prompt_file_are_only_text(
    pg_engine: Engine,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
    secret: Path,
    watching_opens: list[str],
) -> None:
    include = "{% include '" + str(secret) + "' %}{{ 7 * 7 }}"
    lines: list[dict[str, Any]] = [
        {"id": "path", "prompt": str(secret)},
        {"id": "url", "prompt": secret.as_uri()},
        {"id": "jinja", "messages": [{"role": "user", "content": include}]},
        {"id": str(secret), "prompt": "an id that looks like a path"},
        {
            "id": "image",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": secret.as_uri()}}],
                }
            ],
        },
        {"id": "file-part", "messages": [{"role": "user", "content": [{"type": "file",
                                                                        "file": str(secret)}]}]},
        {"id": "ids", "input_ids": str(secret)},
    ]  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tokenizer = load_tokenizer(kimi_tokenizer_dir)
    options = EnqueueOptions(
        prompts,
        "confined",
        SamplingParams(max_new_tokens=8),
        chat_template_kwargs={"note": include, "path": str(secret)},
    )

    store = tmp_path / "store"
    settings = Settings(storage_url=store.as_uri())
    report = enqueue(pg_engine, tokenizer, options, publish=None, settings=settings)

    # the image part's file, once, as an image; nothing else outside the given paths
    assert touched(watching_opens, secret.parent) == [str(secret)]
    assert str(prompts) in watching_opens, "the audit hook saw no open at all"
    assert sorted(e.line for e in report.errors) == [5, 6, 7]
    messages = {e.line: e.reason for e in report.errors}
    assert "content[0]" in messages[5] and "is not a usable image" in messages[5]
    assert "TOP-SECRET" not in messages[5]
    # nothing of the prompt file is stored: at most the run's marker (its name and id, which
    # the store holds for workers to find once an image part opened it)
    kept = [p.relative_to(store) for p in store.rglob("*") if p.is_file()] if store.exists() else []
    assert [str(p) for p in kept] in ([], [run_store.marker_name("confined")]), kept
    assert "file" in messages[6]
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "confined")
        stored = {i.item_key: i for i in reads.iter_items(conn, run.id, statuses=("pending",))}
    assert set(stored) == {"path", "url", "jinja", str(secret)}
    decoded = {key: tokenizer.decode(item.prompt_ids) for key, item in stored.items()}
    assert all("TOP-SECRET" not in text for text in decoded.values())
    assert str(secret) in decoded["path"] and secret.as_uri() in decoded["url"]
    assert include in decoded["jinja"], "user content went through Jinja"


def test_a_tokenizer_folder_custom_code_is_not_imported(
    kimi_tokenizer_dir: Path, tmp_path: Path, watching_opens: list[str]
) -> None:
    folder = tmp_path / "tokenizer"
    shutil.copytree(kimi_tokenizer_dir, folder)
    marker = tmp_path / "remote-code-ran"
    (folder / "evil_tokenization.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
    )
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "evil_tokenization.EvilTokenizer"]}
    config["tokenizer_class"] = "EvilTokenizer"
    config_path.write_text(json.dumps(config))

    with pytest.raises(ConfigurationError, match=r"trust.remote.code"):
        load_tokenizer(folder)
    assert not marker.exists(), "the tokenizer folder's code ran without --trust-remote-code"
    # transformers may read the file (inside the folder we were given) but never runs it
    assert touched(watching_opens, tmp_path) == touched(watching_opens, folder)


@pytest.mark.parametrize("escape", ["../outside/secret.arrow", "/etc/hostname", "a/../../x.arrow"])
def test_a_datasets_folder_cannot_name_files_outside_itself(
    tmp_path: Path, secret: Path, escape: str, watching_opens: list[str]
) -> None:
    import datasets

    from app.core.errors import InputError
    from app.prompts.inputs import read_prompts

    folder = tmp_path / "ds"
    datasets.Dataset.from_list([{"id": "a", "prompt": "hi"}]).save_to_disk(str(folder))
    shutil.copy(next(folder.glob("data-*.arrow")), secret.parent / "secret.arrow")
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": escape}]
    (folder / "state.json").write_text(json.dumps(state))
    watching_opens.clear()
    with pytest.raises(InputError, match="outside its folder"):
        list(read_prompts(folder))
    assert touched(watching_opens, secret.parent) == []
    assert not [p for p in watching_opens if p == "/etc/hostname"]

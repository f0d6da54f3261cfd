"""What a run pins about its rendering, through `tokenmill enqueue`: the named template chosen
(first unless --chat-template-name), a --chat-template file with its sha256, --pass-turn-fields
and the transformers versions; a later enqueue keeps the pins or is refused naming the one that
differs, and later loads refuse a pinned file that changed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import transformers
from click.testing import CliRunner, Result
from sqlalchemy import Engine

from app.core.errors import TokenizerError
from app.core.settings import get_settings
from app.ledger import run_queries
from app.prompts.tokenization import load_for_run
from ops.cli import cli
from tests.support.oracle_families import family_folder
from tests.support.procs import clean_env


@pytest.fixture
def cli_env(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, value in clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=pg_url).items():
        if name.startswith("TOKENMILL_"):
            monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def _enqueue(prompts: Path, run: str, folder: Path, *flags: str) -> Result:
    args = ["enqueue", str(prompts), "--run", run, "--tokenizer", str(folder), "--json", *flags]
    return CliRunner().invoke(cli, args)


def test_a_run_pins_its_template_choice_and_versions(
    cli_env: None, pg_engine: Engine, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    folder = family_folder("hermes-3", kimi_tokenizer_dir, tmp_path / "hermes")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n", encoding="utf-8")
    first = _enqueue(prompts, "pinned", folder)
    assert first.exit_code == 0, first.output
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "pinned")
    assert run.generation.chat_pins == {
        "chat_template_name": "default",
        "chat_template_file": None,
        "chat_template_file_hash": None,
        "pass_turn_fields": False,
        "transformers": transformers.__version__,
        "renders_as": "5.19.0",
        "request_fields": ["tool_choice", "continue_final_message"],
    }
    # a later enqueue without the flags keeps the run's choice; another choice is refused
    again = _enqueue(prompts, "pinned", folder)
    assert again.exit_code == 0, again.output
    other = _enqueue(prompts, "pinned", folder, "--chat-template-name", "tool_use")
    assert other.exit_code != 0
    assert "chat template name: default → tool_use" in other.output
    passing = _enqueue(prompts, "pinned", folder, "--pass-turn-fields")
    assert "pass turn fields: False → True" in passing.output


def test_a_chat_template_file_is_pinned_by_its_hash(
    cli_env: None, pg_engine: Engine, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    folder = family_folder("kimi-k2", kimi_tokenizer_dir, tmp_path / "kimi")
    template = tmp_path / "served.jinja"
    template.write_text(
        "{%- for m in messages -%}<|im_user|>{{ m.role }}\\n{{ m.content }}<|im_end|>"
        "{%- endfor -%}<|im_assistant|>",
        encoding="utf-8",
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n", encoding="utf-8")
    done = _enqueue(prompts, "filed", folder, "--chat-template", str(template))
    assert done.exit_code == 0, done.output
    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, "filed")
    assert run.generation.chat_pins is not None and run.generation.chat_pins[
        "chat_template_file"
    ] == str(template)
    tokenizer = load_for_run(folder, trust_remote_code=False, chat_pins=run.generation.chat_pins)
    assert tokenizer.chat_template_hash == run.generation.chat_template_hash
    template.write_text("{{ messages[0].content }}", encoding="utf-8")
    with pytest.raises(TokenizerError, match="changed since the run pinned it"):
        load_for_run(folder, trust_remote_code=False, chat_pins=run.generation.chat_pins)

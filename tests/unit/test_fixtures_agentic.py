"""The custom-code Kimi-shaped fixture: loads only with trust_remote_code, renders tools through
its helper module, the slow variant gives the same ids, parallel templating equals serial."""

from __future__ import annotations

import hashlib
import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest

from app.core.constants import NORMALIZATION_VERSION
from app.core.contracts import SamplingParams
from app.core.errors import TokenizerError, TokenmillError
from app.core.run_kinds import TurnsMode
from app.ledger import run_queries
from app.prompts.chat_path import ChatInputs
from app.prompts.template_pool import Templater
from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from emulator.fixtures.agentic_rows import CASES, WEATHER_TOOL, agentic_rows
from emulator.fixtures.kimi import SPECIAL_TOKENS_BY_NAME
from emulator.fixtures.kimi_custom import (
    HELPER_MODULE,
    TOKENIZER_MODULE,
    chat_template,
    ensure_agentic_tokenizer,
)
from workers.chains.tokenizers import TokenizerCache

THINK, IM_END = SPECIAL_TOKENS_BY_NAME["<think>"], SPECIAL_TOKENS_BY_NAME["<|im_end|>"]
CALL = {"role": "assistant", "content": None}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_agentic_tokenizer(tmp_path_factory.mktemp("agentic"))


@pytest.fixture(scope="module")
def slow_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_agentic_tokenizer(tmp_path_factory.mktemp("agentic-slow"), slow=True)


@pytest.fixture(scope="module")
def tok(folder: Path) -> ChatTokenizer:
    return load_tokenizer(folder, trust_remote_code=True)


def chat(i: int) -> list[ChatInputs]:
    """ChatInputs of corpus rows in `messages` form, with their tools and kwargs."""
    out = []
    for row in agentic_rows(i):
        if "messages" not in row:
            continue
        tools = row.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        out.append(ChatInputs(row["messages"], tools, row.get("chat_template_kwargs")))
    return out


def test_the_folder_is_shaped_like_kimis(folder: Path) -> None:
    names = {p.name for p in folder.iterdir()}
    assert {TOKENIZER_MODULE, HELPER_MODULE, "tiktoken.model", "chat_template.jinja"} <= names
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (
        config["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi_fixture.KimiFixtureTokenizer"
    )


def test_custom_code_loads_only_with_trust_remote_code(folder: Path) -> None:
    with pytest.raises(TokenizerError, match="--trust-remote-code") as info:
        load_tokenizer(folder)
    assert "tokenization_kimi_fixture.KimiFixtureTokenizer" in str(info.value)


def test_special_ids_and_template(tok: ChatTokenizer) -> None:
    assert not tok.is_fast
    assert tok.trust_remote_code
    assert (tok.think_start_id, tok.think_end_id) == (THINK, THINK + 1)
    assert tok.eos_token_ids == [IM_END]
    ids = tok.apply([{"role": "user", "content": "Hello there"}])
    assert ids[0] == SPECIAL_TOKENS_BY_NAME["<|im_user|>"]
    assert ids[-1] == THINK
    assert tok.decode(ids).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert tok.apply([{"role": "user", "content": "Hi"}], {"thinking": False})[-2:] == [
        THINK,
        THINK + 1,
    ]
    assert tok.chat_template_hash == hashlib.sha256(chat_template().encode()).hexdigest()


def test_tools_are_declared_by_the_helper_module(folder: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(folder, trust_remote_code=True)
    turns = [{"role": "user", "content": "Weather in Oslo?"}]
    text = tok.render(turns, None, [WEATHER_TOOL])
    assert "namespace functions {" in text
    assert "type get_weather = (_: {" in text
    assert '  unit?: "celsius" | "fahrenheit",' in text
    assert "// City name" in text
    # the helper module decides the prompt: change it, and the same row renders otherwise
    copy = Path(shutil.copytree(folder, tmp_path / "tok"))
    helper = copy / HELPER_MODULE
    helper.write_text(helper.read_text().replace("namespace functions", "namespace tools"))
    changed = load_tokenizer(copy, trust_remote_code=True)
    assert "namespace tools {" in changed.render(turns, None, [WEATHER_TOOL])
    old, new = tok.tokenizer_files[HELPER_MODULE], changed.tokenizer_files[HELPER_MODULE]
    assert changed.changes_from(tok.tokenizer_hash, tok.tokenizer_files) == [
        f"tokenizer file '{HELPER_MODULE}' changed (sha256 {old[:12]} → {new[:12]})"
    ]


def test_tool_calls_results_and_reasoning(tok: ChatTokenizer) -> None:
    turns = [
        {"role": "user", "content": "old question"},
        {"role": "assistant", "content": "old answer", "reasoning_content": "old thought"},
        {"role": "user", "content": "Weather?"},
        {
            **CALL,
            "reasoning_content": "call the tool",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    ]
    text = tok.hf_tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    # reasoning only after the last user turn; history before it gets an empty think
    assert "old thought" not in text
    assert "old answer" in text and "<think></think>old answer" in text
    assert "<think>call the tool</think>" in text
    assert '<|tool_call_begin|>a<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|>' in text
    assert "<|im_system|>tool<|im_middle|>## Return of a\nsunny<|im_end|>" in text
    # string arguments are rendered verbatim (the raw template; the chat path parses them)
    turns[3]["tool_calls"][0]["function"]["arguments"] = '{"x":1}'
    raw = tok.hf_tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert '<|tool_call_argument_begin|>{"x":1}<|tool_call_end|>' in raw


def test_the_corpus_covers_every_case_and_renders() -> None:
    rows = list(agentic_rows())
    assert len(rows) >= 40
    assert len({row["id"] for row in rows}) == len(rows)
    assert len(rows) >= 4 * len(CASES)


def test_the_slow_variant_gives_the_same_ids(tok: ChatTokenizer, slow_folder: Path) -> None:
    slow = load_tokenizer(slow_folder, trust_remote_code=True)
    assert slow.hf_tokenizer.pure_python_bpe and not tok.hf_tokenizer.pure_python_bpe
    batch = chat(40)
    assert slow.apply_each(batch) == tok.apply_each(batch)


def test_parallel_templating_equals_serial(slow_folder: Path) -> None:
    slow = load_tokenizer(slow_folder, trust_remote_code=True)
    batches = [chat(40)[k::3] for k in range(3)]
    serial = [slow.apply_each(b) for b in batches]
    with Templater(slow, processes=2) as templater:
        assert templater.processes == 2
        # until its processes have loaded the tokenizer, batches are templated here
        first = templater.submit(batches[0])
        assert templater.pooled_batches == 0
        templater.warm_up()
        futures = [first, *(templater.submit(b) for b in batches[1:])]
        assert [f.result() for f in futures] == serial
        assert templater.pooled_batches == 2


def test_a_fast_tokenizer_is_templated_inline(kimi_tokenizer_dir: Path) -> None:
    fast = load_tokenizer(kimi_tokenizer_dir)
    with Templater(fast, processes=4) as templater:
        assert templater.processes == 1
        batch = chat(10)
        assert templater.submit(batch).result() == fast.apply_each(batch)


def test_later_turns_load_the_pinned_custom_code_and_refuse_a_changed_file(
    folder: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(folder, tmp_path / "tok"))
    pinned = load_tokenizer(copy, trust_remote_code=True)
    settings = run_queries.GenerationSettings(
        tokenizer_path=str(copy),
        tokenizer_hash=pinned.tokenizer_hash,
        chat_template_hash=pinned.chat_template_hash,
        chat_template_kwargs={},
        sampling=SamplingParams(),
        samples_per_prompt=1,
        think_end_id=pinned.think_end_id,
        eos_token_ids=pinned.eos_token_ids,
        turns=TurnsMode.ALL,
        trust_remote_code=True,
        tokenizer_files=pinned.tokenizer_files,
        normalization_version=NORMALIZATION_VERSION,
    )
    run = run_queries.RunInfo(
        id=1, name="r", generation=settings, fingerprint=None, created_at=datetime.now(UTC)
    )
    assert TokenizerCache._load(run).tokenizer_hash == pinned.tokenizer_hash
    (copy / HELPER_MODULE).write_text("raise RuntimeError('must never run')\n")
    with pytest.raises(TokenmillError, match=f"tokenizer file '{HELPER_MODULE}' changed"):
        TokenizerCache._load(run)

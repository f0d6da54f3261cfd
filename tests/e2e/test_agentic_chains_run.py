"""Agentic rows through `tokenmill run --turns all` (embedded) against the emulator writing tool
calls (`--tool-calls kimi`, and `hermes` on a Hermes/Qwen2.5-style template): every chained
prompt equals SGLang 0.5.23's own chat-path render of the history an agent loop against SGLang
would send (the wheel's reasoning parser and function-call detector on the decoded output, its
request model and chat-path functions, the template), and every chain ends where SGLang's parse
of its outputs says, with that reason."""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from app.core import constants
from emulator.fixtures.kimi import IM_END, SPECIAL_TOKENS_BY_NAME, ensure_kimi_tokenizer
from ops.emulator_proc import start_emulator
from tests.support import sglang_agent_loop
from tests.support.chat_templates import tokenizer_with_template
from tests.support.procs import clean_env, tokenmill
from tests.support.sglang_agent_loop import SGLangAgentLoop

pytestmark = pytest.mark.e2e

ROWS = 100
NAMES = ("get_weather", "search", "read_file")
TOOLS = [
    {
        "type": "function",
        "function": {"name": n, "parameters": {"type": "object", "properties": {}}},
    }
    for n in NAMES
]
EOS = SPECIAL_TOKENS_BY_NAME[IM_END]


def agentic_row(n: int) -> dict[str, Any]:
    """2 to 6 tool calls, one per assistant turn, then a final answer; every other row declares
    one tool only (its chains run on while the target calls, and reach their end)."""
    rng = random.Random(n)
    tools = TOOLS if n % 2 else TOOLS[:1]
    names = [t["function"]["name"] for t in tools]
    turns: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": f"Task {n}: look things up."},
    ]
    for k in range(rng.randint(2, 6)):
        name, call_id = rng.choice(names), f"orig_{k}"
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}
        turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        turns.append({"role": "tool", "tool_call_id": call_id, "content": f"{name} result {k}"})
    turns.append({"role": "assistant", "content": "All done."})
    return {"id": f"r{n}", "messages": turns, "tools": tools}


@dataclass(frozen=True)
class Family:
    """An emulated model family: the emulator's format, the run's parser, the server's."""

    name: str
    reasoning_parser: str | None
    opening: str  # what opens one call in the family's format
    emulator_flags: tuple[str, ...]
    run_flags: tuple[str, ...]


FAMILIES = {
    "kimi": Family("kimi", "kimi_k2", "<|tool_call_begin|>", ("--tool-calls", "kimi"), ()),
    "hermes": Family(
        "hermes",
        None,
        "<tool_call>",
        ("--tool-calls", "hermes", "--think-end-id", "none"),
        ("--tool-call-parser", "hermes"),
    ),
}


def expected_ending(
    answer: dict[str, Any], dataset_next: list[dict[str, Any]], name: str | None, opening: str
) -> str | None:
    """The rules of docs/inputs.md applied to SGLang's parse of one regenerated turn."""
    calls = answer.get("calls") or []
    opened = (answer.get("raw") or "").count(opening)
    if opened > len(calls):
        return constants.CHAIN_END_MALFORMED_CALL
    if not calls:
        if name is not None:
            return constants.CHAIN_END_NO_CALL
        return constants.CHAIN_END_COMPLETE if not dataset_next else None
    if len(calls) > 1:
        return constants.CHAIN_END_PARALLEL_CALLS
    if name is None:
        return constants.CHAIN_END_RESULTS_EXHAUSTED
    return None if calls[0][1] == name else constants.CHAIN_END_OTHER_TOOL


@pytest.mark.parametrize("family", [FAMILIES["kimi"], FAMILIES["hermes"]], ids=["kimi", "hermes"])
def test_agentic_chains_run_end_to_end_as_sglang_renders_them(
    tmp_path: Path, family: Family
) -> None:
    fixture = ensure_kimi_tokenizer(tmp_path / "cache")
    if family.name == "kimi":
        folder = Path(shutil.copytree(fixture, tmp_path / "tok"))
    else:
        folder = tokenizer_with_template(
            fixture, tmp_path / "tok", sglang_agent_loop.HERMES_TEMPLATE
        )
    rows = [agentic_row(n) for n in range(ROWS)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    env = clean_env(tmp_path / "data")
    emulator = start_emulator(
        [
            "--step-ms",
            "1",
            "--median-tokens",
            "6",
            "--sigma",
            "0",
            "--tokenizer",
            str(folder),
            *family.emulator_flags,
        ]
    )
    try:
        args = ["run", str(path), "--run", "agents", "--tokenizer", str(folder), "--turns", "all"]
        ran = tokenmill(
            [
                *args,
                *family.run_flags,
                "--max-new-tokens",
                "96",
                "--seed",
                "1",
                "--server",
                emulator.url,
            ],
            env,
        )
    finally:
        emulator.stop()
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    verified = tokenmill(["verify", "agents"], env)
    assert verified.returncode == 0 and "clean" in verified.stdout, verified.stdout
    status = tokenmill(["status", "agents", "--json"], env)
    endings = json.loads(status.stdout)["chain_endings"]
    out = tmp_path / "turns.jsonl"
    exported = tokenmill(["export", "agents", "--format", "specforge", "--out", str(out)], env)
    assert exported.returncode == 0, exported.stderr

    chains: dict[str, list[dict[str, Any]]] = {}
    for sample in map(json.loads, out.read_text().splitlines()):
        chains.setdefault(sample["id"], []).append(sample)
    assert chains.keys() == {r["id"] for r in rows}
    sglang_path = SGLangAgentLoop(
        folder, family.name.replace("kimi", "kimi_k2"), family.reasoning_parser
    )
    recounted: Counter[str] = Counter()
    checked = 0
    splits: dict[str, list[tuple[list[int], list[int]]]] = {}
    for row in rows:
        chains[row["id"]] = chain = sorted(chains[row["id"]], key=lambda s: s["turn"])
        assert [s["turn"] for s in chain] == list(range(len(chain)))
        splits[row["id"]] = [
            (s["input_ids"][: s["loss_mask"].index(1)], s["input_ids"][s["loss_mask"].index(1) :])
            for s in chain
        ]
    parsed = sglang_path.parse_all(
        [([output for _, output in splits[row["id"]]], row["tools"]) for row in rows], EOS
    )
    for row, answers in zip(rows, parsed, strict=True):
        chain, split = chains[row["id"]], splits[row["id"]]
        conversation = row["messages"]
        assistant_at = [i for i, t in enumerate(conversation) if t["role"] == "assistant"]
        history = [dict(t) for t in conversation[: assistant_at[0]]]
        assert split[0][0] == sglang_path.render(history, row["tools"])
        ending = None
        for k, answer in enumerate(answers):
            nxt = assistant_at[k + 1] if k + 1 < len(assistant_at) else len(conversation)
            dataset_next = conversation[assistant_at[k] + 1 : nxt]
            results = [t for t in dataset_next if t["role"] == "tool"]
            name = (
                conversation[assistant_at[k]]["tool_calls"][0]["function"]["name"]
                if results
                else None
            )
            ending = expected_ending(answer, dataset_next, name, family.opening)
            if ending is not None:
                assert k == len(chain) - 1, (row["id"], k, ending)
                break
            message: dict[str, Any] = {"role": "assistant", "content": answer["normal_text"] or ""}
            if answer["reasoning_text"]:
                message["reasoning_content"] = answer["reasoning_text"]
            if answer["calls"]:
                ((_, called, arguments),) = answer["calls"]
                count = sum(len(t.get("tool_calls") or []) for t in history)
                # SGLang's `_process_tool_call_id`: kimi_k2 counts the history's calls; other
                # parsers draw call_ + 24 random hex digits, which this template never renders
                call_id = f"functions.{called}:{count}"
                function = {"name": called, "arguments": arguments}
                message["tool_calls"] = [{"id": call_id, "type": "function", "function": function}]
                result, *rest = dataset_next
                history += [message, {**result, "tool_call_id": call_id}, *rest]
            else:
                history += [message, *dataset_next]
            assert split[k + 1][0] == sglang_path.render(history, row["tools"]), (row["id"], k + 1)
            checked += 1
        assert ending is not None, row["id"]
        recounted[ending] += 1
    assert endings == dict(sorted(recounted.items()))
    assert checked > 0
    # the emulator's draws reach every ending of a chain but parallel calls in the dataset
    assert set(recounted) == set(constants.CHAIN_ENDINGS), recounted

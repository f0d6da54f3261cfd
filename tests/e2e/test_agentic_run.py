"""40 agentic rows through `tokenmill run --turns each --trust-remote-code` with the custom-code
(Kimi-shaped) fixture: every exported prompt equals SGLang 0.5.23's chat path for its boundary,
and verify and both exports work from another folder with no flags."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from app.prompts.input_turns import SHAREGPT_ROLES, sharegpt_tool_turns, sharegpt_tools
from emulator.fixtures.agentic_rows import agentic_rows
from emulator.fixtures.kimi_custom import ensure_agentic_tokenizer
from ops.emulator_proc import start_emulator
from tests.support import sglang_chat_path as sglang
from tests.support.procs import clean_env, tokenmill
from tests.support.sglang_contract import load_protocol

pytestmark = pytest.mark.e2e

ROWS = 40
ALIASES = ("reasoning", "thinking")


def openai_turns(row: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """The row's turns and tools in OpenAI's shape, as a client would send them to SGLang.

    ShareGPT rows go through tokenmill's documented conversion (ids `call_{turn}_{k}`); the
    reasoning aliases are renamed to `reasoning_content`, the field SGLang's request model has.
    """
    tools = row.get("tools")
    if "messages" in row:
        turns = [dict(t) for t in row["messages"]]
    else:
        converted = sharegpt_tool_turns(row["conversations"], "conversations")
        turns = [
            t if "role" in t else {"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
            for t in converted
        ]
        tools = sharegpt_tools(tools, row["conversations"])
    if isinstance(tools, str):
        tools = json.loads(tools)
    for turn in turns:
        for alias in ALIASES:
            if alias in turn:
                turn["reasoning_content"] = turn.pop(alias)
    return turns, tools


def boundaries(turns: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The history before each assistant turn, then the whole chat if it ends on user or tool."""
    out = [turns[:i] for i, t in enumerate(turns) if t["role"] == "assistant"]
    if turns[-1]["role"] in ("user", "tool"):
        out.append(turns)
    return out


def sglang_prompts(folder: Path, rows: list[dict[str, Any]]) -> dict[tuple[str, int], list[int]]:
    """Each boundary's prompt as SGLang builds it: its request model, its turn functions, the
    template with the request's tools and kwargs, encoded without special tokens."""
    hf = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True, local_files_only=True)
    content_format = sglang.detect_content_format(hf.chat_template)
    protocol = load_protocol()
    expected: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        turns, tools = openai_turns(row)
        for index, history in enumerate(boundaries(turns)):
            request = protocol.ChatCompletionRequest(
                model="m",
                messages=history,
                tools=tools,
                chat_template_kwargs=row.get("chat_template_kwargs"),
            )
            dumped = [m.model_dump() for m in request.messages]
            messages = sglang.reference_messages(dumped, content_format)
            text = hf.apply_chat_template(
                messages,
                tools=[t.model_dump() for t in request.tools] if request.tools else None,
                add_generation_prompt=True,
                tokenize=False,
                **(request.chat_template_kwargs or {}),
            )
            expected[(row["id"], index)] = list(hf.encode(text, add_special_tokens=False))
    return expected


def test_agentic_rows_run_on_the_custom_code_fixture_as_sglang_renders_them(
    tmp_path: Path,
) -> None:
    folder = Path(shutil.copytree(ensure_agentic_tokenizer(tmp_path / "cache"), tmp_path / "tok"))
    rows = list(agentic_rows(ROWS))
    assert len(rows) == ROWS
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    env = clean_env(tmp_path / "data")
    emulator = start_emulator(["--step-ms", "1", "--median-tokens", "8"])
    try:
        args = ["run", str(path), "--run", "agents", "--tokenizer", "tok", "--turns", "each"]
        args += ["--trust-remote-code", "--max-new-tokens", "8", "--seed", "1"]
        ran = tokenmill(
            [*args, "--server", emulator.url],
            env,
            cwd=tmp_path,  # a relative --tokenizer, as typed
        )
    finally:
        emulator.stop()
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]

    # from another folder, no flags: the run pins the tokenizer path and --trust-remote-code
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    verified = tokenmill(["verify", "agents"], env, cwd=elsewhere)
    assert verified.returncode == 0 and "clean" in verified.stdout, verified.stdout
    for fmt in ("specforge", "conversations"):
        out = elsewhere / f"{fmt}.jsonl"
        exported = tokenmill(["export", "agents", "--format", fmt, "--out", str(out)], env)
        assert exported.returncode == 0, exported.stderr

    expected = sglang_prompts(folder, rows)
    specforge = (elsewhere / "specforge.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in specforge]
    conversations = (elsewhere / "conversations.jsonl").read_text().splitlines()
    assert len(samples) == len(conversations) == len(expected)
    got = {}
    for sample in samples:
        prompt_len = sample["loss_mask"].index(1)
        got[(sample["id"], sample["turn"])] = sample["input_ids"][:prompt_len]
    assert got.keys() == expected.keys()
    differ = [key for key in expected if got[key] != expected[key]]
    assert differ == []

"""Agentic rows through `tokenmill run --turns all` (embedded) against the emulator writing tool
calls (`--tool-calls kimi`, and `hermes` on a Hermes/Qwen2.5-style template): every chained
prompt equals SGLang 0.5.23's own chat-path render of the history an agent loop against SGLang
would send (the wheel's reasoning parser and function-call detector on the decoded output, its
request model and chat-path functions, the template), and every chain ends where SGLang's parse
of its outputs says, with that reason."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from app.core import constants
from ops.emulator_proc import start_emulator
from tests.support.agentic_chains import FAMILIES, Parses, agentic_row, sglang_chain
from tests.support.procs import clean_env, tokenmill

pytestmark = pytest.mark.e2e

ROWS = 100


# (family, the emulator's length draws, --max-new-tokens): answers that always fit, and draws
# longer than max_new_tokens, whose turns are cut there and end their chains (`truncated`)
CASES = {
    "kimi": (FAMILIES["kimi"], ("--median-tokens", "6", "--sigma", "0"), 96),
    "hermes": (FAMILIES["hermes"], ("--median-tokens", "6", "--sigma", "0"), 96),
    "kimi-cut": (FAMILIES["kimi"], ("--median-tokens", "20", "--sigma", "0.6"), 32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_agentic_chains_run_end_to_end_as_sglang_renders_them(tmp_path: Path, case: str) -> None:
    family, lengths, max_new_tokens = CASES[case]
    folder = family.tokenizer(tmp_path)
    rows = [agentic_row(n) for n in range(ROWS)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    env = clean_env(tmp_path / "data")
    emulator = start_emulator(
        [
            "--step-ms",
            "1",
            *lengths,
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
                str(max_new_tokens),
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
    shown = json.loads(status.stdout)
    endings = shown["chain_endings"]
    assert shown["failed"] == 0, shown
    out = tmp_path / "turns.jsonl"
    exported = tokenmill(["export", "agents", "--format", "specforge", "--out", str(out)], env)
    assert exported.returncode == 0, exported.stderr

    chains: dict[str, list[dict[str, Any]]] = {}
    for sample in map(json.loads, out.read_text().splitlines()):
        chains.setdefault(sample["id"], []).append(sample)
    assert chains.keys() == {r["id"] for r in rows}
    split = {
        row_id: [
            (s["input_ids"][: s["loss_mask"].index(1)], s["input_ids"][s["loss_mask"].index(1) :])
            for s in sorted(samples, key=lambda s: s["turn"])
        ]
        for row_id, samples in chains.items()
    }
    sglang_path = family.agent_loop(folder)
    tools_of = {r["id"]: r["tools"] for r in rows}
    parses = Parses(sglang_path, [(o, tools_of[i]) for i, turns in split.items() for _, o in turns])
    recounted: Counter[str] = Counter()
    for row in rows:
        stored = split[row["id"]]
        assert sorted(s["turn"] for s in chains[row["id"]]) == list(range(len(stored)))
        outputs = {tuple(prompt): output for prompt, output in stored}
        chain = sglang_chain(sglang_path, family, row, outputs.get, parses)
        # every prompt SGLang's render of the history so far, and the chain ended at its
        # first mismatch: the stored turns are the chain's, no more, no fewer
        assert chain.turns == stored, row["id"]
        assert chain.ending is not None, row["id"]
        recounted[chain.ending] += 1
    assert endings == dict(sorted(recounted.items()))
    assert sum(len(turns) - 1 for turns in split.values()) > 0  # chained prompts were checked
    if max_new_tokens < 96:
        # turns cut at max_new_tokens end their chains, counted as such, nothing failed, and
        # no command offered to re-queue them
        assert recounted[constants.CHAIN_END_TRUNCATED] > 0, recounted
        text = tokenmill(["status", "agents"], env).stdout
        ended = ", ".join(f"{n} {reason}" for reason, n in endings.items())
        assert f"run agents: agentic chains ended: {ended}" in text, text
        assert "retry" not in text + verified.stdout, text + verified.stdout
        return
    # the emulator's draws reach every ending of a chain but parallel calls in the dataset and
    # truncation (its answers all fit max_new_tokens)
    reached = set(constants.CHAIN_ENDINGS) - {constants.CHAIN_END_TRUNCATED}
    assert set(recounted) == reached, recounted

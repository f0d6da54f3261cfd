"""Sampling per row and per sample, end to end: `tokenmill run --samples-per-prompt 3
--temperature 0.6,0.8,1.0 --reasoning-effort none,low,high` with rows of their own
sampling_params. Every exported sample (specforge, conversations, Parquet) carries the
sampling_params the emulator's prompt log says it received, and the weight version; each
sample's prompt is the template's text for its effort, encoded by the tokenizer itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from ops.emulator_proc import start_emulator
from tests.support.chat_templates import AGENT_TEMPLATE, tokenizer_with_template
from tests.support.procs import clean_env, tokenmill

pytestmark = pytest.mark.e2e

TEMPERATURES = [0.6, 0.8, 1.0]
EFFORTS = ["none", "low", "high"]
ROW_SAMPLING = {"max_new_tokens": 24, "top_k": 20, "sampling_seed": 100}


def rows() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(6)]
    out[1]["sampling_params"] = ROW_SAMPLING
    out[4]["sampling_params"] = {"temperature": 0.3}
    # refused as SGLang refuses them, each naming its line; the rest goes on
    out.append({"id": "bad-key", "prompt": "x", "sampling_params": {"temprature": 0.5}})
    out.append({"id": "bad-range", "prompt": "x", "sampling_params": {"top_p": 0}})
    return out


def expected_prompt(tokenizer: Any, question: str, effort: str) -> list[int]:
    """AGENT_TEMPLATE's text for one user turn and an effort, as the tokenizer encodes it."""
    think = "<think></think>" if effort == "none" else "<think>"
    text = (
        f"<|im_user|>user<|im_middle|>{question}<|im_end|>effort={effort}"
        f"<|im_assistant|>assistant<|im_middle|>{think}"
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_cycles_and_row_sampling_reach_the_server_and_every_export(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    folder = tokenizer_with_template(kimi_tokenizer_dir, tmp_path / "tok", AGENT_TEMPLATE)
    env = clean_env(tmp_path / "data")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    log = tmp_path / "requests.jsonl"
    emulator = start_emulator(
        ["--step-ms", "1", "--median-tokens", "12", "--prompt-log", str(log),
         "--weight-version", "step-7"]
    )  # fmt: skip
    try:
        run = tokenmill(
            ["run", str(prompts), "--run", "cyc", "--tokenizer", str(folder),
             "--server", emulator.url, "--max-new-tokens", "32", "--seed", "11",
             "--samples-per-prompt", "3", "--temperature", ",".join(map(str, TEMPERATURES)),
             "--reasoning-effort", ",".join(EFFORTS)],
            env,
            tmp_path,
        )  # fmt: skip
    finally:
        emulator.stop()
    assert run.returncode == 0, run.stderr
    assert "line 7" in run.stderr and "unknown field `temprature`" in run.stderr
    assert "line 8" in run.stderr and "top_p must be in (0, 1], got 0" in run.stderr

    sent: dict[int, dict[str, Any]] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if entry["rid"].startswith("tm-"):
            sent[int(entry["rid"].split("-")[1])] = entry
    assert len(sent) == 18

    outputs = {
        fmt: tmp_path / f"cyc.{fmt}"
        for fmt in ("specforge", "conversations", "parquet")
    }  # fmt: skip
    for fmt, out in outputs.items():
        result = tokenmill(["export", "cyc", "--format", fmt, "--out", str(out)], env, tmp_path)
        assert result.returncode == 0, result.stderr
    table = pq.read_table(outputs["parquet"]).to_pylist()
    assert len(table) == 18
    by_sample = {(r["id"], r["sample"]): r for r in table}
    hf = AutoTokenizer.from_pretrained(str(folder))
    for row in table:
        k, request = row["sample"], sent[row["item_id"]]
        params = json.loads(row["sampling_params"])
        assert params == request["sampling_params"], row["id"]
        assert row["weight_version"] == "step-7" == request["weight_version"]
        assert row["prompt_ids"] == request["input_ids"]
        # the k-th temperature and effort; the row's own values over the run's
        own = next(r.get("sampling_params") for r in rows() if r["id"] == row["id"])
        assert params["temperature"] == (own or {}).get("temperature", TEMPERATURES[k % 3])
        seed = (own or {}).get("sampling_seed", 11)
        assert params["sampling_seed"] == seed + k
        for key, value in (own or {}).items():
            if key != "sampling_seed":
                assert params[key] == value
        question = f"question {row['id'][1:]}"
        assert row["prompt_ids"] == expected_prompt(hf, question, EFFORTS[k % 3])
    # prompts of one row differ by effort, as the template makes them
    assert len({tuple(by_sample[("q0", k)]["prompt_ids"]) for k in range(3)}) == 3
    for fmt in ("specforge", "conversations"):
        lines = [json.loads(x) for x in outputs[fmt].read_text().splitlines()]
        assert len(lines) == 18
        for line in lines:
            parquet_row = by_sample[(line["id"], line["sample"])]
            assert line["sampling_params"] == json.loads(parquet_row["sampling_params"])
            assert line["weight_version"] == "step-7"
    manifest = json.loads((outputs["parquet"] / ".manifest.json").read_text())
    assert manifest["provenance"]["per_weight_version"] == {"step-7": 18}
    assert sum(s["samples"] for s in manifest["provenance"]["per_sampling"]) == 18
    verify = tokenmill(["verify", "cyc", "--json"], env, tmp_path)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    checks = {c["check"]: c for c in json.loads(verify.stdout)["checks"]}
    assert (
        checks["sampling_params"]["checked"] == 18 and checks["sampling_params"]["mismatches"] == 0
    )
    assert checks["weight_version"]["checked"] == 18
    assert checks["template"]["mismatches"] == 0
    # a later enqueue with other cycles is refused
    again = tokenmill(
        ["enqueue", str(prompts), "--run", "cyc", "--tokenizer", str(folder),
         "--max-new-tokens", "32", "--seed", "11", "--samples-per-prompt", "3",
         "--temperature", "0.6,0.8", "--reasoning-effort", ",".join(EFFORTS)],
        env,
        tmp_path,
    )  # fmt: skip
    assert again.returncode != 0 and "temperature_cycle" in again.stderr

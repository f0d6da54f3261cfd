"""Evaluating a draft through the real CLI: two emulated EAGLE-3 drafts serve the same 400-prompt
eval set in two runs on Postgres; `tokenmill accept` names the better draft overall and per
category, its intervals hold the emulator's true means, and its --json numbers are those the
emulator's request log gives. Then a held-out, filtered export of a run."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ops.emulator_proc import start_emulator
from tests.support.procs import clean_env, tokenmill

pytestmark = pytest.mark.e2e

CATEGORIES = ("code", "math", "chat", "translation")
# words each category's prompts are made of: fewer distinct words, more repeated trigrams
VOCABULARY = {"code": 3, "math": 8, "chat": 0, "translation": 30}
DRAFTS = {"a": ("/drafts/eagle3-a", 0.55), "b": ("/drafts/eagle3-b", 0.7)}


def prompt_text(rng: random.Random, category: str) -> str:
    size = VOCABULARY[category]
    if size == 0:  # every word new
        return " ".join(f"w{rng.randrange(10**7)}" for _ in range(30))
    words = [f"t{rng.randrange(10**5)}" for _ in range(size)]
    return " ".join(rng.choice(words) for _ in range(30))


def write_eval_set(path: Path, rows: int = 400) -> list[dict[str, Any]]:
    rng = random.Random(23)
    lines = [
        {
            "id": f"e{i}",
            "prompt": prompt_text(rng, CATEGORIES[i % 4]),
            "category": CATEGORIES[i % 4],
            "source": "bench",
        }
        for i in range(rows)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return lines


def emulator_flags(draft: str, accept: float, log: Path) -> list[str]:
    return [
        "--step-ms",
        "1",
        "--median-tokens",
        "150",
        "--sigma",
        "0.4",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        draft,
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
        "--spec-accept",
        str(accept),
        "--request-log",
        str(log),
    ]


def run_draft(
    name: str, prompts: Path, tokenizer: Path, log: Path, env: dict[str, str], cwd: Path
) -> None:
    draft, accept = DRAFTS[name]
    emulator = start_emulator(emulator_flags(draft, accept, log))
    try:
        done = tokenmill(
            [
                "run",
                str(prompts),
                "--run",
                name,
                "--tokenizer",
                str(tokenizer),
                "--server",
                emulator.url,
                "--max-new-tokens",
                "600",
                "--temperature",
                "0",
            ],
            env,
            cwd,
        )
    finally:
        emulator.stop()
    assert done.returncode == 0, done.stderr


def logged(pg_url: str, run: str, log: Path) -> dict[str, list[dict[str, Any]]]:
    """The emulator's log lines of a run's stored results, by category (rid tm-<item id>-...)."""
    by_rid = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        by_rid[int(record["rid"].split("-")[1])] = record  # a retried item: its last answer
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT items.id, items.row_metadata FROM items JOIN runs ON runs.id = "
                "items.run_id WHERE runs.name = :name AND items.status = 'done'"
            ),
            {"name": run},
        ).all()
    engine.dispose()
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for item_id, metadata in rows:
        meta = metadata if isinstance(metadata, dict) else json.loads(metadata)
        out[meta["category"]].append(by_rid[item_id])
        out["all"].append(by_rid[item_id])
    return out


def from_log(records: list[dict[str, Any]]) -> dict[str, Any]:
    """SGLang's definitions over the logged answers: the reference for `accept --json`."""
    histogram: list[int] = []
    for r in records:
        for index, steps in enumerate(r["spec_correct_drafts_histogram"]):
            histogram.extend([0] * (index + 1 - len(histogram)))
            histogram[index] += steps
    tokens = sum(r["completion_tokens"] for r in records)
    steps = sum(r["spec_verify_ct"] for r in records)
    return {
        "requests": len(records),
        "tokens": tokens,
        "verify_steps": steps,
        "accept_length": tokens / steps,
        "mean_accept_length": sum(r["spec_accept_length"] for r in records) / len(records),
        "accept_rate": sum(r["spec_num_correct_drafts"] for r in records)
        / sum(r["spec_num_proposed_drafts"] for r in records),
        "histogram": histogram,
    }


def true_mean(records: list[dict[str, Any]]) -> float:
    """The emulator's expected tokens per verify step, averaged over the requests."""
    return sum(r["expected_step_tokens"] for r in records) / len(records)


def accept_json(args: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    result = tokenmill(["accept", *args, "--json"], env, cwd)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_two_drafts_on_one_eval_set(tmp_path: Path, pg_url: str, kimi_tokenizer_dir: Path) -> None:
    env = clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=pg_url)
    prompts = tmp_path / "eval.jsonl"
    write_eval_set(prompts)
    logs = {name: tmp_path / f"requests-{name}.jsonl" for name in DRAFTS}
    for name in DRAFTS:
        run_draft(name, prompts, kimi_tokenizer_dir, logs[name], env, tmp_path)
    records = {name: logged(pg_url, name, logs[name]) for name in DRAFTS}

    for name, (draft, _) in DRAFTS.items():
        report = accept_json([name, "--by", "category"], env, tmp_path)
        assert report["speculative"] == {
            "algorithm": "EAGLE3",
            "draft_model_path": draft,
            "num_draft_tokens": 4,
            "num_steps": 3,
            "eagle_topk": 1,
        }
        assert report["done"] == 400 and report["without_stats"] == 0
        groups = {"all": report["overall"]} | {g["value"]: g for g in report["by"]["category"]}
        assert set(groups) == {"all", *CATEGORIES}
        for value, group in groups.items():
            expected = from_log(records[name][value])
            assert group["histogram"] == expected.pop("histogram"), (name, value)
            got = {k: group[k] for k in expected}
            assert got == pytest.approx(expected, rel=1e-12), (name, value)
            low, high = group["mean_accept_length_ci"]
            assert low <= true_mean(records[name][value]) <= high, (name, value, low, high)
    # the categories differ (repeated text is easier to draft)
    lengths = [from_log(records["b"][c])["accept_length"] for c in CATEGORIES]
    assert max(lengths) - min(lengths) > 0.3

    paired = accept_json(["a", "b", "--by", "category"], env, tmp_path)
    assert paired["outputs"] == {
        "compared": 400,
        "differing": 0,
        "greedy": True,
        "red_flag": False,
        "examples": [],
    }
    truth = {
        value: true_mean(records["b"][value]) - true_mean(records["a"][value])
        for value in ("all", *CATEGORIES)
    }
    assert paired["better"] == ("b" if truth["all"] > 0 else "a")
    groups = {"all": paired["overall"]} | {g["value"]: g for g in paired["by"]["category"]}
    for value, group in groups.items():
        assert group["pairs"] == len(records["a"][value])
        low, high = group["mean_difference_ci"]
        assert low <= truth[value] <= high, (value, low, high, truth[value])
        assert group["verdict"] == ("better" if truth[value] > 0 else "worse"), value
    assert paired["worse"] == [
        {"field": "category", "value": v} for v in sorted(CATEGORIES) if truth[v] < 0
    ]
    table = tokenmill(["accept", "a", "b"], env, tmp_path)
    assert table.returncode == 0, table.stderr
    assert f"better draft overall: {paired['better']}" in table.stdout


def test_export_holds_out_and_excludes(tmp_path: Path, kimi_tokenizer_dir: Path) -> None:
    env = clean_env(tmp_path / "data")
    prompts = tmp_path / "prompts.jsonl"
    rows = write_eval_set(prompts, rows=600)
    known = random.Random(5).sample(rows, 50)
    exclude = tmp_path / "known.jsonl"  # the prompts only: no ids, other fields
    exclude.write_text("".join(json.dumps({"prompt": r["prompt"], "x": 1}) + "\n" for r in known))
    emulator = start_emulator(["--step-ms", "1", "--median-tokens", "20"])
    try:
        done = tokenmill(
            [
                "run",
                str(prompts),
                "--run",
                "t",
                "--tokenizer",
                str(kimi_tokenizer_dir),
                "--server",
                emulator.url,
                "--max-new-tokens",
                "64",
                "--samples-per-prompt",
                "2",
                "--seed",
                "1",
            ],
            env,
            tmp_path,
        )
    finally:
        emulator.stop()
    assert done.returncode == 0, done.stderr
    out = tmp_path / "t.jsonl"
    args = ["export", "t", "--out", str(out), "--split", "eval=0.02", "--seed", "7"]
    export = tokenmill([*args, "--exclude", str(exclude)], env, tmp_path)
    assert export.returncode == 0, export.stderr

    # the documented rule, computed here: sha256("seed:key"), first 8 bytes over 2^64
    def held_out(key: str) -> bool:
        digest = hashlib.sha256(f"7:{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < 0.02

    eval_keys = {r["id"] for r in rows if held_out(r["id"])}
    known_keys = {r["id"] for r in known} - eval_keys
    train = [json.loads(line) for line in out.read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "t.eval.jsonl").read_text().splitlines()]
    assert eval_keys and {r["id"] for r in held} == eval_keys
    assert len(held) == 2 * len(eval_keys)  # both samples of a row on one side
    train_keys = {r["id"] for r in train}
    assert not train_keys & (eval_keys | known_keys)
    assert train_keys == {r["id"] for r in rows} - eval_keys - known_keys
    assert len(train) == 2 * len(train_keys)

    manifest = json.loads((tmp_path / "t.jsonl.manifest.json").read_text())
    assert manifest["split"]["eval"] == 0.02 and manifest["split"]["seed"] == 7
    assert manifest["samples"] == {
        "train": len(train),
        "eval": len(held),
        "excluded": 2 * len(known_keys),
    }
    assert manifest["rows"] == {
        "train": len(train_keys),
        "eval": len(eval_keys),
        "excluded": len(known_keys),
    }
    assert manifest["exclude"]["prompts"] == 50
    assert manifest["exclude"]["dropped_rows"] == len(known_keys)
    printed = " ".join(export.stderr.split())
    assert f"held out {len(held)} samples of {len(eval_keys)} rows for eval" in printed
    assert re.search(
        rf"dropped {2 * len(known_keys)} training samples of {len(known_keys)} rows whose "
        r"prompt is one of the 50 prompts of",
        printed,
    )

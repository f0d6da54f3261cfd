"""`tokenmill run --turns each` through the real CLI on two emulators with prefix caches: every
conversation's items run on one server, shortest history first, each finding the history
before it cached."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, select

from app.ledger import common
from ops.emulator_proc import start_emulator
from tests.support.procs import clean_env, tokenmill

pytestmark = pytest.mark.e2e

WORDS = ("tide", "moon", "water", "shore", "wave", "boat", "harbor", "chart", "wind", "sail")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(rng: random.Random, index: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": text(rng, 60)}]
    for turn in range(rng.randint(3, 5)):
        messages.append({"role": "user", "content": text(rng, 20)})
        if turn % 2:
            call: dict[str, Any] = {"id": f"c{index}{turn}", "type": "function"}
            call["function"] = {"name": "look", "arguments": json.dumps({"q": text(rng, 2)})}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": text(rng, 9)})
        messages.append({"role": "assistant", "content": text(rng, 25)})
    return {"id": f"conv{index}", "messages": messages}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_a_conversation_runs_on_one_server_shortest_first_and_finds_its_history_cached(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    rng = random.Random(5)
    lines = [conversation(rng, i) for i in range(8)]
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = clean_env(tmp_path / "data", TOKENMILL_INFLIGHT="4")
    flags = ["--step-ms", "2", "--median-tokens", "12", "--prefix-cache-tokens", "200000"]
    emulators = [start_emulator(flags), start_emulator(flags)]
    try:
        command = ["run", str(prompts), "--run", "each", "--tokenizer", str(kimi_tokenizer_dir)]
        command += ["--turns", "each", "--max-new-tokens", "32", "--seed", "1"]
        for emu in emulators:
            command += ["--server", emu.url]
        run = tokenmill(command, env, tmp_path)
    finally:
        for emu in emulators:
            emu.stop()
    assert run.returncode == 0, run.stderr

    db = create_engine(f"sqlite:///{tmp_path / 'data' / 'ledger.sqlite3'}")
    t = common.items
    with db.connect() as conn:
        rows = conn.execute(
            select(
                t.c.item_key,
                t.c.turn_index,
                t.c.status,
                t.c.server,
                t.c.prompt_ids,
                t.c.cached_tokens,
                t.c.finished_at,
            )
        ).all()
    db.dispose()
    assert rows and all(r.status == "done" for r in rows)
    by_key: dict[str, list[Any]] = {}
    for row in rows:
        by_key.setdefault(row.item_key, []).append(row)
    assert len(by_key) == 8
    servers = set()
    for key, items in by_key.items():
        assert len({r.server for r in items}) == 1, f"{key} ran on several servers"
        servers.add(items[0].server)
        finished = sorted(items, key=lambda r: r.finished_at)
        # finished shortest history first (turn order: each history extends the one before)
        assert [r.turn_index for r in finished] == sorted(r.turn_index for r in items)
        for before, after in itertools.pairwise(finished):
            shared = common_prefix(list(before.prompt_ids), list(after.prompt_ids))
            assert shared > 0
            # the earlier prompt was prefilled and cached before this one was sent
            assert after.cached_tokens >= min(shared, len(after.prompt_ids) - 1), key
    assert len(servers) == 2  # both servers took conversations

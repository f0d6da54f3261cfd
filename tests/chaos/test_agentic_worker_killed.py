"""Chaos: agentic chains (`enqueue --turns all`, the dataset's tool results cached) served through
Celery by two emulators writing tool calls, one worker per emulator, and one worker SIGKILLed
while it holds a chain's later turn, then started again. Each family is a case: the Kimi-K2.5
fixture (`--tool-calls kimi`) and a Hermes/Qwen2.5-style template (`--tool-calls hermes`,
`--tool-call-parser hermes`).

Every chain is rebuilt from the emulators' request logs alone (`--request-log`: the input_ids
each /generate request brought and the output_ids it generated), as an agent loop against
SGLang 0.5.23 runs it: the wheel's parser on each logged output (all of them in one run of the
wheel), the chat path's render of the history as the next prompt, looked up in the logs, and
docs/inputs.md's rules deciding where the chain ends. That chain must be the ledger's, turn for
turn (so every chained prompt is SGLang's render), and the endings counted from it must be what
`status --json` and the Parquet manifest count.

"Nothing is regenerated twice" is checked as:
- the ledger holds one row per (row, turn) of each chain and none past its end, every one done
  with attempts == 1 (the killed requests spent none);
- a request's rid names its item (`tm-ID-...`, hedged copies `tm-ID-hedge-...`): each item has
  one finished non-hedge generation in the logs, two at most for an item the dead worker held
  leased when it died (its answer may have come back after the kill, unrecorded), and no
  non-hedge request for an item arrived after the ledger recorded its result;
- every logged request of an item carried that item's stored prompt ids, and every logged
  prompt belongs to a chain (no turn past a chain's end, none from a wrong history).
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from app.ledger import reads, run_queries, turns
from tests.chaos.conftest import RUN, Deployment
from tests.support.agentic_chains import FAMILIES, Family, Parses, agentic_row, sglang_chain
from tests.support.procs import tokenmill

pytestmark = pytest.mark.chaos

ROWS = 200
# short answers at 1 ms a step: the run lasts long enough for a kill to land mid-chain
EMULATOR_FLAGS = {"--step-ms": "1", "--median-tokens": "6", "--sigma": "0"}
# the dead worker's leases expire (5 s) and beat's reconcile (every 2 s) queues them again; the
# rest of the run takes seconds idle, several times that on a loaded CI machine
FINISH_WITHIN_S = 120


def leased_later_turns(dep: Deployment, pid: int) -> int:
    """Turns after a chain's first that a worker process holds leased."""
    with dep.db.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM items WHERE status = 'leased' AND turn_index > 0 "
                    "AND lease_owner LIKE :pat"
                ),
                {"pat": f"%:{pid}:%"},
            ).scalar_one()
        )


def unended_chains(dep: Deployment) -> list[tuple[int, int]]:
    """The run's done last turns with no chain ending recorded yet."""
    with dep.db.connect() as conn:
        return turns.unended_last_turns(conn, run_id=run_queries.get_run(conn, RUN).id)


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("family", [FAMILIES["kimi"], FAMILIES["hermes"]], ids=["kimi", "hermes"])
def test_agentic_chains_survive_a_killed_worker_as_the_servers_logs_say(
    deployment: Deployment, tmp_path: Path, family: Family
) -> None:
    dep = deployment
    folder = family.tokenizer(tmp_path)
    rows = [agentic_row(n) for n in range(ROWS)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    args = ["enqueue", str(path), "--run", RUN, "--tokenizer", str(folder), "--turns", "all"]
    enqueued = tokenmill(
        [*args, *family.run_flags, "--max-new-tokens", "96", "--seed", "1"], dep.env
    )
    assert enqueued.returncode == 0, enqueued.stderr

    logs = {name: tmp_path / f"requests-{name}.jsonl" for name in ("gpu-a", "gpu-b")}
    served = EMULATOR_FLAGS | {"--tokenizer": str(folder)}
    served |= dict(zip(family.emulator_flags[::2], family.emulator_flags[1::2], strict=True))
    a = dep.emulator(served | {"--request-log": str(logs["gpu-a"])})
    b = dep.emulator(served | {"--request-log": str(logs["gpu-b"])})
    victim = dep.worker("wa", "gpu-a", a.url)
    dep.worker("wb", "gpu-b", b.url)
    dep.beat()

    def mid_chain(pid: int = victim.pid) -> bool:
        return leased_later_turns(dep, pid) > 0

    dep.wait("the victim holding a chain's later turn", mid_chain, 60)
    victim.kill()
    victim.wait()
    killed_at = time.monotonic()
    held = dep.leased_by_pid(victim.pid)  # what it held when it died, exactly
    victim = dep.worker("wa", "gpu-a", a.url)  # restarted at once, as systemd would
    dep.wait_finished(FINISH_WITHIN_S)
    recover_s = time.monotonic() - killed_at
    # a chain whose ending its worker did not record (it died right after committing the last
    # turn) gets it from the next reconcile's catch-up, once nothing is left to run
    unended = len(unended_chains(dep))
    dep.wait("every chain's ending recorded", lambda: not unended_chains(dep), 30)
    assert victim.poll() is None, "the restarted worker died:\n" + dep.log_tail("wa")

    status = tokenmill(["status", RUN, "--json"], dep.env)
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    exported = tokenmill(
        ["export", RUN, "--format", "parquet", "--out", str(tmp_path / "shards")], dep.env
    )
    assert exported.returncode == 0, exported.stderr
    manifest = json.loads((tmp_path / "shards" / ".manifest.json").read_text())

    with dep.db.connect() as conn:
        run = run_queries.get_run(conn, RUN)
        statuses = ("waiting", "pending", "queued", "leased", "done", "failed")
        stored = list(reads.iter_items(conn, run.id, statuses=statuses))
        finished_at = {
            int(i): t.timestamp()
            for i, t in conn.execute(
                text("SELECT id, finished_at FROM items WHERE run_id = :r"), {"r": run.id}
            )
        }
    ledger: dict[str, list[reads.StoredItem]] = defaultdict(list)
    for item in sorted(stored, key=lambda i: i.turn_index):
        ledger[item.item_key].append(item)
    assert {i.status for i in stored} == {"done"}
    assert {i.attempts for i in stored} == {1}, "a killed request spent an attempt"

    # the chains as the servers' logs tell them, SGLang's parser and chat path deciding
    requests = [r for log in logs.values() for r in read_log(log)]
    by_prompt: dict[tuple[int, ...], list[list[int]]] = defaultdict(list)
    for record in requests:
        by_prompt[tuple(record["input_ids"])].append(record["output_ids"])
    for outputs in by_prompt.values():
        assert all(o == outputs[0] for o in outputs), "one prompt, two different outputs"
    tool_sets = list({json.dumps(r["tools"]): r["tools"] for r in rows}.values())
    loop = family.agent_loop(folder)
    parses = Parses(loop, [(outs[0], tools) for outs in by_prompt.values() for tools in tool_sets])
    recounted: Counter[str] = Counter()
    walked: set[tuple[int, ...]] = set()
    for row in rows:
        chain = sglang_chain(
            loop, family, row, lambda p: by_prompt[p][0] if p in by_prompt else None, parses
        )
        assert chain.ending is not None, f"{row['id']}: the logs hold no output for a turn"
        kept = ledger[row["id"]]
        assert [(i.prompt_ids, i.output_ids) for i in kept] == chain.turns, row["id"]
        assert [i.chain_end for i in kept] == [None] * (len(kept) - 1) + [chain.ending]
        recounted[chain.ending] += 1
        walked |= {tuple(prompt) for prompt, _ in chain.turns}
    assert set(by_prompt) == walked, "the servers generated a prompt no chain has"
    counted = dict(sorted(recounted.items()))
    assert shown["chain_endings"] == counted
    assert manifest["counts"]["chain_endings"] == counted
    assert len(recounted) > 3, recounted  # the emulator's draws reach most endings

    # one generation per turn, a second only for what the dead worker held
    prompt_of = {i.id: i.prompt_ids for i in stored}
    generations: Counter[int] = Counter()
    hedged: set[int] = set()
    for record in requests:
        item_id = int(record["rid"].split("-")[1])
        assert record["input_ids"] == prompt_of[item_id], record["rid"]
        if "-hedge-" in record["rid"]:
            hedged.add(item_id)
            continue
        generations[item_id] += 1
        assert record["received_at"] < finished_at[item_id], f"{record['rid']}: after its result"
    # a hedged copy that answered first leaves its item no other finished generation
    assert set(generations) | hedged == set(prompt_of), "a turn done that no server generated"
    again = {i for i, n in generations.items() if n > 1}
    assert again <= held and max(generations.values()) <= 2, (again, held)
    print(
        f"\nCHAOS agentic_worker_killed[{family.name}]: rows={ROWS} turns={len(stored)} "
        f"endings={counted} held_at_kill={len(held)} generated_again={len(again)} "
        f"hedged_items={len(hedged)} endings_caught_up={unended} recover_s={recover_s:.1f}"
    )

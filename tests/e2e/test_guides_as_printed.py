"""The guides' commands as printed, on two emulated GPU nodes that speculate with a draft and
serve weights step-100: README's "One machine" (`tokenmill run` through both servers),
docs/commands.md's sampling cycles, docs/drafts.md's evaluation of two drafts from the held-out
export to `accept` and `report`, docs/weights.md's update of one server to step-200, and the
runbook's export of one weight version, restart with `--command` and JSON-logging workers.

Only hosts, ports and paths are substituted (tests/support/readme_fleet.py). Between the two
evaluation runs the drafts switch as an operator would switch them: gpu-a's unit gets the other
draft and the runbook's restart with `--command` runs it, gpu-b (still on the new draft) is
paused, and `eval-old` is enqueued as the guide says, "the same way" as `eval-new`.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.ledger import reads, run_queries
from tests.support.procs import ROOT, stop, wait_for
from tests.support.readme_fleet import (
    GUIDES_TEST,
    NOT_RUN,
    RUN_APART,
    RUN_AS_PRINTED,
    Command,
    Fleet,
    commands,
    section_blocks,
)
from tests.support.rows import write_rows

pytestmark = pytest.mark.e2e

NODES = ("gpu-a", "gpu-b")
PROMPTS = 30
EVAL_ROWS = 40
SHARED = 6  # eval prompts that are also training prompts: `--exclude eval.jsonl` drops them
CATEGORIES = ("code", "chat")
DRAFTS = {"new": ("/drafts/new", "0.85"), "old": ("/drafts/old", "0.4")}


def flags(draft: str) -> list[str]:
    """A node's emulator serving draft. Its weight load takes 4 s, as a real one takes longer
    than a worker's pause check (TOKENMILL_PAUSE_CHECK_S, 2 s): the workers see update-weights'
    pause, and check the runs they refused again when it is lifted."""
    path, accept = DRAFTS[draft]
    return [
        *("--step-ms", "1", "--median-tokens", "24", "--sigma", "0.4"),
        *("--weight-version", "step-100", "--weight-load-s", "4"),
        *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", path),
        *("--speculative-num-steps", "3", "--speculative-eagle-topk", "1"),
        *("--speculative-num-draft-tokens", "4", "--spec-accept", accept),
    ]


def printed(doc: str, heading: str | None = None) -> list[Command]:
    """A section's commands this test runs: all of a section of GUIDES_TEST's (NOT_RUN's left
    out), only RUN_APART's of another's."""
    mine = RUN_AS_PRINTED.get((doc, heading)) == GUIDES_TEST
    out = []
    for block in section_blocks((ROOT / doc).read_text(), heading):
        for c in commands(block):
            apart = RUN_APART.get((doc, c.text), "").startswith(GUIDES_TEST)
            if apart or (mine and (doc, c.text) not in NOT_RUN):
                out.append(c)
    return out


def prompt(i: int) -> str:
    return f"Question {i}: name a prime above {i}."


def eval_prompt(i: int) -> str:
    if i < SHARED:
        return prompt(i)
    if CATEGORIES[i % 2] == "code":  # repeated text: easier to draft
        return " ".join(["def f(x): return x + 1"] * 4) + f" # {i}"
    return f"Tell me about day {i} of the trip to city {i * 7}."


@pytest.fixture
def fleet(
    tmp_path: Path, pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path
) -> Iterator[Fleet]:
    training = [{"id": f"q{i}", "prompt": prompt(i)} for i in range(PROMPTS)]
    evaluation = [
        {"id": f"e{i}", "prompt": eval_prompt(i), "category": CATEGORIES[i % 2], "source": "bench"}
        for i in range(EVAL_ROWS)
    ]
    checkpoint = tmp_path / "ckpt" / "step-200"
    checkpoint.mkdir(parents=True)
    paths = {
        "prompts.jsonl": str(write_rows(tmp_path / "prompts.jsonl", training)),
        "eval.jsonl": str(write_rows(tmp_path / "eval.jsonl", evaluation)),
        "/models/Kimi-K2.5": str(kimi_tokenizer_dir),
        "/ckpt/step-200": str(checkpoint),
    }
    fleet = Fleet.on_test_services(
        tmp_path, pg_engine, pg_url, redis_url, NODES, paths, flags("new")
    )
    # the runbook's shell: every command on the test's ledger and broker
    fleet.exports["TOKENMILL_DATABASE_URL"] = fleet.database_url
    fleet.exports["TOKENMILL_BROKER_URL"] = fleet.broker_url
    with fleet.serving():
        yield fleet


def run_all(fleet: Fleet, printed: list[Command]) -> list[subprocess.CompletedProcess[str]]:
    """Each command run on its node(s), exit 0 (a long-running one: started, and up)."""
    out = []
    for command in printed:
        for done in fleet.run(command):
            print(f"$ {command.text}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
            out.append(done)
    return out


def said(done: subprocess.CompletedProcess[str]) -> str:
    """What a command printed, stdout and stderr, its lines unwrapped."""
    return " ".join((done.stdout + done.stderr).split())


def items(db: Engine, run: str) -> list[reads.StoredItem]:
    with db.connect() as conn:
        return list(reads.iter_items(conn, run_queries.get_run(conn, run).id))


def wait_finished(fleet: Fleet, run: str) -> list[reads.StoredItem]:
    """The run's items once it is finished, each done."""

    def finished() -> bool:
        with fleet.db.connect() as conn:
            counts = reads.run_counts(conn, run_queries.get_run(conn, run))
        return bool(counts.total and counts.finished)

    wait_for(f"run {run} to finish", finished, 300, fleet.log_tail)
    stored = items(fleet.db, run)
    assert {s.status for s in stored} == {"done"}, run
    return stored


def test_the_guides_as_printed(fleet: Fleet, pg_engine: Engine) -> None:
    a, b = (f"{node}:{port}" for node, port in fleet.nodes.items())  # the servers' names
    home = fleet.home(None)
    # README's "One machine": r1 through both servers, then its status and exports
    run, status, *_ = run_all(fleet, printed("README.md", "One machine"))
    assert "run r1 finished in" in said(run) and f"{PROMPTS} done" in said(run), said(run)
    assert json.loads(status.stdout)["done"] == PROMPTS, status.stdout
    assert {s.weight_version for s in wait_finished(fleet, "r1")} == {"step-100"}
    assert len((home / "r1.jsonl").read_text().splitlines()) == PROMPTS
    assert len((home / "r1.conversations.jsonl").read_text().splitlines()) == PROMPTS

    # docs/commands.md: three samples a prompt, sample k with the k-th temperature
    run_all(fleet, printed("docs/commands.md"))
    mixed = wait_finished(fleet, "mixed")
    assert len(mixed) == 3 * PROMPTS
    for s in mixed:
        assert s.sampling_params is not None
        assert s.sampling_params["temperature"] == [0.6, 0.8, 1.0][s.sample_index], s

    # the runbook's export of one weight version
    run_all(fleet, printed("ops/README.md", "Export"))
    manifest = json.loads((home / "r1-step-100" / ".manifest.json").read_text())
    assert manifest["provenance"]["per_weight_version"] == {"step-100": PROMPTS}, manifest

    split, enqueue, worker, status_new, *measure = printed("docs/drafts.md")
    assert worker.long_running and worker.node == "each"
    # 1. the training run's export, held out and without the eval set's prompts
    run_all(fleet, [split])
    manifest = json.loads((home / "r1.jsonl.manifest.json").read_text())
    rows = manifest["rows"]
    assert manifest["exclude"]["prompts"] == EVAL_ROWS
    assert rows["train"] + rows["eval"] + rows["excluded"] == PROMPTS
    assert 0 < rows["excluded"] <= SHARED, manifest
    # 4. eval-new on the new draft, through a worker on each node
    run_all(fleet, [enqueue, worker])
    wait_finished(fleet, "eval-new")
    (shown,) = run_all(fleet, [status_new])
    assert re.search(rf"eval-new {EVAL_ROWS} 0 0 0 {EVAL_ROWS} 0", said(shown)), said(shown)
    # then the other draft, on gpu-a: its unit's flags changed and the runbook's restart with
    # --command (its worker registered it: no restart command); gpu-b, on the new draft,
    # paused meanwhile; the workers now the runbook's, logging JSON
    for key in [k for k in fleet.procs if "celery -A app worker" in k]:
        stop([fleet.procs.pop(key)])
    pause = ["tokenmill", "pause", "--server", b, "--reason", "serves the new draft"]
    run_all(fleet, [Command(" ".join(pause), {}, pause, None)])
    run_all(fleet, printed("ops/README.md", "Logs"))
    fleet.emulator_flags = flags("old")
    fleet.write_units("gpu-a")
    (restart,) = printed("ops/README.md", "A server needs a restart")
    (restarted,) = run_all(fleet, [restart])
    assert f"{a} restarted and resumed" in said(restarted), said(restarted)
    run_all(fleet, commands(enqueue.text.replace("eval-new", "eval-old")))  # "the same way"
    assert {s.server for s in wait_finished(fleet, "eval-old")} == {a}
    # 5. measure
    alone, by_category, paired, report, compared = run_all(fleet, measure)
    assert "'draft_model_path': '/drafts/new'" in said(alone), said(alone)
    assert f"{EVAL_ROWS} done requests" in said(alone), said(alone)
    groups = json.loads(by_category.stdout)["by"]["category"]
    assert sorted(g["value"] for g in groups) == sorted(CATEGORIES)
    assert "'draft_model_path': '/drafts/old'" in said(paired), said(paired)
    assert f"outputs: all {EVAL_ROWS} pairs identical" in said(paired), said(paired)
    assert "better draft overall: eval-new" in said(paired), said(paired)
    assert (home / "eval-new.report" / "index.html").is_file(), said(report)
    assert (home / "old-vs-new" / "index.html").is_file(), said(compared)

    # docs/weights.md (the runbook prints the same update): gpu-a takes step-200 for the run
    # pinned to it
    rl, update = printed("docs/weights.md")
    assert printed("ops/README.md", "Load new weights") == [update]
    _, updated = run_all(fleet, [rl, update])
    taken = f"{a} serves weight_version step-200; runs that take it: rl-step-200"
    assert taken in said(updated), said(updated)
    stored = wait_finished(fleet, "rl-step-200")
    assert {(s.weight_version, s.server) for s in stored} == {("step-200", a)}
    for key, log in fleet.logs.items():
        if "celery -A app -q" in key:  # JSON lines only (-q: no banner)
            lines = [line for line in log.read_text().splitlines() if line.strip()]
            entries = [json.loads(line) for line in lines]
            assert any(e.get("action") == "worker_started" for e in entries), key

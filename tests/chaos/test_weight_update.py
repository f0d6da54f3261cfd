"""Weights updated in place under a live fleet (SGLang's /update_weights_from_disk: no restart,
a new weight_version): real `celery -A app worker`s and beat on Postgres and a private Redis,
two emulators, 500 items.

No sample of the new weights is written or exported, the updated server is paused with the
change named, the other finishes the run with nothing lost or duplicated, and a run pinned to
the new version (`--weight-version`) is served by the updated server only. The same through
`tokenmill update-weights` with both runs in flight.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from app.ledger import reads, registry, run_queries
from emulator.config import EmulatorConfig
from emulator.model import generate_output
from tests.chaos.conftest import RUN, Deployment
from tests.support.procs import tokenmill

pytestmark = pytest.mark.chaos

ITEMS = 500
OLD, NEW = "step-100", "step-200"
MODEL = "moonshotai/Kimi-K2.5"
PINNED_RUN = "pinned"
PINNED_ITEMS = 40


def start_fleet(
    deployment: Deployment, tokenizer: Path, slow: bool = False
) -> dict[str, EmulatorConfig]:
    flags = {"--weight-version": OLD}
    if slow:  # most answers run to max_new_tokens at 8 ms a token: ~0.8 s each
        flags |= {"--step-ms": "8", "--median-tokens": "200"}
    emulators = [deployment.emulator(flags) for _ in range(2)]
    deployment.enqueue(tokenizer, ITEMS)
    deployment.beat()
    for i, emu in enumerate(emulators):
        deployment.worker(f"w{i}", f"gpu-{i}", emu.url)
    return {f"gpu-{i}": emu.config for i, emu in enumerate(emulators)}


def check_outputs(
    deployment: Deployment, run_name: str, configs: dict[str, EmulatorConfig], version: str
) -> list[reads.StoredItem]:
    """Every item of the run done once, of `version`, with the output those weights give."""
    with deployment.db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        stored = list(reads.iter_items(conn, run.id, statuses=("done", "failed")))
    assert all(s.status == "done" for s in stored), [s.error for s in stored if s.error][:3]
    assert len({(s.item_key, s.sample_index) for s in stored}) == len(stored)
    for s in stored:
        assert s.weight_version == version, (s.item_key, s.server, s.weight_version)
        assert s.server is not None
        weights = replace(configs[s.server], weight_version=version)
        expected, _ = generate_output(
            s.prompt_ids, run.generation.sampling.for_sample(s.sample_index), weights
        )
        assert s.output_ids == expected, s.item_key
    return stored


def export_versions(deployment: Deployment, run_name: str, out: Path) -> set[str]:
    result = tokenmill(["export", run_name, "--out", str(out)], deployment.env)
    assert result.returncode == 0, result.stderr
    return {json.loads(line)["weight_version"] for line in out.read_text().splitlines()}


def test_weights_updated_in_place_mid_run(deployment: Deployment, kimi_tokenizer_dir: Path) -> None:
    configs = start_fleet(deployment, kimi_tokenizer_dir)
    deployment.wait("a fifth of the run done", lambda: deployment.counts().done >= 100, 120)
    updated = httpx.post(
        f"{deployment.emulators[0].url}/update_weights_from_disk",
        json={"model_path": MODEL, "weight_version": NEW},
        timeout=60,
    )
    assert updated.json()["success"], updated.text
    deployment.wait(
        "gpu-0 paused for its new weights",
        lambda: deployment.server("gpu-0").paused_by == "weights",
        60,
    )
    gpu0 = deployment.server("gpu-0")
    assert f"weight_version: {OLD} → {NEW}" in (gpu0.pause_reason or "")
    recover_s = deployment.wait_finished(240)
    stored = deployment.audit({name: replace(c, weight_version=OLD) for name, c in configs.items()})
    assert {s.weight_version for s in stored} == {OLD}
    assert len(stored) == ITEMS and all(s.status == "done" for s in stored)
    # gpu-1 finished what gpu-0 could no longer make with the run's weights
    assert {s.server for s in stored} == {"gpu-0", "gpu-1"}
    with deployment.db.connect() as conn:
        events = registry.list_events(conn, server="gpu-0", limit=500)
    assert any(e.kind == "weights_changed" and NEW in e.message for e in events)
    assert export_versions(deployment, RUN, deployment.tmp / "r1.jsonl") == {OLD}
    deployment.summary("weights updated in place", stored, recover_s)

    # a run pinned to the new weights: only the updated server serves it
    deployment.enqueue(
        kimi_tokenizer_dir, PINNED_ITEMS, run=PINNED_RUN, extra=("--weight-version", NEW)
    )
    deployment.wait("the pinned run finished", lambda: deployment.counts(PINNED_RUN).finished, 180)
    pinned = check_outputs(deployment, PINNED_RUN, configs, NEW)
    assert len(pinned) == PINNED_ITEMS and {s.server for s in pinned} == {"gpu-0"}
    assert export_versions(deployment, PINNED_RUN, deployment.tmp / "r2.jsonl") == {NEW}


def test_update_weights_command_on_a_live_fleet(
    deployment: Deployment, kimi_tokenizer_dir: Path
) -> None:
    # slower steps: the run is still going when the command (a new process that takes
    # seconds to start on a loaded machine) gets to it
    configs = start_fleet(deployment, kimi_tokenizer_dir, slow=True)
    # a run for the new weights waits meanwhile: no server reports them yet
    deployment.enqueue(
        kimi_tokenizer_dir, PINNED_ITEMS, run=PINNED_RUN, extra=("--weight-version", NEW)
    )
    deployment.wait("the run under way", lambda: deployment.counts().done >= 20, 120)
    assert deployment.counts(PINNED_RUN).done == 0
    result = tokenmill(
        ["update-weights", "gpu-0", "--model-path", MODEL, "--weight-version", NEW],
        deployment.env,
    )

    assert result.returncode == 0, result.stderr
    assert not deployment.counts().finished, "the run ended before the update: nothing shown"
    assert f"gpu-0 serves weight_version {NEW}; runs that take it: {PINNED_RUN}" in result.stderr
    assert f"run {RUN}: weight_version: {OLD} → {NEW}" in result.stderr
    assert "resumed" in result.stderr
    recover_s = deployment.wait_finished(240)
    deployment.wait("the pinned run finished", lambda: deployment.counts(PINNED_RUN).finished, 180)
    stored = check_outputs(deployment, RUN, configs, OLD)
    assert len(stored) == ITEMS
    pinned = check_outputs(deployment, PINNED_RUN, configs, NEW)
    assert len(pinned) == PINNED_ITEMS and {s.server for s in pinned} == {"gpu-0"}
    # after the update, the first run's items went to gpu-1 only
    with deployment.db.connect() as conn:
        events = registry.list_events(conn, server="gpu-0", limit=500)
        resumed_at = max(e.at for e in events if e.kind == "resumed")
        late = conn.execute(
            text(
                "SELECT count(*) FROM items JOIN runs ON runs.id = items.run_id "
                "WHERE runs.name = :run AND items.server = 'gpu-0' AND finished_at > :at"
            ),
            {"run": RUN, "at": resumed_at},
        ).scalar_one()
    assert late == 0
    assert export_versions(deployment, RUN, deployment.tmp / "r1.jsonl") == {OLD}
    assert export_versions(deployment, PINNED_RUN, deployment.tmp / "r2.jsonl") == {NEW}
    deployment.summary("update-weights on a live fleet", stored, recover_s)

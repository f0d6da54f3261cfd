"""Provenance in the ledger and out of it, on SQLite and Postgres: results record their weight
version and sampling_params; an export of two weight versions is refused unless one is picked
or mixing is allowed; the Parquet manifest counts per version and setting; verify flags a
sample of other weights or other sampling; the watchdog sees new weights on an idle server."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, update

from app.core.contracts import GenerateResult, SamplingParams, ServerFingerprint
from app.core.errors import ConfigurationError
from app.core.settings import Settings
from app.ledger import common, queue, reads, registry, run_queries
from app.ledger import outcomes as ledger_outcomes
from app.outputs.export import export_run
from app.outputs.parquet_export import check_export, export_parquet
from app.outputs.verify import verify_run
from workers.control.watchdog import Probe, run_watchdog

SAMPLING = SamplingParams(max_new_tokens=8, seed=3, temperature_cycle=(0.5, 1.0))
PINNED = ServerFingerprint("m", "v1", None, "0.5.23")


def make_run(
    db: Engine, name: str = "prov", versions: tuple[str, ...] = ("v1", "v1", "v2")
) -> run_queries.RunInfo:
    """One prompt x len(versions) samples, sample k done under versions[k] with what the run
    sends for it; sample 0 of a second prompt with a row sampling override."""
    spec = run_queries.RunSpec(
        name, "/t", "a" * 64, "b" * 64, {}, SAMPLING, len(versions), None, [9]
    )
    with db.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec)
        run_queries.pin_fingerprint(conn, run.id, PINNED.to_json())
        new = [queue.NewItem("p", k, 1, None, [1, 2]) for k in range(len(versions))]
        new.append(queue.NewItem("q", 0, 2, None, [3], sampling_params={"top_k": 4}))
        queue.insert_items(conn, run.id, new)
        ids = queue.pending_ids(conn, run.id, limit=100)
    outcomes: list[ledger_outcomes.Outcome] = []
    for item_id, (key, k, row) in zip(
        ids, [*(("p", k, None) for k in range(len(versions))), ("q", 0, {"top_k": 4})], strict=True
    ):
        version = versions[k] if key == "p" else "v1"
        result = GenerateResult(
            rid=f"r{item_id}", output_ids=[5, 9], finish_reason="stop", matched_stop=9,
            prompt_tokens=2 if key == "p" else 1, completion_tokens=2, cached_tokens=0,
            e2e_latency_s=0.1, weight_version=version,
            sampling_params=SAMPLING.for_sample(k, row),
        )  # fmt: skip
        outcomes.append(ledger_outcomes.Done(item_id, result))
    with db.begin() as conn:
        ledger_outcomes.record_outcomes(conn, outcomes, owner="t", lease_s=60)
        conn.execute(
            update(common.items).where(common.items.c.run_id == run.id).values(server="gpu-a")
        )
        return run_queries.get_run(conn, name)


def test_results_keep_their_weights_and_sampling(db: Engine) -> None:
    run = make_run(db)
    with db.connect() as conn:
        stored = {(s.item_key, s.sample_index): s for s in reads.iter_items(conn, run.id)}
    assert stored[("p", 2)].weight_version == "v2"
    assert stored[("p", 1)].sampling_params == SAMPLING.for_sample(1)
    assert stored[("p", 1)].sampling_params["temperature"] == 1.0
    assert stored[("q", 0)].sampling_params["top_k"] == 4
    assert stored[("q", 0)].row_sampling_params == {"top_k": 4}


def test_an_export_of_two_weight_versions_is_refused_unless_asked(
    db: Engine, tmp_path: Path
) -> None:
    run = make_run(db)
    with pytest.raises(ConfigurationError, match=r"v1: 3, v2: 1.*--allow-mixed-weights"):
        export_run(db, run, "specforge", tmp_path / "all.jsonl")
    with pytest.raises(ConfigurationError, match="no done samples of weight_version 'v9'"):
        export_run(db, run, "specforge", tmp_path / "v9.jsonl", weight_version="v9")
    export_run(db, run, "specforge", tmp_path / "v2.jsonl", weight_version="v2")
    rows = [json.loads(x) for x in (tmp_path / "v2.jsonl").read_text().splitlines()]
    assert [(r["id"], r["sample"], r["weight_version"]) for r in rows] == [("p", 2, "v2")]
    assert rows[0]["sampling_params"] == SAMPLING.for_sample(2)
    mixed = export_run(db, run, "specforge", tmp_path / "m.jsonl", allow_mixed_weights=True)
    assert mixed.rows == 4

    url = str(tmp_path / "v1.parquet")
    report = export_parquet(db, run, url, weight_version="v1")
    assert report.rows == 3
    manifest = json.loads((tmp_path / "v1.parquet" / ".manifest.json").read_text())
    made = manifest["provenance"]
    assert made["weight_version"] == "v1" and made["per_weight_version"] == {"v1": 3}
    # the settings apart from the seed: temperature 0.5, 1.0, and 0.5 with the row's top_k 4
    settings = sorted(
        (s["sampling_params"]["temperature"], s["sampling_params"]["top_k"], s["samples"])
        for s in made["per_sampling"]
    )
    assert settings == [(0.5, -1, 1), (0.5, 4, 1), (1.0, -1, 1)]
    assert all("sampling_seed" not in s["sampling_params"] for s in made["per_sampling"])
    table = pq.read_table(url).to_pylist()
    assert {r["weight_version"] for r in table} == {"v1"}
    with db.connect() as conn:
        assert check_export(conn, run.id, url).problems == []


def test_verify_flags_other_weights_and_other_sampling(db: Engine) -> None:
    run = make_run(db)
    with db.begin() as conn:
        conn.execute(
            update(common.items)
            .where(common.items.c.run_id == run.id, common.items.c.item_key == "q")
            .values(sampling_params=SAMPLING.for_sample(0))  # the row's top_k lost
        )
    report = verify_run(db, run, None)
    weights, sampling = report.checks["weight_version"], report.checks["sampling_params"]
    assert (weights.checked, weights.mismatches) == (4, 1)
    assert "weight_version v2; the run pinned v1" in weights.examples[0].detail
    assert (sampling.checked, sampling.mismatches) == (4, 1)
    assert "top_k: sent -1, expected 4" in sampling.examples[0].detail
    assert not report.clean


class Prober:
    def __init__(self) -> None:
        self.version = "v1"

    def probe(self, server: registry.ServerInfo) -> Probe:
        model = {"model_path": "m", "weight_version": self.version, "reasoning_parser": None}
        return Probe(True, 0.01, None, model)

    def fingerprint(self, server: registry.ServerInfo) -> ServerFingerprint:
        return ServerFingerprint("m", self.version, None, "0.5.23")


class Control:
    def cancel_consumer(self, workers: list[str]) -> None:
        pass

    def add_consumer(self, workers: list[str]) -> None:
        pass


def test_the_watchdog_sees_new_weights_on_an_idle_server(db: Engine, tmp_path: Path) -> None:
    spec = run_queries.RunSpec("r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2])
    with db.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://a:30000")
        run, _ = run_queries.get_or_create_run(conn, spec)
        run_queries.pin_fingerprint(conn, run.id, PINNED.to_json())
        queue.insert_items(conn, run.id, [queue.NewItem("k", 0, 1, None, [1])])
    settings, prober = Settings(data_dir=tmp_path), Prober()
    for _ in range(3):
        run_watchdog(db, settings, Control(), prober)
    prober.version = "v2"  # /update_weights_from_disk on the server, nothing in flight
    run_watchdog(db, settings, Control(), prober)
    with db.connect() as conn:
        server = registry.get_server(conn, "gpu-a")
        events = registry.list_events(conn, server="gpu-a")
    assert server.paused and server.paused_by == "weights"
    assert server.pause_reason == "weights changed: weight_version: v1 → v2"
    assert any(e.kind == "weights_changed" and "refused by run r" in e.message for e in events)
    # a run pinned to the new weights takes the server back; the old run's items it skips
    v2 = run_queries.RunSpec("r2", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2],
                        weight_version="v2")  # fmt: skip
    with db.begin() as conn:
        run2, _ = run_queries.get_or_create_run(conn, v2)
        queue.insert_items(conn, run2.id, [queue.NewItem("k", 0, 1, None, [1])])
    run_watchdog(db, settings, Control(), prober)
    with db.connect() as conn:
        assert not registry.get_server(conn, "gpu-a").paused

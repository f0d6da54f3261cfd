"""The runbook's metrics table (ops/README.md, "Metrics") held to what `/metrics` exports.

The collector of ops/views/metrics.py scrapes a snapshot that has every kind of figure (a server
with its probe and window, items of each status, a Redis queue); the families it exports, their
labels and the server states must be the table's, row for row.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import pytest
from prometheus_client.metrics_core import Metric
from sqlalchemy import Engine

from app.core.models import ItemStatus
from app.ledger import metrics_queries, registry, windows
from ops.views import metrics
from workers.control.health import Health

RUNBOOK = Path(__file__).resolve().parents[2] / "ops" / "README.md"
_ROW = re.compile(r"^\| `tokenmill_[^|]*\|[^|]*\|.*\|$")
_BRACES = re.compile(r"\{([^}]*)\}")
_NAME = re.compile(r"`(tokenmill_[^`]+)`")


def expand(name: str) -> list[str]:
    """`a_{b,c}_d` → `a_b_d`, `a_c_d` (one brace group, as the table writes them)."""
    group = _BRACES.search(name)
    if group is None:
        return [name]
    return [name[: group.start()] + part + name[group.end() :] for part in group[1].split(",")]


def table() -> dict[str, tuple[frozenset[str], str]]:
    """Each metric name of the runbook's table → its labels and its meaning."""
    section = RUNBOOK.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[frozenset[str], str]] = {}
    for line in section.splitlines():
        if not _ROW.match(line):
            continue
        names, labels, meaning = (cell.strip() for cell in line.strip("|").split("|", 2))
        label_set = frozenset(part.strip() for part in labels.split(",") if part.strip())
        for written in _NAME.findall(names):
            for name in expand(written):
                assert name not in rows, f"{name} is in the runbook's table twice"
                rows[name] = (label_set, meaning)
    return rows


def snapshot() -> metrics_queries.LedgerSnapshot:
    now = datetime(2026, 12, 7, tzinfo=UTC)
    server = registry.ServerInfo(
        name="gpu-a",
        url="http://gpu-a:30000",
        state=Health.HEALTHY.value,
        state_since=now,
        paused=True,
        paused_by="operator",
        pause_reason="maintenance",
        consecutive_failures=0,
        consecutive_successes=3,
        last_probe_at=now,
        last_probe_ok=True,
        last_probe_latency_s=0.01,
        last_error=None,
        fingerprint=None,
        restart_command=None,
        workers=["w1"],
    )
    groups = [
        metrics_queries.ItemGroup("r1", "gpu-a", status.value, "stop", 2, 10, hedged=1)
        for status in ItemStatus
    ]
    window = windows.ServerWindow("auto", 136, 128, 120, 4, "loads", 1)
    return metrics_queries.LedgerSnapshot(
        ["r1"], groups, [], [server], server_windows={"gpu-a": window}, run_priorities={"r1": 10}
    )


def exported(monkeypatch: pytest.MonkeyPatch) -> dict[str, Metric]:
    """The families one scrape exports, by the name Prometheus shows (counters with `_total`)."""
    monkeypatch.setattr(metrics_queries, "read_snapshot", lambda engine: snapshot())
    monkeypatch.setattr(metrics, "broker_queue_depth", lambda url: 3)
    collector = metrics.LedgerCollector(cast(Engine, None), "redis://127.0.0.1:6379/0")
    families = list(collector.collect())
    return {f.name + ("_total" if f.type == "counter" else ""): f for f in families}


def labels_of(family: Metric) -> frozenset[str]:
    return frozenset(k for s in family.samples for k in s.labels if k != "le")


def test_the_table_names_every_family_metrics_exports_and_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert set(table()) == set(exported(monkeypatch))


def test_each_row_names_the_labels_of_its_family(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = table()
    for name, family in exported(monkeypatch).items():
        assert rows[name][0] == labels_of(family), f"{name}: labels differ from the runbook's"


def test_the_state_row_lists_every_state_the_exporter_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    family = exported(monkeypatch)["tokenmill_server_state"]
    states = {s.labels["state"] for s in family.samples}
    assert states == {h.value for h in Health}
    meaning = table()["tokenmill_server_state"][1]
    listed = re.search(r"\(([^)]*)\)", meaning)
    assert listed is not None, "the state row lists the states in parentheses"
    assert {s.strip() for s in listed[1].split(",")} == states

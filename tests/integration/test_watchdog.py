"""The watchdog over a real ledger with a scripted prober and a recording control: pauses a
down server's workers, resumes them healthy with the pinned fingerprint, keeps them paused on a
changed one, catches a stall the health route hides, and never lifts an operator's pause."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, update

from app.core.contracts import SamplingParams, ServerFingerprint
from app.core.settings import Settings
from app.ledger import claims, common, queue, registry, run_queries
from workers.control.pausing import pause_server
from workers.control.watchdog import Probe, run_watchdog

PINNED = ServerFingerprint("moonshotai/Kimi-K2.5", "default", None, "0.5.23")


class ScriptedProber:
    def __init__(self) -> None:
        self.ok: dict[str, bool] = {}
        self.fingerprints: dict[str, ServerFingerprint] = {}

    def probe(self, server: registry.ServerInfo) -> Probe:
        ok = self.ok.get(server.name, True)
        return Probe(ok, 0.01, None if ok else "connection refused")

    def fingerprint(self, server: registry.ServerInfo) -> ServerFingerprint:
        return self.fingerprints.get(server.name, PINNED)


class RecordingControl:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def cancel_consumer(self, workers: list[str]) -> None:
        self.calls.append(("cancel", workers))

    def add_consumer(self, workers: list[str]) -> None:
        self.calls.append(("add", workers))


@pytest.fixture
def fleet(db: Engine, tmp_path: Path) -> tuple[Engine, Settings, ScriptedProber, RecordingControl]:
    with db.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://a:30000")
        registry.add_worker(conn, "gpu-a", "w1@host")
        registry.upsert_server(conn, "gpu-b", "http://b:30000")
        spec = run_queries.RunSpec(
            "r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2]
        )
        run, _ = run_queries.get_or_create_run(conn, spec)
        run_queries.pin_fingerprint(conn, run.id, PINNED.to_json())
        queue.insert_items(
            conn, run.id, [queue.NewItem(f"k{i}", 0, i, None, [1]) for i in range(4)]
        )
    settings = Settings(data_dir=tmp_path, stall_s=60)
    return db, settings, ScriptedProber(), RecordingControl()


def server(db: Engine, name: str) -> registry.ServerInfo:
    with db.connect() as conn:
        return registry.get_server(conn, name)


def kinds(db: Engine) -> list[str]:
    with db.connect() as conn:
        return [f"{e.kind}:{e.message}" for e in registry.list_events(conn)]


def test_down_pauses_and_healthy_resumes(
    fleet: tuple[Engine, Settings, ScriptedProber, RecordingControl],
) -> None:
    db, settings, prober, control = fleet
    assert run_watchdog(db, settings, control, prober) == {"gpu-a": "healthy", "gpu-b": "healthy"}
    prober.ok["gpu-a"] = False
    states = [run_watchdog(db, settings, control, prober)["gpu-a"] for _ in range(3)]
    assert states == ["suspect", "suspect", "down"]
    a = server(db, "gpu-a")
    assert a.paused and a.paused_by == "watchdog" and "connection refused" in (a.last_error or "")
    assert control.calls == [("cancel", ["w1@host"])]
    assert not server(db, "gpu-b").paused
    prober.ok["gpu-a"] = True
    assert [run_watchdog(db, settings, control, prober)["gpu-a"] for _ in range(2)] == [
        "recovering",
        "healthy",
    ]
    assert not server(db, "gpu-a").paused
    assert control.calls[-1] == ("add", ["w1@host"])
    timeline = kinds(db)
    assert any(k.startswith("state:gpu-a: suspect → down") for k in timeline)
    assert [k.split(":")[0] for k in timeline if k.split(":")[0] in ("paused", "resumed")] == [
        "paused",
        "resumed",
    ]


def test_changed_fingerprint_stays_paused_and_says_what_changed(
    fleet: tuple[Engine, Settings, ScriptedProber, RecordingControl],
) -> None:
    db, settings, prober, control = fleet
    prober.ok["gpu-a"] = False
    for _ in range(3):
        run_watchdog(db, settings, control, prober)
    prober.ok["gpu-a"] = True
    prober.fingerprints["gpu-a"] = ServerFingerprint(
        "moonshotai/Kimi-K2.5", "default", "kimi_k2", "0.5.23"
    )
    for _ in range(3):
        run_watchdog(db, settings, control, prober)
    a = server(db, "gpu-a")
    assert a.state == "healthy" and a.paused and a.paused_by == "fingerprint"
    assert "reasoning_parser: None → kimi_k2" in (a.pause_reason or "")
    assert sum("fingerprint_mismatch" in k for k in kinds(db)) == 1  # said once, not per probe
    # fixed by the operator: resumed on the next round
    prober.fingerprints["gpu-a"] = PINNED
    run_watchdog(db, settings, control, prober)
    assert not server(db, "gpu-a").paused


def test_stall_is_caught_when_the_health_route_lies(
    fleet: tuple[Engine, Settings, ScriptedProber, RecordingControl],
) -> None:
    db, settings, prober, control = fleet
    with db.begin() as conn:
        run = run_queries.get_run(conn, "r")
        ids = queue.pending_ids(conn, run.id)
        claims.claim_items(conn, ids, owner="w", server="gpu-a", lease_s=600)
        conn.execute(
            update(common.items).values(started_at=common.utcnow() - timedelta(seconds=61))
        )
    assert run_watchdog(db, settings, control, prober)["gpu-a"] == "down"
    a = server(db, "gpu-a")
    assert a.paused and "stalled: 4 requests in flight" in (a.last_error or "")


def test_operator_pause_is_never_lifted_by_the_watchdog(
    fleet: tuple[Engine, Settings, ScriptedProber, RecordingControl],
) -> None:
    db, settings, prober, control = fleet
    pause_server(db, control, "gpu-b", by="operator", reason="maintenance")
    for _ in range(3):
        run_watchdog(db, settings, control, prober)
    b = server(db, "gpu-b")
    assert b.paused and b.paused_by == "operator"


def test_a_drain_and_a_refused_key_are_their_own_states_on_a_real_server(
    db: Engine, tmp_path: Path
) -> None:
    """The HttpProber on emulators that behave as SGLang: a SIGTERMed server answers 503 at
    once while it serves (draining: its workers drain it themselves, nothing is paused), then
    is down when it exits; a server that refuses our key is `auth` and paused."""
    from emulator.config import EmulatorConfig
    from tests.support.emulator import running_emulator

    settings = Settings(data_dir=tmp_path)
    control = RecordingControl()
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with (
        running_emulator(EmulatorConfig(port=0, step_ms=20)) as leaving,
        running_emulator(EmulatorConfig(port=0, step_ms=0, api_key="k")) as locked,
    ):
        with db.begin() as conn:
            registry.upsert_server(conn, "gpu-d", leaving.url)
            registry.upsert_server(conn, "gpu-k", locked.url)
        assert run_watchdog(db, settings, control) == {"gpu-d": "healthy", "gpu-k": "auth"}
        with httpx.Client(base_url=leaving.url, timeout=30) as client:
            out = ThreadPoolExecutor(1).submit(client.post, "/generate", json=body)
            deadline = time.monotonic() + 10
            while not httpx.get(f"{leaving.url}/emulator/stats").json()["running"]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            leaving.terminate()
            assert run_watchdog(db, settings, control)["gpu-d"] == "draining"
            assert not server(db, "gpu-d").paused  # its requests out still finish
            assert out.result(timeout=30).status_code == 200
        assert leaving.popen.wait(timeout=30) == 0
        assert run_watchdog(db, settings, control)["gpu-d"] == "down"
        locked_server = server(db, "gpu-k")
    assert locked_server.paused and "TOKENMILL_SGLANG_API_KEY" in (locked_server.last_error or "")
    timeline = kinds(db)
    assert any(k.startswith("state:gpu-d: healthy → draining") for k in timeline), timeline
    assert any(k.startswith("state:gpu-d: draining → down") for k in timeline), timeline


def test_each_state_change_is_recorded_once_by_whichever_writer_saw_it_first(db: Engine) -> None:
    """The worker's probe, the watchdog and a restart share one guarded change of state: a
    writer that read a state another has changed since records nothing, and what a liveness
    probe sees never overrules the ledger (a starting server is no drain, a healthy one does not
    go back to recovering, a suspect one is the watchdog's to judge)."""
    probe = {"ok": True, "latency_s": 0.01, "error": None}
    watchdog = {"failures": 0, "successes": 2, "ok": True, "latency_s": 0.01, "error": None}
    with db.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://a:30000")
        assert registry.record_probe(conn, "gpu-a", expected="unknown", state="healthy", **watchdog)
        # the worker sees the drain first; the watchdog's tick had read healthy: not recorded
        registry.note_probe(
            conn, "gpu-a", **probe | {"state": "draining", "ok": False}, by="worker"
        )
        stale = watchdog | {"failures": 1, "ok": False}
        assert not registry.record_probe(
            conn, "gpu-a", expected="healthy", state="suspect", **stale
        )
        registry.note_probe(conn, "gpu-a", **probe | {"state": "down", "ok": False}, by="worker")
        # the new server's loading 503s: a starting server, not a drain
        registry.note_probe(
            conn, "gpu-a", **probe | {"state": "draining", "ok": False}, by="worker"
        )
        registry.note_probe(conn, "gpu-a", **probe, state="recovering", by="restart")
        registry.note_probe(conn, "gpu-a", **probe, state="healthy", by="worker")
        registry.note_probe(conn, "gpu-a", **probe, state="recovering", by="restart")
        assert not registry.record_probe(
            conn, "gpu-a", expected="down", state="recovering", **watchdog
        )
        # a liveness 200 leaves a server the watchdog found suspect to the watchdog
        assert registry.record_probe(conn, "gpu-a", expected="healthy", state="suspect", **stale)
        registry.note_probe(conn, "gpu-a", **probe, state="healthy", by="worker")
        assert registry.get_server(conn, "gpu-a").state == "suspect"
        changes = [
            ((e.details or {})["from"], (e.details or {})["to"], (e.details or {})["by"])
            for e in registry.list_events(conn, server="gpu-a")
            if e.kind == "state"
        ]
    assert changes == [
        ("unknown", "healthy", "watchdog"),
        ("healthy", "draining", "worker"),
        ("draining", "down", "worker"),
        ("down", "recovering", "restart"),
        ("recovering", "healthy", "worker"),
        ("healthy", "suspect", "watchdog"),
    ]

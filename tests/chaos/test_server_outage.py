"""Chaos scenario 2 and server outages with real processes: beat + watchdog, two
`celery -A app worker`s, two emulators, real Redis and Postgres. A SIGKILLed server that comes
back after a closed-port load and loading 503s costs waiting, never a failed item or a spent
attempt; `tokenmill restart` relaunches a server; a changed fingerprint keeps it paused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import Engine, select

from app.ledger import common, reads, registry, run_queries
from emulator.config import EmulatorConfig
from emulator.model import generate_output
from ops.emulator_proc import start_emulator
from tests.support.emulator import free_port
from tests.support.procs import service_env, start_celery, start_worker, stop, tokenmill, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

FLAGS = ["--max-running", "8", "--step-ms", "10", "--median-tokens", "30", "--sigma", "0.8"]
CONFIG = EmulatorConfig(max_running=8, step_ms=10, median_tokens=30, sigma=0.8)
PROMPTS = 300
# the acceptance run uses a 30 s load: TOKENMILL_TEST_LOAD_DELAY_S=30 pytest ...
LOAD_DELAY_S = os.environ.get("TOKENMILL_TEST_LOAD_DELAY_S", "2")


def emulator_cmd(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "emulator", "--port", str(port), *FLAGS, *extra]


def unfinished(db: Engine) -> str:
    """What is left, for the message of a run that did not finish."""
    with db.connect() as conn:
        run = run_queries.get_run(conn, "outage")
        left = list(reads.iter_items(conn, run.id, statuses=("pending", "queued", "leased")))
        rows = conn.execute(
            select(
                common.items.c.id,
                common.items.c.status,
                common.items.c.lease_owner,
                common.items.c.started_at,
                common.items.c.attempts,
                common.items.c.error,
            ).where(common.items.c.id.in_([i.id for i in left]))
        ).all()
    return f"{len(left)} unfinished: " + "; ".join(str(tuple(r)) for r in rows[:10])


def worker_for(env: dict[str, str], url: str, name: str, tmp: Path) -> subprocess.Popen[bytes]:
    """A worker (node name w<last letter of name>, log in tmp) serving server `name` at url."""
    label = "w" + name[-1]
    return start_worker(
        env | {"TOKENMILL_SGLANG_URL": url, "TOKENMILL_SERVER_NAME": name},
        label,
        tmp / f"{label}.log",
    )


def write_prompts(path: Path, n: int) -> Path:
    import json

    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": f"Question number {i}?"}) + "\n" for i in range(n)
        )
    )
    return path


def counts(db: Engine, run: str = "outage") -> reads.RunCounts:
    with db.connect() as conn:
        return reads.run_counts(conn, run_queries.get_run(conn, run))


def server(db: Engine, name: str) -> registry.ServerInfo:
    with db.connect() as conn:
        return registry.get_server(conn, name)


def state(db: Engine, name: str) -> str | None:
    with db.connect() as conn:
        known = {s.name: s.state for s in registry.list_servers(conn)}
    return known.get(name)


def assert_exact_and_once(db: Engine, run_name: str) -> list[reads.StoredItem]:
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        stored = list(reads.iter_items(conn, run.id, statuses=("done", "failed")))
    assert len({(s.item_key, s.sample_index) for s in stored}) == len(stored) == PROMPTS
    assert [s for s in stored if s.status != "done"] == []
    assert {s.attempts for s in stored} == {1}, "an outage spent attempts"
    for s in stored:
        expected, _ = generate_output(
            s.prompt_ids, run.generation.sampling.for_sample(s.sample_index), CONFIG
        )
        assert s.output_ids == expected
    return stored


@pytest.fixture
def deployment(
    pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path, tmp_path: Path
) -> Iterator[tuple[dict[str, str], list[subprocess.Popen[bytes]], Path]]:
    env = service_env(
        pg_url,
        redis_url,
        tmp_path,
        TOKENMILL_WATCHDOG_INTERVAL_S="1",
        TOKENMILL_PAUSE_CHECK_S="0.5",
        TOKENMILL_UNAVAILABLE_WAIT_S="1",
        TOKENMILL_PROBE_TIMEOUT_S="25",
        TOKENMILL_RECONCILE_INTERVAL_S="5",
    )
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    result = tokenmill(
        [
            "enqueue",
            str(prompts),
            "--run",
            "outage",
            "--tokenizer",
            str(kimi_tokenizer_dir),
            "--max-new-tokens",
            "100",
            "--seed",
            "1",
        ],
        env,
    )
    assert result.returncode == 0, result.stderr
    procs: list[subprocess.Popen[bytes]] = []
    yield env, procs, tmp_path
    stop(procs)


def test_killed_server_comes_back_and_nothing_fails(
    deployment: tuple[dict[str, str], list[subprocess.Popen[bytes]], Path],
    pg_engine: Engine,
    redis_url: str,
) -> None:
    env, procs, tmp = deployment
    port = free_port()
    victim = subprocess.Popen(
        emulator_cmd(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    steady = start_emulator(FLAGS)
    procs.append(victim)
    try:
        procs.append(worker_for(env, f"http://127.0.0.1:{port}", "gpu-a", tmp))
        procs.append(worker_for(env, steady.url, "gpu-b", tmp))
        procs.append(start_celery("beat", env, tmp / "beat.log"))
        wait_for(
            "both servers healthy",
            lambda: all(state(pg_engine, n) == "healthy" for n in ("gpu-a", "gpu-b")),
            60,
        )
        wait_for("gpu-a doing work", lambda: counts(pg_engine).done > 30, 60)

        victim.kill()
        killed_at = time.monotonic()
        wait_for("gpu-a paused by the watchdog", lambda: server(pg_engine, "gpu-a").paused, 30)
        a = server(pg_engine, "gpu-a")
        assert a.state == "down" and a.paused_by == "watchdog"
        inspector = Celery(broker=redis_url).control.inspect(timeout=3.0)

        def consumed() -> set[str]:
            """The queues gpu-a's worker consumes, as Flower and `celery inspect` show them."""
            queues = inspector.active_queues() or {}
            return {q["name"] for k, v in queues.items() if k.startswith("wa@") for q in v}

        wait_for("gpu-a's consumer cancelled", lambda: "generate" not in consumed(), 15)
        assert "tokenmill.control" in consumed()

        # back after a load with the port closed (2 s here), then 2 s of loading 503s
        procs.append(
            subprocess.Popen(
                emulator_cmd(port, "--startup-delay-s", LOAD_DELAY_S, "--loading-s", "2"),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_for(
            "gpu-a resumed", lambda: not server(pg_engine, "gpu-a").paused, 60 + float(LOAD_DELAY_S)
        )
        wait_for("gpu-a's consumer re-added", lambda: "generate" in consumed(), 15)
        # from the kill until gpu-a's worker consumes again: the load, the 503s, the watchdog
        recover_s = time.monotonic() - killed_at
        wait_for(
            "run finished", lambda: counts(pg_engine).finished, 180, lambda: unfinished(pg_engine)
        )
    finally:
        steady.stop()
    stored = assert_exact_and_once(pg_engine, "outage")
    print(
        f"CHAOS server killed and reloaded: items={len(stored)} "
        f"done={sum(s.status == 'done' for s in stored)} failed=0 duplicates=0 lost=0 "
        f"recover_s={recover_s:.1f}"
    )
    with pg_engine.connect() as conn:
        timeline = [(e.kind, e.message) for e in registry.list_events(conn, server="gpu-a")]
    kinds = [
        k for k, m in timeline if k in ("paused", "resumed") or "→ down" in m or "→ healthy" in m
    ]
    assert kinds.index("paused") < kinds.index("resumed")
    assert any("→ down" in m for _, m in timeline) and any(
        "recovering → healthy" in m for _, m in timeline
    )
    assert {s.server for s in stored} == {"gpu-a", "gpu-b"}
    events = tokenmill(["events", "--json", "--server", "gpu-a"], env)
    assert events.returncode == 0 and '"kind": "resumed"' in events.stdout


def test_restart_command_relaunches_and_changed_fingerprint_stays_paused(
    deployment: tuple[dict[str, str], list[subprocess.Popen[bytes]], Path],
    pg_engine: Engine,
) -> None:
    env, procs, tmp = deployment
    port = free_port()
    first = subprocess.Popen(
        emulator_cmd(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    procs.append(first)
    procs.append(worker_for(env, f"http://127.0.0.1:{port}", "gpu-a", tmp))
    procs.append(start_celery("beat", env, tmp / "beat.log"))
    wait_for("work under way", lambda: counts(pg_engine).done > 20, 60)

    # a restart script: stop the running server, start a new one in the background, exit
    pattern = f"emulator --port {port} "
    script = tmp / "restart.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"pkill -f '{pattern}'\n"
        f"while pgrep -f '{pattern}' >/dev/null; do sleep 0.1; done\n"
        f"nohup {' '.join(emulator_cmd(port))} --startup-delay-s 1 --loading-s 1 "
        f'"$@" >{tmp}/relaunch.log 2>&1 &\n'
    )
    script.chmod(0o755)

    def restart(command: str) -> subprocess.CompletedProcess[str]:
        args = ["restart", "gpu-a", "--command", command, "--poll-s", "0.5", "--timeout-s", "60"]
        return tokenmill(args, env, timeout_s=120)

    result = restart(f"{script} --weight-version {{name}}-v1")
    # the relaunched server reports another weight_version: it must stay paused
    assert result.returncode == 1, result.stdout + result.stderr
    assert "weight_version: default → gpu-a-v1" in result.stderr
    a = server(pg_engine, "gpu-a")
    assert a.paused and a.paused_by == "restart"
    frozen = counts(pg_engine).done
    time.sleep(3)
    assert counts(pg_engine).done == frozen, "a paused server kept working"

    # restart again with the right configuration: resumed, and the run completes exactly
    result = restart(f"{script} --weight-version default")
    assert result.returncode == 0, result.stderr
    assert "restarted and resumed" in result.stderr
    wait_for("run finished", lambda: counts(pg_engine).finished, 180, lambda: unfinished(pg_engine))
    assert_exact_and_once(pg_engine, "outage")
    subprocess.run(["pkill", "-f", pattern], check=False)

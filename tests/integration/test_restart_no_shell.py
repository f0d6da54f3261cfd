"""`tokenmill restart` runs the registered command as an argument list, never through a shell:
metacharacters, and `{placeholders}` filled from the server's name and URL, reach the program
verbatim."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from sqlalchemy import Engine

from app.core.contracts import ServerFingerprint
from app.core.settings import Settings
from app.ledger import registry, run_queries
from tests.support.runs import add_item, make_run
from workers.control.restart import RestartResult, parse_command, restart_server
from workers.control.watchdog import Probe

NAME = "gpu-$(touch pwned-by-name)"
HOSTILE = ["$(touch {pwned})", "; touch {pwned}", "`touch {pwned}`", "a b | touch {pwned}", "*"]


class ReadyProber:
    """A server that is down at the first probe, then ready (its process started anew)."""

    def __init__(self) -> None:
        self.probes = 0

    def probe(self, server: registry.ServerInfo) -> Probe:
        self.probes += 1
        return Probe(self.probes > 1, 0.001, None if self.probes > 1 else "refused")

    def fingerprint(self, server: registry.ServerInfo) -> ServerFingerprint:
        return ServerFingerprint(model_path="m", version="0.5.23")

    def started_at(self, server: registry.ServerInfo) -> float | None:
        return None


class NoControl:
    def cancel_consumer(self, workers: list[str]) -> None:
        pass

    def add_consumer(self, workers: list[str]) -> None:
        pass


def test_restart_arguments_reach_the_program_verbatim(pg_engine: Engine, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    seen = tmp_path / "argv.json"
    recorder = "import json, sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))"
    hostile = [arg.replace("{pwned}", str(pwned)) for arg in HOSTILE]
    text = json.dumps([sys.executable, "-c", recorder, str(seen), *hostile, "{name}@{host}:{port}"])
    argv = parse_command(text)
    with pg_engine.begin() as conn:
        # a name a shell would have run, filled into {name}
        registry.upsert_server(conn, NAME, "http://127.0.0.1:30000", restart_command=argv)

    result = restart_server(
        pg_engine,
        Settings(data_dir=tmp_path, successes_to_up=1),
        NoControl(),
        NAME,
        poll_s=0.05,
        log_dir=tmp_path / "logs",
        prober=ReadyProber(),
    )

    assert result.ok, result.message
    for _ in range(200):  # the recorder runs detached; give it a moment to write
        if seen.exists() and seen.read_text():
            break
        time.sleep(0.05)
    recorded = json.loads(seen.read_text())
    assert recorded[1:-1] == hostile
    assert recorded[-1] == f"{NAME}@127.0.0.1:30000"
    assert not pwned.exists(), "an argument was interpreted by a shell"


def test_a_shell_like_string_is_split_not_run() -> None:
    argv = parse_command("systemctl restart 'sglang@gpu a' ; rm -rf /")
    assert argv == ["systemctl", "restart", "sglang@gpu a", ";", "rm", "-rf", "/"]


def _restart_gpu_a(db: Engine, tmp_path: Path, prober: ReadyProber) -> RestartResult:
    """`tokenmill restart gpu-a`, its probes and fingerprint from prober."""
    return restart_server(
        db,
        Settings(data_dir=tmp_path, successes_to_up=1),
        NoControl(),
        "gpu-a",
        poll_s=0.05,
        log_dir=tmp_path / "logs",
        prober=prober,
    )


class NeverDownProber(ReadyProber):
    """A server that answers throughout, its process never started anew."""

    def probe(self, server: registry.ServerInfo) -> Probe:
        return Probe(True, 0.001, None)

    def started_at(self, server: registry.ServerInfo) -> float | None:
        return 1_700_000_000.0


def test_a_restart_that_never_took_the_server_down_says_so(
    pg_engine: Engine, tmp_path: Path
) -> None:
    with pg_engine.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://127.0.0.1:30000", restart_command=["true"])
    result = _restart_gpu_a(pg_engine, tmp_path, NeverDownProber())
    assert not result.ok
    assert result.message.startswith("gpu-a never went down"), result.message
    with pg_engine.connect() as conn:
        assert not registry.get_server(conn, "gpu-a").paused  # serving as before


class SmallerProber(ReadyProber):
    """Back after a restart with --context-length 1024."""

    def fingerprint(self, server: registry.ServerInfo) -> ServerFingerprint:
        return ServerFingerprint(model_path="m", version="0.5.23", limits={"context_length": 1024})


def test_a_restart_into_smaller_limits_names_the_run_it_no_longer_fits(
    pg_engine: Engine, tmp_path: Path
) -> None:
    pinned = ServerFingerprint(model_path="m", version="0.5.23", limits={"context_length": 8192})
    with pg_engine.begin() as conn:
        registry.upsert_server(conn, "gpu-a", "http://127.0.0.1:30000", restart_command=["true"])
        run = make_run(conn, "r1", max_new_tokens=100)
        run_queries.pin_fingerprint(conn, run.id, pinned.to_json())
        add_item(conn, run.id, "long", status="pending", prompt_tokens=2000)
    result = _restart_gpu_a(pg_engine, tmp_path, SmallerProber())
    assert not result.ok and "resumed" not in result.message
    assert result.message.startswith("gpu-a restarted after"), result.message
    assert "no longer fits run r1" in result.message
    assert result.runs == [
        "run r1: pinned model m, weights None, context_length 8192; the server now model m, "
        "weights None, context_length 1024: does not fit: its limits do not admit the largest "
        "request: "
        "context_length 1024 < 2100 tokens (2000 of prompt + 100 new)"
    ]

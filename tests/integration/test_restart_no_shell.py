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
from app.ledger import registry
from app.ledger.registry import ServerInfo
from workers.control.restart import parse_command, restart_server
from workers.control.watchdog import Probe

NAME = "gpu-$(touch pwned-by-name)"
HOSTILE = ["$(touch {pwned})", "; touch {pwned}", "`touch {pwned}`", "a b | touch {pwned}", "*"]


class ReadyProber:
    def probe(self, server: ServerInfo) -> Probe:
        return Probe(True, 0.001, None)

    def fingerprint(self, server: ServerInfo) -> ServerFingerprint:
        return ServerFingerprint(model_path="m", version="0.5.23")


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

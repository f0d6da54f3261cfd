"""`tokenmill restart` and `update-weights` as an operator's script or log file sees them (stderr
not a terminal): plain lines, one when something changes, the restart's log file named, the
verdict on a line of its own; the drain before a weight update counts down.

Each runs the real CLI on the embedded ledger against an emulator process; the restart command
starts that emulator (port closed while it starts, then 503 while it loads), as a
`systemctl restart` would.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.ledger.database import make_engine
from app.ledger.migrate import upgrade
from ops.emulator_proc import EmulatorProcess, start_emulator
from tests.support.emulator import free_port
from tests.support.procs import ROOT, clean_env, tokenmill
from tests.support.runs import add_item, make_run

pytestmark = pytest.mark.e2e

PROGRESS = re.compile(r"^gpu-x +\d+s  (?P<phase>[a-z ]+)  probe: (?P<probe>.+)  healthy probes")


@pytest.fixture
def pidfile(tmp_path: Path) -> Iterator[Path]:
    """Where the restart command writes the emulator's pid; the emulator is stopped after."""
    path = tmp_path / "emulator.pid"
    yield path
    if path.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(path.read_text()), signal.SIGTERM)


def starter(port: int, pidfile: Path) -> str:
    """A restart command (JSON) that starts the emulator on `port` in the background and exits:
    2 s before the port is bound, 2 s of 503 after."""
    code = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-m', 'emulator', '--port', '{port}', "
        f"'--startup-delay-s', '2', '--loading-s', '2'], cwd={str(ROOT)!r}, "
        "stdout=subprocess.DEVNULL); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('started emulator', p.pid)"
    )
    return json.dumps([sys.executable, "-c", code])


def test_restart_in_a_pipe_prints_a_line_per_change_and_names_its_log(
    tmp_path: Path, pidfile: Path
) -> None:
    env = clean_env(tmp_path / "data")
    port = free_port()
    added = tokenmill(
        ["servers", "add", "gpu-x", f"http://127.0.0.1:{port}", "--restart-command",
         starter(port, pidfile)],
        env, tmp_path,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr

    result = tokenmill(["restart", "gpu-x", "--poll-s", "0.2"], env, tmp_path)

    assert result.returncode == 0, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if not ln.startswith("ledger: ")]
    named = re.fullmatch(r"gpu-x: the restart command's output goes to (\S+)", lines[0])
    assert named, lines
    log = Path(named.group(1))
    assert log.parent == tmp_path / "data" / "restarts"
    assert re.match(r"started emulator \d+\n", log.read_text()), log.read_text()
    progress = [PROGRESS.match(ln) for ln in lines[1:-1]]
    assert all(progress), lines
    seen = [(m.group("phase"), m.group("probe"), m.string.split()[-1]) for m in progress if m]
    # one line per change, none for a poll that saw what the last one saw (all within 30 s)
    assert all(a != b for a, b in itertools.pairwise(seen)), lines
    probes = [probe for _, probe, _ in seen]
    assert "Connection refused" in probes[0] and "HTTP 503" in probes, probes
    assert seen[-1] == ("waiting for the server", "ok", "2"), seen
    # the verdict stands on its own line, after the last probe's
    assert re.fullmatch(r"gpu-x restarted and resumed after \d+s", lines[-1]), lines
    assert "\r" not in result.stderr and "\x1b[" not in result.stderr


def test_a_failed_restart_names_its_log_with_the_commands_output(tmp_path: Path) -> None:
    env = clean_env(tmp_path / "data")
    failing = json.dumps(
        [sys.executable, "-c", "print('Unit sglang@30000.service not found.'); exit(5)"]
    )
    port = free_port()
    added = tokenmill(
        ["servers", "add", "gpu-x", f"http://127.0.0.1:{port}", "--restart-command", failing],
        env,
        tmp_path,
    )
    assert added.returncode == 0, added.stderr

    result = tokenmill(["restart", "gpu-x", "--poll-s", "0.2"], env, tmp_path)

    assert result.returncode == 1
    named = re.search(r"^gpu-x: the restart command's output (?:goes to|is in) (\S+)$",
                      result.stderr, re.M)  # fmt: skip
    assert named, result.stderr
    assert "Unit sglang@30000.service not found." in Path(named.group(1)).read_text()
    verdict = result.stderr.splitlines()[-1]
    assert verdict.startswith("gpu-x stays paused: restart command exited with code 5"), verdict


@pytest.fixture
def emulator() -> Iterator[EmulatorProcess]:
    process = start_emulator(["--weight-version", "step-100", "--weight-load-s", "0.2"])
    yield process
    process.stop()


def test_update_weights_in_a_pipe_counts_the_drain_down(
    tmp_path: Path, emulator: EmulatorProcess
) -> None:
    data = tmp_path / "data"
    env = clean_env(data)
    added = tokenmill(["servers", "add", "gpu-x", emulator.url], env, tmp_path)
    assert added.returncode == 0, added.stderr
    engine = make_engine(f"sqlite:///{data / 'ledger.sqlite3'}")
    upgrade(engine)
    with engine.begin() as conn:  # three items out on gpu-x, whose worker is gone
        run = make_run(conn, "r1")
        for i in range(3):
            add_item(conn, run.id, f"k{i}", status="leased", server="gpu-x")
    engine.dispose()
    checkpoint = tmp_path / "ckpt" / "step-200"
    checkpoint.mkdir(parents=True)

    result = tokenmill(
        ["update-weights", "gpu-x", "--model-path", str(checkpoint), "--weight-version",
         "step-200", "--drain-timeout-s", "3"],
        env, tmp_path,
    )  # fmt: skip

    lines = result.stderr.splitlines()
    waits = [
        m for ln in lines if (m := re.fullmatch(
            r"gpu-x: waiting for 3 in-flight items to finish or go back \((\d+)s left\)", ln
        ))
    ]  # fmt: skip
    left = [int(m.group(1)) for m in waits]
    # a line as it starts and none for each half-second poll: the count did not change
    assert left and left[0] == 3 and len(left) <= 2, lines
    assert left == sorted(left, reverse=True), left
    after = lines.index(waits[-1].string) + 1
    assert lines[after] == "3 requests still out: the update aborts them (their items go back)"
    assert any(ln.startswith("gpu-x serves weight_version step-200") for ln in lines), lines
    assert "\r" not in result.stderr and "\x1b[" not in result.stderr

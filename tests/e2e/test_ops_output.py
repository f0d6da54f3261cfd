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
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update

from app.ledger import common, database, migrate
from ops.emulator_proc import EmulatorProcess, start_emulator
from tests.support.emulator import free_port
from tests.support.procs import ROOT, clean_env, tokenmill, wait_for
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
    engine = database.make_engine(f"sqlite:///{data / 'ledger.sqlite3'}")
    migrate.upgrade(engine)
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


def ledger_with_run(data: Path, *, leased_on: str | None = None, pinned: str | None = None) -> None:
    """Run r1 in the embedded ledger: three items leased to `leased_on` (a worker gone), or one
    pending item; `pinned`: the run's `--weight-version`."""
    engine = database.make_engine(f"sqlite:///{data / 'ledger.sqlite3'}")
    migrate.upgrade(engine)
    with engine.begin() as conn:
        run = make_run(conn, "r1")
        if leased_on:
            for i in range(3):
                add_item(conn, run.id, f"k{i}", status="leased", server=leased_on)
        else:
            add_item(conn, run.id, "k0", status="pending")
        if pinned:
            conn.execute(
                update(common.runs).where(common.runs.c.id == run.id).values(weight_version=pinned)
            )
    engine.dispose()


def registered(tmp_path: Path, url: str) -> tuple[Path, dict[str, str]]:
    """An embedded ledger with server gpu-x at url: its folder and the CLI's environment."""
    data = tmp_path / "data"
    env = clean_env(data)
    assert tokenmill(["servers", "add", "gpu-x", url], env, tmp_path).returncode == 0
    return data, env


def server_json(env: dict[str, str], cwd: Path) -> dict[str, object]:
    listed = tokenmill(["servers", "--json"], env, cwd)
    assert listed.returncode == 0, listed.stderr
    (server,) = json.loads(listed.stdout)
    return dict(server)


def test_update_weights_refuses_a_server_that_does_not_answer(tmp_path: Path) -> None:
    env = clean_env(tmp_path / "data")
    down = f"http://127.0.0.1:{free_port()}"
    assert tokenmill(["servers", "add", "gpu-x", down], env, tmp_path).returncode == 0
    checkpoint = tmp_path / "step-200"
    checkpoint.mkdir()

    argv = ["update-weights", "gpu-x", "--model-path", str(checkpoint)]
    result = tokenmill(argv, env, tmp_path)

    assert result.returncode == 1, result.stderr
    assert re.search(
        r"^gpu-x does not answer \(.*Connection refused.*\): start it .*; nothing was paused$",
        result.stderr, re.M,
    ), result.stderr  # fmt: skip
    assert server_json(env, tmp_path)["paused"] is False
    lines = result.stderr.splitlines()
    assert lines[-2:] == ["To update again:", shlex.join(["tokenmill", *argv])], lines


def test_a_refused_update_prints_the_whole_command_to_try_again(
    tmp_path: Path, emulator: EmulatorProcess
) -> None:
    data, env = registered(tmp_path, emulator.url)
    ledger_with_run(data, leased_on="gpu-x")
    checkpoint = tmp_path / "ckpt" / "step 200"  # a space: the command quotes it
    checkpoint.mkdir(parents=True)
    argv = ["update-weights", "gpu-x", "--model-path", str(checkpoint), "--weight-version",
            "step-200", "--drain-timeout-s", "120"]  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "ops", *argv], env=env, cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        # the checkpoint goes away while the update waits for gpu-x's items; then they go back
        wait_for("gpu-x paused", lambda: server_json(env, tmp_path)["paused"] is True, 60)
        checkpoint.rmdir()
        engine = database.make_engine(f"sqlite:///{data / 'ledger.sqlite3'}")
        with engine.begin() as conn:
            conn.execute(update(common.items).values(status="pending", server=None))
        engine.dispose()
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, err
    assert "gpu-x stays paused: the server refused the update: Failed to get weights" in err
    assert err.splitlines()[-2:] == ["To update again:", shlex.join(["tokenmill", *argv])], err
    assert server_json(env, tmp_path)["paused"] is True


def test_updated_but_still_paused_is_exit_status_3(
    tmp_path: Path, emulator: EmulatorProcess
) -> None:
    data, env = registered(tmp_path, emulator.url)
    ledger_with_run(data, pinned="step-100")  # r1 takes only step-100
    checkpoint = tmp_path / "step-200"
    checkpoint.mkdir()

    result = tokenmill(
        ["update-weights", "gpu-x", "--model-path", str(checkpoint), "--weight-version",
         "step-200"],
        env, tmp_path,
    )  # fmt: skip

    assert result.returncode == 3, result.stderr
    assert "gpu-x serves weight_version step-200; runs that take it: none" in result.stderr
    assert "it stays paused until a run takes these weights" in result.stderr
    assert server_json(env, tmp_path)["paused"] is True
    info = httpx.get(f"{emulator.url}/model_info", timeout=10).json()
    assert info["weight_version"] == "step-200"

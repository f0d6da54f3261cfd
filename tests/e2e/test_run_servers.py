"""`tokenmill run` through the real CLI: a --server that cannot be reached is named at once and
shown down for the true time it has been (never "ok"); Ctrl-C says what it waits for, a second
one stops at once, and the rerun takes back the dead run's leases at once."""

from __future__ import annotations

import json
import re
import shlex
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.exc import OperationalError

from app.ledger import common
from ops.emulator_proc import start_emulator
from tests.support.emulator import free_port
from tests.support.procs import clean_env, run_args, start_tokenmill, tokenmill, tokenmill_tty
from tests.support.rows import prompt_rows, write_rows

pytestmark = pytest.mark.e2e

WIDE = {"COLUMNS": "200"}  # the progress table's server names are not cut


def test_an_unreachable_server_is_named_and_shown_down(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    env = clean_env(tmp_path / "data", **WIDE)
    dead = f"http://127.0.0.1:{free_port()}"
    emulator = start_emulator(["--step-ms", "5", "--median-tokens", "20"])
    try:
        prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(40))
        argv = run_args(prompts, "r1", kimi_tokenizer_dir, [dead, emulator.url])
        run = tokenmill(argv, env, tmp_path)
    finally:
        emulator.stop()
    assert run.returncode == 0, run.stderr
    err = run.stderr
    assert err.count(f"cannot connect to --server {dead}: ") == 1, err
    assert "render server" not in err  # no --render-with was given
    dead_name = dead.removeprefix("http://")
    rows = [ln for ln in err.splitlines() if ln.strip().startswith(dead_name)]
    assert rows and all(" ok " not in ln for ln in rows), rows
    assert re.search(r"down \d+s", rows[-1]), rows[-1]
    good = [ln for ln in err.splitlines() if emulator.url.removeprefix("http://") in ln]
    assert any(ln.split()[1:2] == ["ok"] for ln in good), good
    # stderr is a file: plain lines, no redrawn frames; a server's line when its state changes
    assert "\x1b[" not in err and "\r" not in err
    assert len(rows) == len(set(rows)), rows
    assert re.search(r"^r1: \d+/40 finished, \d+ done", err, re.M), err


def test_on_a_terminal_of_80_columns_no_name_is_cut(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    run_name = "regenerate-kimi-k2.5-answers-r1"
    dead = f"http://127.0.0.1:{free_port()}"
    emulator = start_emulator(["--step-ms", "20", "--median-tokens", "20"])
    try:
        prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(40))
        argv = run_args(prompts, run_name, kimi_tokenizer_dir, [dead, emulator.url])
        code, lines = tokenmill_tty(argv, clean_env(tmp_path / "data"), tmp_path, columns=80)
    finally:
        emulator.stop()
    assert code == 0, "\n".join(lines)
    names = [run_name, dead.removeprefix("http://"), emulator.url.removeprefix("http://")]
    rows = [ln for ln in lines if any(ln.strip().startswith(n + " ") for n in names)]
    for name in names:
        assert any(ln.strip().startswith(name + " ") for ln in rows), (name, lines)
    assert all(len(ln) <= 80 for ln in rows), [ln for ln in rows if len(ln) > 80]
    finished = [ln for ln in rows if ln.startswith(run_name + " ")][-1]
    assert "finished" in finished and "40/40" in finished, finished


def leased(data_dir: Path) -> int:
    """Items leased in the embedded ledger (0 until `run` has made it)."""
    path = data_dir / "ledger.sqlite3"
    if not path.exists():
        return 0
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            stmt = select(func.count()).where(common.items.c.status == "leased")
            return int(conn.execute(stmt).scalar_one())
    except OperationalError:  # its tables are still being made
        return 0
    finally:
        engine.dispose()


def wait_for_text(path: Path, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text()
        if text in content:
            return content
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path}:\n{path.read_text()[-3000:]}")


def test_ctrl_c_twice_stops_at_once_and_the_rerun_takes_back_its_leases(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    data = tmp_path / "data"
    env = clean_env(data, **WIDE)
    prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(60))
    slow = start_emulator(["--step-ms", "500", "--median-tokens", "400"])
    args = ["run", str(prompts), "--run", "r1", "--tokenizer", str(kimi_tokenizer_dir)]
    err = tmp_path / "first.err"
    try:
        first = start_tokenmill(
            [*args, "--server", slow.url, "--max-new-tokens", "1000"], env, tmp_path, err
        )
        deadline = time.monotonic() + 120
        while leased(data) == 0 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.5)
        assert leased(data) > 0, err.read_text()
        first.send_signal(signal.SIGINT)
        said = wait_for_text(err, "interrupted: waiting up to 30s for the", 15)
        assert "Ctrl-C again to stop now" in said
        # the drain counts down (in a file: a line when it changes, and every 5 s)
        said = wait_for_text(err, "s left", 15)
        assert re.search(r"^draining: \d+ requests? in flight, \d+s left$", said, re.M), said
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=15) == 130
    finally:
        slow.stop()
    text = err.read_text()
    assert "stopped now" in text and "Aborted" not in text and "Traceback" not in text, text
    # the command that continues, whole on a line of its own after each message, as it was run
    again = "tokenmill " + shlex.join([*args, "--server", slow.url, "--max-new-tokens", "1000"])
    lines = text.splitlines()
    told = [i for i, ln in enumerate(lines) if ln.endswith("To continue the run:")]
    assert len(told) == 2, text
    assert all(lines[i + 1] == again for i in told), text
    held = leased(data)
    assert held > 0  # the dead process still holds them: its lease runs 300 s

    fast = start_emulator(["--step-ms", "1", "--median-tokens", "20"])
    try:
        # a rerun that waited out the 300 s lease would time out here
        rerun = tokenmill(
            [*args, "--server", fast.url, "--max-new-tokens", "1000"], env, tmp_path, timeout_s=200
        )
    finally:
        fast.stop()
    assert rerun.returncode == 0, rerun.stderr
    assert re.search(
        rf"took back {held} items of run r1 leased by an earlier `tokenmill run` \(pid \d+\)",
        rerun.stderr,
    ), rerun.stderr
    status = json.loads(tokenmill(["status", "r1", "--json"], env, tmp_path).stdout)
    assert status["done"] + status["failed"] == 60 and status["leased"] == 0, status

"""Real processes for end-to-end tests: the harness of ops.processes (the tokenmill CLI, celery
workers and beat, environments naming only the services the test chose, stopping them) with the
tests' defaults, a terminal for redrawn views, and waiting for what a test expects."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ops import processes
from ops.processes import ROOT as ROOT
from ops.processes import clean_env as clean_env
from ops.processes import start_celery as start_celery
from ops.processes import start_worker as start_worker
from ops.processes import stop as stop
from ops.processes import tokenmill as tokenmill


def service_env(pg_url: str, redis_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    """Settings for a distributed deployment on the test's Postgres and Redis, with the tests'
    small batches, window and heartbeat."""
    return processes.service_env(
        pg_url,
        redis_url,
        data_dir,
        TOKENMILL_BATCH_SIZE="4",
        TOKENMILL_INFLIGHT="8",
        TOKENMILL_HEARTBEAT_S="2",
        **extra,
    )


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def tokenmill_tty(
    args: list[str],
    env: dict[str, str],
    cwd: Path = ROOT,
    columns: int = 80,
    timeout_s: float = 300,
) -> tuple[int, list[str]]:
    """Run `tokenmill ARGS` on a terminal of `columns` (a pseudo-terminal for stdin, stdout and
    stderr, as a user's shell gives it): its exit status and the lines it drew, escape codes
    taken out (each frame a redrawn view drew is among them)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "ops", *args],
        env={**env, "COLUMNS": str(columns), "TERM": "xterm-256color"},
        cwd=cwd,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        start_new_session=True,
    )
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: every process on it exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    text = ANSI.sub("", b"".join(chunks).decode(errors="replace"))
    return code, [line.rstrip() for line in re.split(r"\r\n|\r|\n", text)]


def start_tokenmill(
    args: list[str], env: dict[str, str], cwd: Path, err: Path, *, piped: bool = False
) -> subprocess.Popen[str]:
    """`tokenmill ARGS` in the background, its stderr written to err; its stdout piped (piped,
    as text: read it with communicate) or dropped."""
    with err.open("w") as stderr_file:
        return subprocess.Popen(
            [sys.executable, "-m", "ops", *args],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE if piped else subprocess.DEVNULL,
            stderr=stderr_file,
            text=True,
        )


def run_args(prompts: Path, run: str, tokenizer: Path, servers: list[str]) -> list[str]:
    """`tokenmill run` of prompts against servers, 32 new tokens at most."""
    argv = ["run", str(prompts), "--run", run, "--tokenizer", str(tokenizer)]
    for url in servers:
        argv += ["--server", url]
    return [*argv, "--max-new-tokens", "32"]


def start_server_workers(
    env: dict[str, str], urls: list[str], folder: Path
) -> list[subprocess.Popen[bytes]]:
    """One worker per server URL: worker wI serves urls[I] as gpu-I, its log folder/workerI.log."""
    return [
        start_worker(
            env | {"TOKENMILL_SGLANG_URL": url, "TOKENMILL_SERVER_NAME": f"gpu-{i}"},
            f"w{i}",
            folder / f"worker{i}.log",
        )
        for i, url in enumerate(urls)
    ]


def wait_for(
    what: str, check: Callable[[], bool], timeout_s: float, explain: Callable[[], str] = str
) -> None:
    """Poll check until it holds; fail the test naming what never happened (and explain())."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for: {what} {explain()}"
        time.sleep(0.25)


def report_command(url: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The `report` click command in a real process, on the ledger at url."""
    return subprocess.run(
        [sys.executable, "-c", "from ops.report_cmd import report_cmd; report_cmd()", *args],
        env=clean_env(tmp / "data", TOKENMILL_DATABASE_URL=url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

"""An SGLang emulator process (`python -m emulator`) started, awaited and stopped: the one harness
of the demo, the benchmarks and the tests (which add their config-to-flags step in
tests/support/emulator.py). It lives in ops because the demo needs it and bench may import ops.

The emulator prints `listening on http://HOST:PORT` once bound; `start_emulator` then waits for
/ready. Output lines are collected as they come, so a caller can wait for one.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx

from app.core.errors import TokenmillError
from app.core.settings import child_environment

LISTENING_PREFIX = "listening on "
LISTENING = re.compile(r"listening on (http://\S+)")


class EmulatorProcess:
    """A running `python -m emulator`; its stdout (and stderr, when captured) lines are collected
    as they come."""

    def __init__(
        self,
        popen: subprocess.Popen[str],
        host: str = "127.0.0.1",
        port: int | None = None,
        api_key: str | None = None,
    ) -> None:
        self.popen = popen
        self.host = host
        self.port = port
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._changed = threading.Condition()
        for stream, lines in ((popen.stdout, self.stdout), (popen.stderr, self.stderr)):
            if stream is not None:
                threading.Thread(target=self._pump, args=(stream, lines), daemon=True).start()

    def _pump(self, stream: IO[str], lines: list[str]) -> None:
        with stream:  # closed at the end of the output, which the process's exit brings
            for line in stream:
                with self._changed:
                    lines.append(line.rstrip("\n"))
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the emulator has not bound its port yet")
        return f"http://{self.host}:{self.port}"

    def wait_for_line(self, text: str, timeout_s: float = 20.0, *, stderr: bool = False) -> str:
        """The first output line containing `text` (stdout, or stderr where the logs go)."""
        lines = self.stderr if stderr else self.stdout
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for line in lines:
                    if text in line:
                        return line
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.popen.poll() is not None:
                    raise TimeoutError(
                        f"no line with {text!r} (exit {self.popen.poll()}); "
                        f"stderr tail: {self.stderr[-5:]}"
                    )
                self._changed.wait(min(remaining, 0.1))

    def wait_listening(self, timeout_s: float = 20.0) -> int:
        """The port the emulator bound, once it says so (its host too, as it says it)."""
        line = self.wait_for_line(LISTENING_PREFIX, timeout_s)
        match = LISTENING.search(line)
        address = match.group(1).rstrip("/") if match else line
        host, port = address.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host or self.host, int(port)
        return self.port

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Until GET /ready answers 200 (after startup delay and warmup)."""
        deadline = time.monotonic() + timeout_s
        if self.port is None:
            self.wait_listening(timeout_s)
        while True:
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get(self.url + "/ready", timeout=1.0, headers=self.headers)
                if ready.status_code == 200:
                    return
            if time.monotonic() > deadline or self.popen.poll() is not None:
                raise TimeoutError(f"emulator not ready; stderr tail: {self.stderr[-5:]}")
            time.sleep(0.02)

    def terminate(self) -> None:
        """SIGTERM: the graceful shutdown (drain, then exit 0)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited in time; returns the exit code."""
        self.terminate()
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


def launch_emulator(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    api_key: str | None = None,
    capture_stderr: bool = True,
) -> EmulatorProcess:
    """Start `python -m emulator ARGS` (in cwd; None: this process's); does not wait. port: the one
    ARGS bind (None: read from its `listening on` line); capture_stderr: keep its log lines
    (else they are dropped: a long-lived emulator's logs would grow without end)."""
    popen = subprocess.Popen(
        [sys.executable, "-m", "emulator", *args],
        cwd=cwd,
        env=child_environment(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if capture_stderr else subprocess.DEVNULL,
        text=True,
    )
    return EmulatorProcess(popen, host, port, api_key)


def start_emulator(args: Sequence[str], *, ready_timeout_s: float = 60.0) -> EmulatorProcess:
    """Run `python -m emulator --port 0 ARGS`, wait until it answers /ready."""
    emulator = launch_emulator(["--port", "0", *args], capture_stderr=False)
    deadline = time.monotonic() + ready_timeout_s
    try:
        emulator.wait_listening(ready_timeout_s)
    except TimeoutError:
        emulator.popen.kill()
        emulator.popen.wait()
        raise TokenmillError("the SGLang emulator did not start") from None
    try:
        emulator.wait_ready(max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        emulator.stop()
        raise TokenmillError(f"the SGLang emulator at {emulator.url} never became ready") from None
    return emulator

"""Run the SGLang emulator for a test: `python -m emulator` in a subprocess, killed afterwards.

`running_emulator(cfg)` yields an `EmulatorProcess` (base_url, popen, captured output) once ready;
`config_flags(cfg)` turns an EmulatorConfig into the matching command-line flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx

from emulator.config import EmulatorConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
LISTENING_PREFIX = "listening on "
READY_LOG_LINE = "The server is fired up and ready to roll!"
_DEFAULTS = EmulatorConfig()
# config fields that are not flags (fixed facts of the emulated model)
_NOT_FLAGS = {"model_type", "architectures", "vocab_size"}


def config_flags(cfg: EmulatorConfig) -> list[str]:
    """The flags that make `python -m emulator` run with this config (non-defaults only)."""
    flags: list[str] = []
    for field in dataclasses.fields(EmulatorConfig):
        name = field.name
        value = getattr(cfg, name)
        if name in _NOT_FLAGS or value == getattr(_DEFAULTS, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, "none" if value is None else str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmulatorProcess:
    """A running `python -m emulator`; stdout and stderr lines are collected as they come."""

    def __init__(
        self, popen: subprocess.Popen[str], host: str, port: int | None, api_key: str | None = None
    ) -> None:
        self.popen = popen
        self.host = host
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.port = port
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._changed = threading.Condition()
        for stream, lines in ((popen.stdout, self.stdout), (popen.stderr, self.stderr)):
            threading.Thread(target=self._pump, args=(stream, lines), daemon=True).start()

    def _pump(self, stream: object, lines: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._changed:
                lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def base_url(self) -> str:
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
        line = self.wait_for_line(LISTENING_PREFIX, timeout_s)
        self.port = int(line.rsplit(":", 1)[1])
        return self.port

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Until GET /ready answers 200 (after startup delay and warmup)."""
        deadline = time.monotonic() + timeout_s
        if self.port is None:
            self.wait_listening(timeout_s)
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (
                    httpx.get(
                        self.base_url + "/ready", timeout=1.0, headers=self.headers
                    ).status_code
                    == 200
                ):
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


def start_emulator(
    cfg: EmulatorConfig | None = None,
    *extra_flags: str,
    env: Mapping[str, str] | None = None,
) -> EmulatorProcess:
    """Start `python -m emulator` (port 0 unless the config names one); does not wait."""
    cfg = cfg or EmulatorConfig(port=0)
    command = [sys.executable, "-m", "emulator", *config_flags(cfg), *extra_flags]
    port: int | None = cfg.port or None
    if cfg.port == _DEFAULTS.port and "--port" not in extra_flags:
        command += ["--port", "0"]  # never the real default port in a test
        port = None
    popen = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return EmulatorProcess(popen, cfg.host, port, cfg.api_key)


@contextlib.contextmanager
def running_emulator(
    cfg: EmulatorConfig | None = None,
    *extra_flags: str,
    env: Mapping[str, str] | None = None,
    wait: str = "ready",
    timeout_s: float = 30.0,
) -> Iterator[EmulatorProcess]:
    """An emulator subprocess for the duration of the block; `wait`: ready | listening | none."""
    process = start_emulator(cfg, *extra_flags, env=env)
    try:
        if wait == "ready":
            process.wait_ready(timeout_s)
        elif wait == "listening":
            process.wait_listening(timeout_s)
        yield process
    finally:
        if process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait()

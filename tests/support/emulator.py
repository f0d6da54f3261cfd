"""Run the SGLang emulator for a test: `python -m emulator` in a subprocess, killed afterwards.

`running_emulator(cfg)` yields an `EmulatorProcess` (ops.emulator_proc's: url, popen, captured
output) once ready; `config_flags(cfg)` turns an EmulatorConfig into the matching command-line
flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path

from emulator.config import EmulatorConfig
from ops.emulator_proc import EmulatorProcess as EmulatorProcess
from ops.emulator_proc import launch_emulator

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


def start_emulator(
    cfg: EmulatorConfig | None = None,
    *extra_flags: str,
    env: Mapping[str, str] | None = None,
) -> EmulatorProcess:
    """Start `python -m emulator` (port 0 unless the config names one); does not wait."""
    cfg = cfg or EmulatorConfig(port=0)
    command = [*config_flags(cfg), *extra_flags]
    port: int | None = cfg.port or None
    if cfg.port == _DEFAULTS.port and "--port" not in extra_flags:
        command += ["--port", "0"]  # never the real default port in a test
        port = None
    return launch_emulator(
        command, env=env, cwd=REPO_ROOT, host=cfg.host, port=port, api_key=cfg.api_key
    )


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

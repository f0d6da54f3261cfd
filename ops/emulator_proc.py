"""Starting and stopping an SGLang emulator process from the CLI (demo, restart templates).

The emulator prints `listening on http://HOST:PORT` once bound; we wait for /ready.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from app.core.errors import TokenmillError

LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass
class EmulatorProcess:
    url: str
    process: subprocess.Popen[str]

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_emulator(args: Sequence[str], *, ready_timeout_s: float = 60.0) -> EmulatorProcess:
    """Run `python -m emulator --port 0 ARGS`, wait until it answers /ready."""
    cmd = [sys.executable, "-m", "emulator", "--port", "0", *args]
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1
    )
    found: list[str] = []
    seen = threading.Event()

    def read_stdout() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            match = LISTENING.search(line)
            if match and not found:
                found.append(match.group(1).rstrip("/"))
                seen.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    deadline = time.monotonic() + ready_timeout_s
    if not seen.wait(ready_timeout_s) or process.poll() is not None:
        process.kill()
        raise TokenmillError("the SGLang emulator did not start")
    emulator = EmulatorProcess(url=found[0], process=process)
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{emulator.url}/ready", timeout=2.0).status_code == 200:
                return emulator
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    emulator.stop()
    raise TokenmillError(f"the SGLang emulator at {emulator.url} never became ready")

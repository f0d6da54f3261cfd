"""Start SGLang 0.5.23's own HTTP server with the fake scheduler (`server.py`) for a test.

What it needs is fetched on first use and kept under `<repo>/.cache`: the wheel (the one the
oracle tests use, `sglang_contract._wheel`), its `sglang/` package extracted next to it, and the
server's own pure-Python dependencies that tokenmill does not install (FastAPI, uvicorn, pyzmq,
...), installed by pip into `.cache/sglang-server-deps` (`make sglang-server-deps`). They come
after the venv on the server's path, so the venv's versions win where both have a package.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.sglang_contract import CACHE_DIR, REPO_ROOT, SGLANG_VERSION, _wheel

SOURCE_DIR = CACHE_DIR / f"src-{SGLANG_VERSION}"
DEPS_DIR = REPO_ROOT / ".cache" / "sglang-server-deps"
# what SGLang's server process imports that tokenmill's venv does not have (the GPU stack and
# the model-side packages are stubbed instead: stubs.STUBBED)
SERVER_DEPS = (
    "fastapi",
    "uvicorn",
    "uvloop",
    "pyzmq",
    "setproctitle",
    "psutil",
    "pybase64",
    "python-multipart",
    "partial_json_parser",
    "distro",
)
READY_TIMEOUT_S = 240.0


def sglang_source() -> Path:
    """The folder holding the wheel's `sglang` package, extracted on first use."""
    if (SOURCE_DIR / "sglang" / "__init__.py").exists():
        return SOURCE_DIR
    wheel_file = _wheel(CACHE_DIR, SGLANG_VERSION)  # downloaded on a fresh clone
    staging = Path(tempfile.mkdtemp(dir=CACHE_DIR, prefix="src-part-"))
    with zipfile.ZipFile(wheel_file) as wheel:
        members = [m for m in wheel.namelist() if m.startswith("sglang/")]
        wheel.extractall(staging, members)
    try:
        staging.rename(SOURCE_DIR)
    except OSError:  # another test process won the race
        shutil.rmtree(staging, ignore_errors=True)
    return SOURCE_DIR


def server_deps() -> Path:
    """DEPS_DIR with SERVER_DEPS in it, installed by pip from the package index on first use."""
    stamp = DEPS_DIR / ".installed"
    if stamp.exists():
        return DEPS_DIR
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--target", str(DEPS_DIR), *SERVER_DEPS,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"could not install {SERVER_DEPS} into {DEPS_DIR}: {result.stderr}")
    stamp.write_text(" ".join(SERVER_DEPS) + "\n")
    return DEPS_DIR


def model_folder(tokenizer_dir: Path, out: Path) -> Path:
    """A copy of a tokenizer folder whose config.json SGLang's ModelConfig accepts: a small
    Llama's shape around the folder's own ids and context length (no weights: the fake
    scheduler is the model)."""
    shutil.copytree(tokenizer_dir, out, dirs_exist_ok=True)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.update(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
    )
    config_path.write_text(json.dumps(config, indent=1) + "\n")
    return out


@dataclass
class SGLangServer:
    base_url: str
    popen: subprocess.Popen[bytes]
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(**extra: str) -> dict[str, str]:
    paths = [str(sglang_source()), str(REPO_ROOT)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["HARNESS_SGLANG_DEPS"] = str(server_deps())
    env.update(extra)
    return env


@contextlib.contextmanager
def running_sglang_server(
    model: Path, log: Path, *flags: str, env: dict[str, str] | None = None, port: int = 0
) -> Iterator[SGLangServer]:
    """SGLang's server on `port` (0: a free one) with `flags` (SGLang's own), ready (/health
    200) when yielded; SIGTERM then SIGKILL to its process group afterwards."""
    port = port or free_port()
    argv = [
        sys.executable, "-m", "tests.support.sglang_http.server",
        "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--skip-server-warmup", "--log-level", "warning", *flags,
    ]  # fmt: skip
    with log.open("ab") as out:
        popen = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env or server_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = SGLangServer(f"http://127.0.0.1:{port}", popen, log)
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)


def wait_ready(server: SGLangServer, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.popen.poll() is not None:
            raise RuntimeError(f"SGLang server exited: {server.log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"SGLang server not ready in {timeout_s}s: {server.log.read_text()[-4000:]}")


def stop(server: SGLangServer) -> None:
    if server.popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.popen.pid, signal.SIGTERM)
    try:
        server.popen.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.popen.pid, signal.SIGKILL)
        server.popen.wait(timeout=10)

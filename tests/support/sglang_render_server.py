"""SGLang 0.5.23's own /v1/tokenize over HTTP, for a tokenizer folder: `SGLangServer` (the wheel's
chat path, its encoder dispatch included: a DeepSeek-V3.2 folder renders with `encoding_dsv32`)
behind a small HTTP server, so `tokenmill enqueue --render-with` can be pointed at it.

`render_server(folder)` starts it in a process of its own under transformers 5.19.0 (the
version SGLang pins; `make transformers-519`) and yields its URL. Answers: POST /v1/tokenize
(200 `{"tokens", "count", "max_model_len"}`, a refusal 400 with SGLang's error object), POST
/v1/detokenize, GET /server_info (`{"version"}`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.support.sglang_contract import SGLANG_VERSION
from tests.support.sglang_server import TRANSFORMERS_519, SGLangServer

ROOT = Path(__file__).resolve().parents[2]


def _handler(server: SGLangServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path in ("/server_info", "/get_server_info"):
                self._answer(200, {"version": SGLANG_VERSION})
            elif self.path == "/health":
                self._answer(200, {})
            else:
                self._answer(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path in ("/v1/tokenize", "/tokenize"):
                ids = server.tokenize(body)
                if isinstance(ids, str):
                    error = {"object": "error", "message": ids, "type": "BadRequest", "code": 400}
                    self._answer(400, error)
                    return
                self._answer(200, {"tokens": ids, "count": len(ids), "max_model_len": None})
            elif self.path in ("/v1/detokenize", "/detokenize"):
                rows = body.get("tokens") or []
                skip = bool(body.get("skip_special_tokens", True))
                texts = [server.tokenizer.decode(r, skip_special_tokens=skip) for r in rows]
                self._answer(200, {"text": texts})
            else:
                self._answer(404, {"detail": "Not Found"})

    return Handler


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def render_server(folder: Path, *, timeout_s: float = 120.0) -> Iterator[str]:
    """The URL of SGLang's /v1/tokenize for folder, served by a child process until exit."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{TRANSFORMERS_519}{os.pathsep}{ROOT}"}
    import transformers

    if transformers.__version__ != "5.19.0" and not (TRANSFORMERS_519 / "transformers").is_dir():
        raise RuntimeError(
            f"transformers 5.19.0 is not in {TRANSFORMERS_519}: make transformers-519"
        )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.sglang_render_server", str(folder), str(port)],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the render server exited: {proc.stderr.read().decode()[-3000:]}"
                )  # type: ignore[union-attr]
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the render server did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=10)  # waits and closes its stderr pipe


if __name__ == "__main__":
    import transformers

    assert transformers.__version__ == "5.19.0", transformers.__version__
    instance = SGLangServer(Path(sys.argv[1]))
    httpd = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), _handler(instance))
    httpd.serve_forever()

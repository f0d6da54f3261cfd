"""`python -m tests.support.sglang_http.server SGLANG-FLAGS...`: SGLang 0.5.23's own HTTP server
(`sglang.srt.entrypoints.http_server.launch_server`) from the extracted wheel, its scheduler
replaced by `fake_scheduler.run_fake_scheduler`. The flags are SGLang's (`prepare_server_args`).

Importing this module sets up the path and the stubs; SGLang's spawned subprocesses import it
first too (multiprocessing re-imports the main module), so they see the same.
"""

from __future__ import annotations

import os
import sys

# the server's own dependencies come after the venv's packages: the venv's versions win
_deps = os.environ.get("HARNESS_SGLANG_DEPS")
if _deps and _deps not in sys.path:
    sys.path.append(_deps)
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from tests.support.sglang_http import stubs  # noqa: E402

stubs.install()

from tests.support.sglang_http import fake_scheduler  # noqa: E402


def main() -> None:
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    launch_server(
        prepare_server_args(sys.argv[1:]),
        run_scheduler_process_func=fake_scheduler.run_fake_scheduler,
    )


if __name__ == "__main__":
    main()

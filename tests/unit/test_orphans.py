"""Which lease owners a rerun of `tokenmill run` may take back: its own kind (the embedded
runner's), on this host, whose process is gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from workers.engine.orphans import EMBEDDED_OWNER_PREFIX, embedded_owner_pid, process_gone
from workers.engine.runtime import make_owner


def test_only_the_embedded_runner_s_owners_on_this_host_are_its_own() -> None:
    here = socket.gethostname()
    embedded = make_owner(EMBEDDED_OWNER_PREFIX + "127.0.0.1:30000")
    assert embedded_owner_pid(embedded) == os.getpid()
    assert embedded_owner_pid(make_owner("gpu-a")) is None  # a Celery worker's
    assert embedded_owner_pid(f"{here}x:123:run/gpu-a:abcd") is None  # another host's
    assert embedded_owner_pid(f"{here}:notapid:run/gpu-a:abcd") is None


def test_a_finished_process_is_gone_and_a_running_one_is_not() -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                           capture_output=True, check=True)  # fmt: skip
    assert process_gone(int(child.stdout))  # exited and reaped
    assert not process_gone(os.getpid())
    assert not process_gone(1)  # init: alive, maybe another user's

"""The README's fleet commands as printed, run for real: read from a section's bash blocks, with
only hosts, ports and paths substituted, on emulated GPU nodes of this machine.

Each node is a TOKENMILL_NODE_NAME, a working folder and an emulator run as the unit
`sglang@PORT` by test doubles of `ssh`, `sudo` and `systemctl` put first on PATH, so restart
commands like `ssh {host} sudo systemctl restart sglang@{port}` run as written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from threading import Event, Thread

import httpx
from sqlalchemy import Engine

from app.ledger import counters, registry
from tests.support.procs import ROOT, stop, wait_for

README_PORT = "30000"  # the SGLang port the READMEs print
METRICS_PORT = "9464"  # the exporter's port they print

# The doc sections whose bash commands a test runs as printed, all of them but NOT_RUN's and
# RUN_APART's: (doc, `## ` heading it starts with, None for the text before the first) → the test.
FLEET_TEST = "tests/e2e/test_readme_fleet.py"
GUIDES_TEST = "tests/e2e/test_guides_as_printed.py"
RUN_AS_PRINTED: dict[tuple[str, str | None], str] = {
    ("README.md", None): "tests/e2e/test_cli.py (tokenmill demo and the commands it prints)",
    ("README.md", "Distributed"): FLEET_TEST,
    ("README.md", "One machine"): GUIDES_TEST,
    ("docs/restarts.md", None): FLEET_TEST,
    ("docs/rendering.md", None): f"{FLEET_TEST} (beside the ops fleet's r1)",
    ("docs/commands.md", None): GUIDES_TEST,
    ("docs/drafts.md", None): GUIDES_TEST,
    ("docs/weights.md", None): GUIDES_TEST,
    **{
        ("ops/README.md", heading): FLEET_TEST
        for heading in (
            None,
            "Start a fleet",
            "Watch a run",
            "A server needs a restart",
            "Redis is down",
            "Pause for maintenance",
            "Check that the servers render",
            "Export",
            "Verify a run",
            "Compaction",
            "Archive",
            "Metrics",
        )
    },
    ("ops/README.md", "A run is urgent"): "tests/e2e/test_fleet_priority.py",
    ("ops/README.md", "A server fails everything"): "tests/e2e/test_misconfigured_server.py",
    ("ops/README.md", "Logs"): GUIDES_TEST,
    ("ops/README.md", "Load new weights"): GUIDES_TEST,
}
# commands of those sections that another test runs as printed, not the section's: (doc, line
# as printed) → the test
RUN_APART: dict[tuple[str, str], str] = {
    (
        "ops/README.md",
        "tokenmill restart gpu-a:30000 --command 'ssh {host} sudo systemctl restart "
        "sglang@{port}' --timeout-s 3600   # none registered, or another one this time",
    ): f"{GUIDES_TEST} (the draft switch: its servers were registered by their workers)",
    (
        "ops/README.md",
        "tokenmill export r1 --format parquet --out ./r1-step-100 --weight-version "
        "step-100  # one version",
    ): f"{GUIDES_TEST} (its r1 was served by weights step-100)",
}
# commands of those sections no test runs: (doc, line as printed) → why
NOT_RUN: dict[tuple[str, str], str] = {
    (
        "README.md",
        "make test                              # installs the dev extra if needed; "
        "lint, mypy --strict, the whole suite",
    ): "the whole suite itself: .ci/run runs it on a fresh clone",
}

ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
NODE_COMMENT = re.compile(r"^on (each GPU node|[\w.-]+)\b")


@dataclass
class Command:
    """One command of a README block: its environment assignments, its argv, and the node it
    runs on ("each" for every node, None for the operator's machine)."""

    text: str
    env: dict[str, str]
    argv: list[str]
    node: str | None

    @property
    def long_running(self) -> bool:
        words = self.argv
        celery = words[:1] == ["celery"] and ("worker" in words or "beat" in words)
        return celery or words[:2] in (["tokenmill", "flower"], ["tokenmill", "metrics"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def section_blocks(markdown: str, heading: str | None) -> list[str]:
    """The bash blocks of the section whose `##` heading starts with heading (None: the text
    before the first section)."""
    lines = markdown.splitlines()
    if heading is None:
        start = -1
    else:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"## {heading}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    text = "\n".join(lines[start + 1 : end])
    blocks: list[str] = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    assert blocks, f"no bash block under {heading!r}"
    return blocks


def commands(block: str) -> list[Command]:
    """A bash block's commands: continued lines joined, comments dropped; a comment line
    `# on gpu-a ...` (or `# on each GPU node`) names the node of the commands below it, any
    other comment line the operator's machine; a trailing `# on ...` names its command's."""
    out: list[Command] = []
    context: str | None = None
    text = re.sub(r"\\\n\s*", " ", block)
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            context = _node(line.lstrip("# "))
            continue
        words = shlex.split(line, comments=True)
        node = _node(_trailing_comment(line)) or context
        env = {}
        while words and ASSIGNMENT.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        out.append(Command(text=line, env=env, argv=words, node=node))
    return out


def _node(comment: str) -> str | None:
    match = NODE_COMMENT.match(comment)
    if match is None:
        return None
    return "each" if match.group(1) == "each GPU node" else match.group(1).rstrip(",:")


def _trailing_comment(line: str) -> str:
    """The comment after a command: the text after the first ` #` outside quotes."""
    quote: str | None = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i and line[i - 1] == " ":
            return line[i + 1 :].strip()
    return ""


SYSTEMCTL = '''#!{python}
"""systemctl for the test: `systemctl start|stop|restart sglang@PORT` runs the emulator unit
described by $TOKENMILL_TEST_UNITS/sglang@PORT.json."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

units = Path(os.environ["TOKENMILL_TEST_UNITS"])
action, unit = sys.argv[1], sys.argv[2]
# as on the GPU node: reached over ssh (sshd sets SSH_CONNECTION), as root (sudo sets SUDO_USER)
if "SSH_CONNECTION" not in os.environ:
    sys.exit("systemctl: no unit " + unit + " on this machine (the servers run on the GPU nodes)")
if "SUDO_USER" not in os.environ:
    sys.exit("systemctl: Access denied (restarting " + unit + " needs sudo)")
spec = json.loads((units / (unit + ".json")).read_text())
pidfile = units / (unit + ".pid")


def gone(pid):
    try:
        return Path(f"/proc/{{pid}}/stat").read_text().split(") ")[1][0] in "ZX"
    except (OSError, IndexError):
        return True


if action in ("stop", "restart") and pidfile.exists():
    pid = int(pidfile.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 15
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not gone(pid):
        os.kill(pid, signal.SIGKILL)
    pidfile.unlink()
if action in ("start", "restart"):
    with open(spec["log"], "ab") as log:
        proc = subprocess.Popen(
            spec["argv"], cwd=spec["cwd"], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    pidfile.write_text(str(proc.pid))
'''
# ssh HOST COMMAND...: the test's nodes are this machine, at 127.0.0.1, or localhost where a
# worker registered its server by its own loopback URL (a fleet on one machine)
SSH = """#!/bin/sh
case "$1" in
  127.0.0.1|localhost) ;;
  *) echo "ssh: Could not resolve hostname $1" >&2; exit 255 ;;
esac
host=$1; shift
export SSH_CONNECTION="127.0.0.1 50000 $host 22"
exec "$@"
"""
SUDO = '#!/bin/sh\nexport SUDO_USER="${USER:-root}"\nexec "$@"\n'


@dataclass
class Fleet:
    """Emulated GPU nodes (name → SGLang port) and the operator's machine, each with its own
    working folder, sharing the test's Postgres and Redis."""

    root: Path
    db: Engine
    nodes: dict[str, int]
    database_url: str
    broker_url: str
    paths: dict[str, str]
    emulator_flags: list[str]
    flower_port: int
    metrics_port: int = field(default_factory=free_port)  # the docs' 9464
    # a node's own flags after emulator_flags (the later of a flag given twice wins)
    node_flags: dict[str, list[str]] = field(default_factory=dict)
    exports: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.bin = self.root / "bin"
        self.units = self.root / "units"
        for folder in (self.bin, self.units, *(self.home(n) for n in [None, *self.nodes])):
            folder.mkdir(parents=True, exist_ok=True)
        for name, text in (
            ("systemctl", SYSTEMCTL.format(python=sys.executable)),
            ("ssh", SSH),
            ("sudo", SUDO),
        ):
            path = self.bin / name
            path.write_text(text)
            path.chmod(0o755)

    @classmethod
    def on_test_services(
        cls,
        root: Path,
        db: Engine,
        pg_url: str,
        redis_url: str,
        nodes: tuple[str, ...],
        paths: dict[str, str],
        emulator_flags: list[str],
    ) -> Fleet:
        """Nodes at free ports, on the test's Postgres (db, at pg_url) and Redis."""
        return cls(
            root=root,
            db=db,
            nodes={node: free_port() for node in nodes},
            database_url="postgresql://" + pg_url.split("://", 1)[1],
            broker_url=redis_url,
            paths=paths,
            emulator_flags=emulator_flags,
            flower_port=free_port(),
        )

    def home(self, node: str | None) -> Path:
        return self.root / (node or "operator")

    # --- the SGLang servers ------------------------------------------------------------------

    def systemctl(self, action: str, port: int) -> None:
        done = subprocess.run(
            [
                str(self.bin / "ssh"),
                "127.0.0.1",
                str(self.bin / "sudo"),
                "systemctl",
                action,
                f"sglang@{port}",
            ],
            env=self.env(None),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr

    def write_units(self, *nodes: str) -> None:
        """The unit `sglang@PORT` of each of nodes (all by default): the emulator with
        emulator_flags and the node's own, as an operator edits a unit's flags (its next start
        or restart runs them)."""
        for node in nodes or self.nodes:
            port = self.nodes[node]
            spec = {
                "argv": [
                    sys.executable,
                    "-m",
                    "emulator",
                    "--port",
                    str(port),
                    *self.emulator_flags,
                    *self.node_flags.get(node, []),
                ],
                "cwd": str(ROOT),
                "log": str(self.root / f"sglang-{node}.log"),
            }
            (self.units / f"sglang@{port}.json").write_text(json.dumps(spec))

    def start_servers(self) -> None:
        self.write_units()
        for port in self.nodes.values():
            self.systemctl("start", port)
        for node, port in self.nodes.items():
            wait_for(f"the server of {node}", lambda p=port: self.ready(p), 60)

    @staticmethod
    def ready(port: int) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def stop_servers(self) -> None:
        for port in self.nodes.values():
            self.systemctl("stop", port)

    # --- running the commands -----------------------------------------------------------------

    def env(self, node: str | None) -> dict[str, str]:
        """A machine's environment: no TOKENMILL_* but the exports; PATH starts with the test
        doubles; a node also has its TOKENMILL_NODE_NAME."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(ROOT)
        env["TOKENMILL_TEST_UNITS"] = str(self.units)
        env["TOKENMILL_FLOWER_PORT"] = str(self.flower_port)
        env["TOKENMILL_METRICS_PORT"] = str(self.metrics_port)
        env["COLUMNS"] = "200"  # a wide terminal: tables show whole URLs
        env.update(self.exports)
        if node is not None:
            env["TOKENMILL_NODE_NAME"] = node
        return env

    def substitute(self, text: str, node: str | None) -> str:
        """Only hosts, ports and paths: the services' URLs, each `gpu-X:30000` (a URL's host
        becomes 127.0.0.1, a server name keeps its node), a node's own localhost:30000, the
        exporter's `--port 9464`, and the files named in paths."""
        for printed, actual in (
            ("postgresql://tokenmill@db-host/tokenmill", self.database_url),
            ("redis://redis-host:6379/0", self.broker_url),
        ):
            text = text.replace(printed, actual)
        for name, port in self.nodes.items():
            text = text.replace(f"http://{name}:{README_PORT}", f"http://127.0.0.1:{port}")
            text = text.replace(f"{name}:{README_PORT}", f"{name}:{port}")
        if node is not None:
            text = text.replace(f"localhost:{README_PORT}", f"localhost:{self.nodes[node]}")
        if text == METRICS_PORT:  # `--port 9464`
            text = str(self.metrics_port)
        for printed, actual in self.paths.items():
            text = re.sub(rf"(?<![\w/.-]){re.escape(printed)}(?![\w/.-])", actual, text)
        return text

    def run(self, command: Command) -> list[subprocess.CompletedProcess[str]]:
        """Run a command on its node(s): exports set the environment of every later command;
        long-running commands start in the background (`self.procs`), on every node before
        they are waited for, as an operator starts them on each node at once."""
        if command.argv[:1] == ["export"]:
            for assignment in command.argv[1:]:
                name, value = self.substitute(assignment, None).split("=", 1)
                self.exports[name] = value
            return []
        nodes = list(self.nodes) if command.node == "each" else [command.node]
        if command.long_running:
            started = [self._start(command, node) for node in nodes]
            for key, proc, node in started:
                self._wait_up(key, proc, node)
            return []
        return [self._run_on(command, node) for node in nodes]

    def _argv(self, command: Command, node: str | None) -> tuple[dict[str, str], list[str]]:
        """The environment and argv of a command on a machine, substituted."""
        env = self.env(node)
        env.update({k: self.substitute(v, node) for k, v in command.env.items()})
        argv = [self.substitute(a, node) for a in command.argv]
        return env, argv

    @staticmethod
    def _program(argv: list[str]) -> list[str]:
        program = {
            "tokenmill": [sys.executable, "-m", "ops"],
            "celery": [sys.executable, "-m", "celery"],
        }
        return [*program.get(argv[0], [argv[0]]), *argv[1:]]

    def _start(
        self, command: Command, node: str | None
    ) -> tuple[str, subprocess.Popen[bytes], str | None]:
        env, argv = self._argv(command, node)
        key = f"{node or 'operator'}: {' '.join(argv[:4])}"
        self.logs[key] = self.root / (re.sub(r"\W+", "-", key) + ".log")
        with self.logs[key].open("wb") as log:
            proc = self.procs[key] = subprocess.Popen(
                self._program(argv),
                env=env,
                cwd=self.home(node),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return key, proc, node if "worker" in argv else None

    def _run_on(self, command: Command, node: str | None) -> subprocess.CompletedProcess[str]:
        done = self.attempt(command, node)
        assert done.returncode == 0, f"{command.text!r} on {node or 'operator'}: {done.stderr}"
        return done

    def attempt(
        self, command: Command, node: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command on a machine (the operator's by default) and return how it
        ended, whatever its exit status."""
        env, argv = self._argv(command, node)
        return subprocess.run(
            self._program(argv),
            env=env,
            cwd=self.home(node),
            capture_output=True,
            text=True,
            timeout=600,
        )

    def _wait_up(self, key: str, proc: subprocess.Popen[bytes], node: str | None) -> None:
        """As an operator would before the next command: a worker until the registry lists it
        for a server of its node, Flower until it answers."""

        def up() -> bool:
            assert proc.poll() is None, f"{key} exited {proc.returncode}: {self.log_tail()}"
            if node is not None:
                with self.db.connect() as conn:
                    servers = registry.list_servers(conn)
                return any(s.node == node and s.workers for s in servers)
            if "tokenmill metrics" in key:
                try:
                    url = f"http://127.0.0.1:{self.metrics_port}/metrics"
                    return httpx.get(url, timeout=2.0).status_code in (200, 401)
                except httpx.TransportError:
                    return False
            if key.endswith("tokenmill flower"):
                try:
                    url = f"http://127.0.0.1:{self.flower_port}/healthcheck"
                    return httpx.get(url, timeout=2.0).status_code == 200
                except httpx.TransportError:
                    return False
            return True

        wait_for(f"{key} to be up", up, 120, self.log_tail)

    @contextmanager
    def serving(self) -> Iterator[Fleet]:
        """The servers started; on exit every process stopped and the logs' tails printed."""
        self.start_servers()
        try:
            yield self
        finally:
            self.stop_all()
            print(self.log_tail())

    def stop_all(self) -> None:
        stop(list(self.procs.values()), timeout_s=60)
        self.stop_servers()

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {key}\n{path.read_text(errors='replace')[-chars:]}"
            for key, path in self.logs.items()
        )


@contextmanager
def in_flight_samples(db: Engine, server: str, period_s: float = 0.2) -> Iterator[list[int]]:
    """The items leased to server, sampled every period_s while the block runs."""
    samples: list[int] = []
    done = Event()

    def sample() -> None:
        while not done.is_set():
            with db.connect() as conn:
                samples.append(counters.leased_by_server(conn).get(server, 0))
            done.wait(period_s)

    thread = Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join(timeout=10)


def flower_workers(port: int, password: str) -> dict[str, object]:
    """The workers Flower's API lists (alive ones)."""
    response = httpx.get(
        f"http://127.0.0.1:{port}/api/workers",
        params={"status": "true"},
        auth=("admin", password),
        timeout=10.0,
    )
    response.raise_for_status()
    return {k: v for k, v in response.json().items() if v}

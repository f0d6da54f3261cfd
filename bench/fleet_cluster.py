"""A private Postgres cluster for bench/fleet.py: its own data folder, port and WAL, so that
the WAL, commits, rows and CPU it counts are the benchmark's alone on a shared machine.

Imported as `fleet_cluster` by bench/fleet.py (the script's folder is first on sys.path).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine, create_engine, text

PG_BIN = Path(
    os.environ.get("TOKENMILL_BENCH_PG_BIN")
    or max(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name))
)
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class WalShare:
    """One kind of WAL record over an LSN range (pg_waldump --stats=record)."""

    kind: str  # e.g. "Heap/UPDATE", "Btree/INSERT_LEAF"
    records: int
    record_bytes: int
    fpi_bytes: int


class Cluster:
    """initdb, start, stop; the user postgres runs it when we are root (initdb refuses root)."""

    def __init__(self, settings: dict[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tm-bench-pg-"))
        self.data = self.folder / "data"
        self.port = free_port()
        self.settings = settings
        self.log = self.folder / "postgres.log"
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres")

    def _run(self, *argv: str) -> str:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run(
            [*prefix, *argv], capture_output=True, text=True, timeout=300, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout

    def start(self) -> None:
        self._run(str(PG_BIN / "initdb"), "-D", str(self.data), "--auth=trust", "--no-sync")
        options = " ".join(
            f"-c {k}={v}"
            for k, v in {
                "listen_addresses": "127.0.0.1",
                "port": str(self.port),
                "unix_socket_directories": str(self.folder),
                **self.settings,
            }.items()
        )
        pg_ctl = str(PG_BIN / "pg_ctl")
        self._run(pg_ctl, "start", "-D", str(self.data), "-w", "-l", str(self.log), "-o", options)

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(str(PG_BIN / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w")
        shutil.rmtree(self.folder, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def admin(self) -> Engine:
        return create_engine(self.url(), isolation_level="AUTOCOMMIT")

    def create_database(self, name: str) -> str:
        admin = self.admin()
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        return self.url(name)

    def cpu_s(self) -> float:
        """CPU seconds of the cluster so far: every live process of it, and the children the
        postmaster reaped (backends that ended)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        total = _proc_cpu_s(postmaster, children=True)
        for child in _children(postmaster):
            total += _proc_cpu_s(child, children=False)
        return total

    def wal_stats(self, start_lsn: str, end_lsn: str) -> list[WalShare]:
        """The WAL between two LSNs by record kind (pg_waldump reads the cluster's pg_wal)."""
        out = self._run(
            str(PG_BIN / "pg_waldump"),
            "--stats=record",
            "-p",
            str(self.data / "pg_wal"),
            "-s",
            start_lsn,
            "-e",
            end_lsn,
        )
        return parse_waldump_stats(out)


# "Heap/UPDATE   1234 ( 1.23)   56789 ( 4.56)   0 ( 0.00)   56789 ( 4.56)"
_STATS_LINE = re.compile(
    r"^(\S+/\S+)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)"
)


def parse_waldump_stats(out: str) -> list[WalShare]:
    shares = []
    for line in out.splitlines():
        match = _STATS_LINE.match(line.strip())
        if match:
            kind, records, record_bytes, fpi_bytes = match.groups()
            shares.append(WalShare(kind, int(records), int(record_bytes), int(fpi_bytes)))
    return shares


def _children(pid: int) -> list[int]:
    try:
        found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(p) for p in found]


def _proc_cpu_s(pid: int, *, children: bool) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime, stime (fields 14, 15), cutime, cstime (16, 17): after ") " the list starts at 3
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLK_TCK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port

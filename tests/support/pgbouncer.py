"""A private PgBouncer for a test: Debian's `pgbouncer` in transaction pooling, on a free port,
in front of the test session's Postgres database, with a generated ini and userlist."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tests.support.emulator import free_port
from tests.support.procs import wait_for

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
ALIAS = "tokenmill"  # the database name clients give; the ini maps it to the test's


def installed() -> bool:
    return Path(PGBOUNCER).is_file() and os.access(PGBOUNCER, os.X_OK)


@dataclass
class Bouncer:
    """A running PgBouncer: its clients' URL, its log and its ini's folder."""

    url: str
    log: Path
    folder: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def ini(pg_url: str, port: int, folder: Path, server_connections: int) -> str:
    """pgbouncer.ini: the alias → the test's database, transaction pooling, at most
    server_connections to Postgres whatever the clients; trust auth as the test's Postgres."""
    target = urlsplit(pg_url)
    database = target.path.lstrip("/")
    return f"""[databases]
{ALIAS} = host={target.hostname} port={target.port or 5432} dbname={database}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / "userlist.txt"}
pool_mode = transaction
default_pool_size = {server_connections}
max_db_connections = {server_connections}
reserve_pool_size = 0
max_client_conn = 1000
logfile = {folder / "pgbouncer.log"}
pidfile = {folder / "pgbouncer.pid"}
admin_users = {target.username}
"""


@contextmanager
def pgbouncer(pg_url: str, *, server_connections: int = 10) -> Iterator[Bouncer]:
    """PgBouncer in front of pg_url's database until the block ends; its clients' URL has the
    same user and driver. Root starts it as the postgres user (it refuses to run as root)."""
    folder = Path(tempfile.mkdtemp(prefix="tm-pgbouncer-"))
    folder.chmod(0o755)  # the postgres user reads the ini and writes the log here
    port = free_port()
    (folder / "pgbouncer.ini").write_text(ini(pg_url, port, folder, server_connections))
    user = urlsplit(pg_url).username or "postgres"
    (folder / "userlist.txt").write_text(f'"{user}" ""\n')
    argv = [PGBOUNCER, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
        argv[1:1] = ["-u", "postgres"]
    process = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=folder
    )
    scheme = pg_url.split("://", 1)[0]
    bouncer = Bouncer(
        f"{scheme}://{user}@127.0.0.1:{port}/{ALIAS}", folder / "pgbouncer.log", folder
    )
    try:

        def listening() -> bool:
            assert process.poll() is None, f"pgbouncer exited: {bouncer.log_text()}"
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for("pgbouncer to listen", listening, 30, bouncer.log_text)
        yield bouncer
    finally:
        process.send_signal(signal.SIGTERM)  # an immediate shutdown (SIGINT waits for clients)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)

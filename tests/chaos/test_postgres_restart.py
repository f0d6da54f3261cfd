"""Chaos: the ledger's Postgres (a private cluster of its own, never the shared one on 5432) is
restarted with `pg_ctl restart -m fast` mid-run: every open connection of the workers, beat and
the reconcile is cut, and for a few seconds nothing can connect. Workers must survive it (the
pool's pre-ping and the tasks' retries reconnect), and the run must finish without an operator:
every item done once, outputs equal to the emulator's, nothing failed, nothing lost."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from app.ledger import database
from tests.chaos.conftest import FAST_SETTINGS, Deployment, RedisServer, free_port, wait_for
from tests.support.procs import service_env, tokenmill

pytestmark = pytest.mark.chaos

ITEMS = 250
PG_BIN = Path("/usr/lib/postgresql/15/bin")
DB_NAME = "tokenmill_chaos"


class PgCluster:
    """A private Postgres 15 cluster on a free port, trust auth, run as the `postgres` user
    (initdb refuses root): data and socket dirs live in a fresh /tmp dir that user owns."""

    def __init__(self) -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="tokenmill-pg-"))
        self.data = self.root / "data"
        self.sock = self.root / "sock"
        self.log = self.root / "postgres.log"
        self.sock.mkdir()
        shutil.chown(self.root, "postgres", "postgres")
        shutil.chown(self.sock, "postgres", "postgres")
        os.chmod(self.root, 0o700)

    def admin_url(self, db: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{db}"

    def _as_postgres(self, *argv: str, timeout_s: float = 60) -> None:
        result = subprocess.run(
            ["runuser", "-u", "postgres", "--", *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert result.returncode == 0, f"{argv[0]} failed: {result.stdout}\n{result.stderr}"

    def _pg_ctl(self, action: str, *args: str, timeout_s: float = 60) -> None:
        opts = f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1"
        argv = [str(PG_BIN / "pg_ctl"), action, "-D", str(self.data), "-w", "-t", "30"]
        if action in ("start", "restart"):
            argv += ["-l", str(self.log), "-o", opts]
        self._as_postgres(*argv, *args, timeout_s=timeout_s)

    def init(self) -> None:
        initdb = str(PG_BIN / "initdb")
        self._as_postgres(initdb, "-D", str(self.data), "--auth=trust", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        self._pg_ctl("start")

    def restart(self, down_s: float = 0.0) -> None:
        """`pg_ctl restart -m fast`; with down_s, a fast stop and a start down_s later."""
        if not down_s:
            self._pg_ctl("restart", "-m", "fast")
            return
        self._pg_ctl("stop", "-m", "fast")
        time.sleep(down_s)
        self._pg_ctl("start")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                self._pg_ctl("stop", "-m", "immediate", timeout_s=40)

    def create_database(self, name: str) -> str:
        admin = create_engine(self.admin_url(), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            admin.dispose()
        return self.admin_url(name)

    def log_tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def pg_cluster() -> Iterator[PgCluster]:
    cluster = PgCluster()
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        cluster.remove()


@pytest.fixture
def pg_deployment(
    pg_cluster: PgCluster, broker: RedisServer, tmp_path: Path
) -> Iterator[Deployment]:
    """A chaos deployment whose ledger is a database on the private cluster, migrated with
    `tokenmill db upgrade`; every process it started is stopped afterwards."""
    url = pg_cluster.create_database(DB_NAME)
    env = service_env(url, broker.url, tmp_path, **FAST_SETTINGS)
    env["TOKENMILL_HEARTBEAT_S"] = "1"  # service_env sets 2; leases are 5 s here
    result = tokenmill(["db", "upgrade"], env)
    assert result.returncode == 0, f"db upgrade: {result.stdout}\n{result.stderr}"
    engine = database.make_engine(url)
    dep = Deployment(db=engine, env=env, tmp=tmp_path)
    try:
        yield dep
    finally:
        dep.stop_all()
        engine.dispose()


# 0: `pg_ctl restart -m fast` (connections cut, the server back within a second);
# 3: a fast stop, 3 s with nothing listening on the port, then a start
@pytest.mark.parametrize("down_s", [0.0, 3.0], ids=["restart", "down3s"])
def test_postgres_restarted_mid_run_run_still_finishes(
    pg_deployment: Deployment, pg_cluster: PgCluster, kimi_tokenizer_dir: Path, down_s: float
) -> None:
    dep = pg_deployment
    dep.enqueue(kimi_tokenizer_dir, ITEMS)
    a = dep.emulator({"--step-ms": "15"})
    b = dep.emulator({"--step-ms": "15"})
    wa = dep.worker("wa", "gpu-a", a.url)
    wb = dep.worker("wb", "gpu-b", b.url)
    dep.beat()
    dep.wait("work under way", lambda: dep.counts().done >= 60, 60)
    done_before = dep.counts().done
    assert done_before < ITEMS, "the run finished before the restart: nothing was tested"

    restarted_at = time.monotonic()
    pg_cluster.restart(down_s=down_s)
    outage_s = time.monotonic() - restarted_at
    dep.db.dispose()  # the test's own pooled connections died with the server
    wait_for("progress after the restart", lambda: dep.counts().done > done_before, 60)
    progress_s = time.monotonic() - restarted_at
    try:
        dep.wait_finished(max(10.0, 75 - (time.monotonic() - restarted_at)))
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\n{dep.log_tail('wa')}\n{dep.log_tail('wb')}\n--- postgres\n"
            + pg_cluster.log_tail()
        ) from None
    recover_s = time.monotonic() - restarted_at

    for name, proc in (("wa", wa), ("wb", wb)):
        assert proc.poll() is None, (
            f"worker {name} exited with {proc.returncode} after the Postgres restart:\n"
            + dep.log_tail(name)
        )
    stored = dep.audit({"gpu-a": a.config, "gpu-b": b.config})
    failed = [(s.item_key, s.error) for s in stored if s.status != "done"]
    assert failed == [], f"a Postgres restart failed items: {failed[:5]}"
    dep.summary("postgres_restart", stored, recover_s=recover_s)
    retried = sum(s.attempts > 1 for s in stored)
    print(
        f"CHAOS postgres_restart detail: mode={'restart' if not down_s else f'down{down_s:g}s'} "
        f"done_before={done_before} outage_s={outage_s:.1f} "
        f"first_progress_s={progress_s:.1f} items_with_retries={retried}"
    )

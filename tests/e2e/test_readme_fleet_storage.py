"""The README's Distributed section with image rows, each process in a working folder of its
own (the enqueue, each GPU node's worker, the export), as on separate machines: every image
item is done from the run's pinned storage, or the enqueue is refused naming the setting. And a
`tokenmill run --server DOWN` into the ledger of a working fleet: the fleet serves none of it,
before or after Ctrl-C.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select

from app.core.models import runs
from app.ledger import reads, run_queries
from ops.emulator_proc import start_emulator
from tests.support.moto_s3 import moto_s3
from tests.support.procs import ROOT, service_env, start_celery, start_worker, stop, wait_for
from tests.support.readme_fleet import Command, Fleet, commands, free_port, section_blocks

pytestmark = pytest.mark.e2e

NODES = ("gpu-a", "gpu-b")
BUCKET = "tokenmill-data"  # the README's s3://tokenmill-data/store, on moto
FLAGS = ["--mm", "kimi", "--step-ms", "1", "--median-tokens", "6"]
SIZES = [(28, 28), (56, 28), (64, 64), (90, 60), (120, 80), (200, 100)]
TEXT_ROWS = 12


def distributed() -> list[Command]:
    text = (ROOT / "README.md").read_text()
    return [c for block in section_blocks(text, "Distributed") for c in commands(block)]


def write_rows(folder: Path) -> tuple[Path, int]:
    """prompts.jsonl with image rows (relative paths against its folder) and text rows; the
    number of image rows."""
    from PIL import Image

    (folder / "pics").mkdir(parents=True)
    lines = []
    for i, (w, h) in enumerate(SIZES):
        Image.new("RGB", (w, h), (40 * i % 255, 90, 200 - 20 * i)).save(folder / f"pics/{i}.png")
        for k in range(2):
            part = {"type": "image_url", "image_url": {"url": f"pics/{i}.png"}}
            text = {"type": "text", "text": f"Describe picture {i}, take {k}."}
            lines.append(
                {"id": f"img{i}-{k}", "messages": [{"role": "user", "content": [part, text]}]}
            )
    images = len(lines)
    lines += [{"id": f"t{i}", "prompt": f"Name a prime above {i}."} for i in range(TEXT_ROWS)]
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path, images


@pytest.fixture
def fleet(
    tmp_path: Path, pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path
) -> Iterator[Fleet]:
    prompts, _ = write_rows(tmp_path / "user")
    paths = {"prompts.jsonl": str(prompts), "/models/Kimi-K2.5": str(kimi_tokenizer_dir)}
    fleet = Fleet.on_test_services(tmp_path, pg_engine, pg_url, redis_url, NODES, paths, FLAGS)
    try:
        yield fleet
    finally:
        if any(fleet.units.glob("*.json")):  # servers were started
            fleet.stop_all()
        else:
            stop(list(fleet.procs.values()))
        print(fleet.log_tail())


def test_readme_distributed_with_image_rows_in_separate_folders(
    fleet: Fleet, pg_engine: Engine, tmp_path: Path
) -> None:
    with moto_s3(BUCKET) as options:
        # the nodes' S3 credentials and endpoint, as each machine's environment holds them
        fleet.exports["TOKENMILL_STORAGE_OPTIONS"] = json.dumps(options)
        fleet.start_servers()
        printed = distributed()
        assert any("TOKENMILL_STORAGE_URL=s3://" in c.text for c in printed), printed
        for command in printed:
            fleet.run(command)

        def finished() -> bool:
            with pg_engine.connect() as conn:
                counts = reads.run_counts(conn, run_queries.get_run(conn, "r1"))
            return bool(counts.total and counts.finished)

        wait_for("run r1 to finish", finished, 300, fleet.log_tail)
        with pg_engine.connect() as conn:
            run = run_queries.get_run(conn, "r1")
            counts = reads.run_counts(conn, run)
            stored = list(reads.iter_items(conn, run.id))
        assert run.storage_url == f"s3://{BUCKET}/store"
        with_images = [s for s in stored if s.image_refs]
        assert len(with_images) == 2 * len(SIZES)
        assert counts.failed == 0 and counts.done == len(stored) == 2 * len(SIZES) + TEXT_ROWS

        # the export, from a folder of its own: every reference is an object of the store
        out = tmp_path / "exports"
        out.mkdir()
        env = fleet.env(None)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ops",
                "export",
                "r1",
                "--format",
                "specforge",
                "--out",
                "r1.jsonl",
            ],
            env=env,
            cwd=out,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        import s3fs

        s3 = s3fs.S3FileSystem(**options)
        rows = [json.loads(line) for line in (out / "r1.jsonl").read_text().splitlines()]
        uris = [ref["uri"] for row in rows for ref in row.get("images", [])]
        assert len(uris) == 2 * len(SIZES)
        for uri in uris:
            assert uri.startswith(f"s3://{BUCKET}/store/images/"), uri
            assert s3.exists(uri), uri


def test_readme_distributed_without_a_shared_store_is_refused_at_enqueue(
    fleet: Fleet, pg_engine: Engine
) -> None:
    """The section without its TOKENMILL_STORAGE_URL line, and a broker other machines reach:
    the enqueue is refused before anything is written, naming the setting."""
    fleet.broker_url = "redis://192.0.2.10:6379/0"  # a LAN address (never connected to)
    printed = [c for c in distributed() if "TOKENMILL_STORAGE_URL" not in c.text]
    enqueue = next(c for c in printed if c.argv[:2] == ["tokenmill", "enqueue"])
    for command in printed[: printed.index(enqueue)]:
        fleet.run(command)
    argv = [fleet.substitute(a, None) for a in enqueue.argv]
    done = subprocess.run(
        [sys.executable, "-m", "ops", *argv[1:]],
        env=fleet.env(None),
        cwd=fleet.home(None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "TOKENMILL_STORAGE_URL=s3://" in done.stderr, done.stderr
    assert "TOKENMILL_BROKER_URL" in done.stderr and "TOKENMILL_STORAGE_SHARED=true" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    with pg_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(runs)).scalar() == 0


def test_tokenmill_run_on_a_down_server_is_not_served_by_the_fleet(
    tmp_path: Path, pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path
) -> None:
    """A working fleet (one worker, beat reconciling every second) and a `tokenmill run` whose
    only server is down, into the same ledger: no item of the run is served by the fleet,
    while it runs and after Ctrl-C, while the fleet finishes a run of its own."""
    env = service_env(
        pg_url, redis_url, tmp_path / "data",
        TOKENMILL_RECONCILE_INTERVAL_S="1", TOKENMILL_RECONCILE_GRACE_S="0",
        TOKENMILL_DRAIN_TIMEOUT_S="1",
    )  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"Q{i}?"}) + "\n" for i in range(20))
    )
    tok = ["--tokenizer", str(kimi_tokenizer_dir), "--max-new-tokens", "8"]
    emu = start_emulator(["--step-ms", "1", "--median-tokens", "6"])
    worker_env = env | {"TOKENMILL_SGLANG_URL": emu.url, "TOKENMILL_SERVER_NAME": "gpu-0"}
    procs = [
        start_worker(worker_env, "w0", tmp_path / "w0.log"),
        start_celery("beat", env, tmp_path / "beat.log", "-s", str(tmp_path / "beat-schedule")),
    ]
    down = f"http://127.0.0.1:{free_port()}"
    solo = subprocess.Popen(
        [sys.executable, "-m", "ops", "run", str(prompts), "--run", "solo", "--server", down, *tok],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_for("run solo to exist", lambda: _items(pg_engine, "solo") is not None, 120)
        fleet = subprocess.run(
            [sys.executable, "-m", "ops", "enqueue", str(prompts), "--run", "fleet", *tok],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert fleet.returncode == 0, fleet.stderr
        wait_for("the fleet to finish its run", lambda: _done(pg_engine, "fleet") == 20, 120)
        time.sleep(3)  # reconcile passes (every second) while `tokenmill run` waits
        assert _served(pg_engine, "solo") == 0
        solo.send_signal(signal.SIGINT)
        _, err = solo.communicate(timeout=60)
        assert solo.returncode == 130, err
        time.sleep(4)  # reconcile passes after Ctrl-C
        assert _served(pg_engine, "solo") == 0
        assert _done(pg_engine, "solo") == 0
    finally:
        if solo.poll() is None:
            solo.kill()
        stop(procs)
        emu.stop()
    status = subprocess.run(
        [sys.executable, "-m", "ops", "status", "solo"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "run solo: served by `tokenmill run` only" in status.stdout, status.stdout


def _items(db: Engine, run: str) -> dict[str, int] | None:
    from app.core.models import items

    with db.connect() as conn:
        try:
            info = run_queries.get_run(conn, run)
        except Exception:
            return None
        rows = conn.execute(
            select(items.c.status, func.count())
            .where(items.c.run_id == info.id)
            .group_by(items.c.status)
        ).all()
    return {str(s): int(n) for s, n in rows}


def _done(db: Engine, run: str) -> int:
    return (_items(db, run) or {}).get("done", 0)


def _served(db: Engine, run: str) -> int:
    """Items of run that a fleet server (gpu-0) took: leased to it or finished on it."""
    from app.core.models import items

    with db.connect() as conn:
        info = run_queries.get_run(conn, run)
        n = conn.execute(
            select(func.count()).where(items.c.run_id == info.id, items.c.server == "gpu-0")
        ).scalar()
    return int(n or 0)


def test_enqueue_servers_binds_a_run_and_status_shows_it(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    from tests.support.procs import clean_env, tokenmill

    env = clean_env(tmp_path / "data")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q", "prompt": "Q?"}) + "\n")
    for name in ("gpu-a", "gpu-b"):
        added = tokenmill(["servers", "add", name, f"http://{name}:30000"], env, tmp_path)
        assert added.returncode == 0, added.stderr
    base = ["enqueue", str(prompts), "--tokenizer", str(kimi_tokenizer_dir)]
    typo = tokenmill([*base, "--run", "t", "--servers", "gpu-a,gpu-c"], env, tmp_path)
    assert typo.returncode == 2 and "gpu-c is not registered" in typo.stderr, typo.stderr
    bound = tokenmill([*base, "--run", "b", "--servers", "gpu-a"], env, tmp_path)
    assert bound.returncode == 0, bound.stderr
    status = tokenmill(["status", "b"], env, tmp_path)
    assert "run b: served by gpu-a (enqueue --servers)" in status.stdout, status.stdout
    shown = json.loads(tokenmill(["status", "b", "--json"], env, tmp_path).stdout)
    assert shown["served_by"] == {"driver": "fleet", "servers": ["gpu-a"]}
    other = tokenmill([*base, "--run", "b", "--servers", "gpu-b"], env, tmp_path)
    assert other.returncode != 0 and "servers: gpu-a → gpu-b" in other.stderr, other.stderr

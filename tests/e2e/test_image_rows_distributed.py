"""The sixty multimodal rows through the distributed path: `tokenmill enqueue` into Postgres
and Redis with the image store on an S3-compatible server (moto), two `celery -A app worker`
processes on two Kimi-mode emulators, the user's image files gone once enqueued. The export
holds the reference ids, its copied images hash to their references, verify is clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.ledger import reads, run_queries
from ops.emulator_proc import start_emulator
from tests.support.image_exports import (
    check_copied_images,
    check_refusals,
    check_specforge,
    sha256_of,
)
from tests.support.image_rows import build_image_rows
from tests.support.moto_s3 import moto_s3
from tests.support.procs import service_env, start_server_workers, stop, tokenmill, wait_for

pytestmark = pytest.mark.e2e

BUCKET = "tokenmill-images"
KIMI_FLAGS = ["--mm", "kimi", "--step-ms", "1", "--median-tokens", "6"]


def test_image_rows_through_celery_postgres_redis_and_s3(
    pg_url: str, pg_engine: Engine, redis_url: str, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    rows = build_image_rows(tmp_path / "user")  # relative sources against the rows' folder
    with moto_s3(BUCKET) as options:
        base = service_env(
            pg_url, redis_url, tmp_path / "data",
            TOKENMILL_STORAGE_URL=f"s3://{BUCKET}/store",
            TOKENMILL_STORAGE_OPTIONS=json.dumps(options),
            COLUMNS="1000",
        )  # fmt: skip
        enqueue = tokenmill(
            ["enqueue", str(rows.path), "--run", "img-d", "--tokenizer", str(kimi_tokenizer_dir),
             "--max-new-tokens", "8", "--seed", "3"],
            base,
        )  # fmt: skip
        assert enqueue.returncode == 0, enqueue.stderr
        check_refusals(enqueue.stderr, rows)
        import s3fs

        stored = s3fs.S3FileSystem(**options).ls(f"{BUCKET}/store/images")
        names = sorted(p.rsplit("/", 1)[1].split(".")[0] for p in stored)
        assert names == sorted(sha256_of(p) for p in rows.distinct_images())
        rows = rows.relocated(tmp_path / "elsewhere")  # workers read the store, never these

        emulators = [start_emulator(KIMI_FLAGS) for _ in range(2)]
        workers = start_server_workers(base, [emu.url for emu in emulators], tmp_path)
        try:

            def finished() -> bool:
                with pg_engine.connect() as conn:
                    counts = reads.run_counts(conn, run_queries.get_run(conn, "img-d"))
                return bool(counts.total and counts.finished)

            wait_for("run img-d finished", finished, 240, lambda: _logs(tmp_path))
        finally:
            stop(workers)
            for emu in emulators:
                emu.stop()
        with pg_engine.connect() as conn:
            counts = reads.run_counts(conn, run_queries.get_run(conn, "img-d"))
        assert counts.done == len(rows.expected) and counts.failed == 0, counts

        out = tmp_path / "export"
        out.mkdir()
        export = tokenmill(
            ["export", "img-d", "--out", str(out / "img.jsonl"), "--with-images"], base
        )
        assert export.returncode == 0, export.stderr
        samples = check_specforge(out / "img.jsonl", rows, kimi_tokenizer_dir)
        assert check_copied_images(out, samples) == {sha256_of(p) for p in rows.distinct_images()}
        verify = tokenmill(["verify", "img-d"], base)
        assert verify.returncode == 0, verify.stdout + verify.stderr


def _logs(tmp_path: Path) -> str:
    return "".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob("worker*.log")))
